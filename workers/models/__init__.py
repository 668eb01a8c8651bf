"""Model runners: Hugging Face pipelines, generated tiny models, toy and function runners."""
