"""Hugging Face runners: every HF model a stage can name, in one import path.

Each runner implements :class:`pipelines.model.Model`: the worker builds it once per
process as ``Cls(model=..., device=..., dtype=..., cache_dir=..., **options)`` (a runner
declares only its own options; the loading ones are :class:`LoadOptions`) and calls
``predict`` with whole batches of ``{"text": str, ...}`` items. A batch is tokenized in one
call (padded, truncated to the model's maximum length, at most 512 tokens by default) and
run in one forward pass or one ``generate`` call under ``torch.inference_mode()``. Results
hold plain JSON types only.

``model`` is a Hugging Face hub id, a local directory, ``"minilm"`` (the bundled
all-MiniLM-L6-v2 sentence encoder) or ``"tiny:<kind>"`` (a random-weight model built on
first use, see :mod:`workers.models.tiny`).

- :class:`Embedder` (``AutoModel``, mean pooling): ``{"embedding": [float, ...]}``
- :class:`TextClassifier` (``AutoModelForSequenceClassification``): ``{"label", "score"}``
- :class:`TokenClassifier` (``AutoModelForTokenClassification``): ``{"entities": [...]}``
- :class:`Summarizer` (``AutoModelForSeq2SeqLM``): ``{"summary": str}``
- :class:`Generator` (``AutoModelForCausalLM``): ``{"generated_text": str}``
- :class:`ExtractiveSummarizer` (sentences ranked with :class:`Embedder`): ``{"summary": str}``

The code lives in :mod:`workers.models.hf_base` (settings and loading),
:mod:`workers.models.hf_encode` (the encoder runners' base), :mod:`workers.models.hf_embed`
(embeddings), :mod:`workers.models.hf_classify` (classifiers),
:mod:`workers.models.hf_generate` (the base of the runners that call ``generate``),
:mod:`workers.models.hf_text` (those runners) and :mod:`workers.models.extractive` (the
extractive summarizer), one file each so none grows past a screenful of concerns; stage
definitions name runners from here (``"workers.models.hf:Embedder"``).
"""

from __future__ import annotations

from workers.models.extractive import ExtractiveSummarizer, split_sentences
from workers.models.hf_base import (
    MAX_LENGTH_CAP,
    HFRunner,
    LoadOptions,
    item_texts,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from workers.models.hf_classify import (
    Entity,
    TextClassifier,
    TokenClassifier,
    TokenTag,
    aggregate_entities,
)
from workers.models.hf_embed import Embedder
from workers.models.hf_text import Generator, Summarizer

__all__ = [
    "MAX_LENGTH_CAP",
    "Embedder",
    "Entity",
    "ExtractiveSummarizer",
    "Generator",
    "HFRunner",
    "LoadOptions",
    "Summarizer",
    "TextClassifier",
    "TokenClassifier",
    "TokenTag",
    "aggregate_entities",
    "item_texts",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
    "split_sentences",
]
