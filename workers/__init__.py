"""conveyor's execution runtime: batch assembly, model runners, publishing."""
