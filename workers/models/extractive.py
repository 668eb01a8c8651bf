"""Extractive summaries from a sentence encoder: a document's most central sentences.

No model here writes text: the sentences of each document are ranked by how close their
embeddings (:func:`~workers.models.hf_encode.sentence_encoder`, MiniLM by default) are to
the document's mean, so the offline profile summarizes with real weights.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch

from pipelines.model import Item, Result
from workers.models.hf_base import item_texts
from workers.models.hf_encode import sentence_encoder

logger = logging.getLogger(__name__)


# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and
# whitespace; a line break always ends one. Abbreviations ("e.g. this") split wrongly,
# which costs little here: a fragment is simply a less central "sentence".
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"'\u201d\u2019)\]])\s+|\s*\n\s*")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with a simple punctuation rule.

    Args:
        text: any text.

    Returns:
        The non-empty sentences, stripped, in order.
    """
    return [part.strip() for part in _SENTENCE_BREAK.split(text) if part.strip()]


class ExtractiveSummarizer:
    """Extractive summaries: the sentences closest in meaning to the whole document.

    Each text is split into sentences; the sentences are embedded with a real sentence
    encoder (all sentences of the batch together, in chunks of ``batch_size``), scored by
    cosine similarity to the mean of the text's sentence embeddings, and the best
    ``num_sentences`` are kept in their original order. A text with no more sentences than
    that is returned as it is. Result per item: ``{"summary": str}``.

    Args:
        num_sentences: sentences per summary.
        batch_size: most sentences per forward pass.
        load: how to load the sentence encoder
            (:func:`~workers.models.hf_encode.sentence_encoder`); ``max_length`` bounds
            the tokens per sentence.
    """

    def __init__(self, *, num_sentences: int = 3, batch_size: int = 64, **load: Any) -> None:
        if num_sentences < 1:
            raise ValueError(f"num_sentences must be at least 1, got {num_sentences}")
        started = time.perf_counter()
        self.embedder = sentence_encoder(load, batch_size)
        self.weights_key = self.embedder.weights_key  # one model thread with its sharers
        self.num_sentences = num_sentences
        logger.info(
            "ExtractiveSummarizer loaded %s on %s as %s in %.2fs (num_sentences=%d)",
            self.embedder.model_path,
            self.embedder.device,
            self.embedder.dtype,
            time.perf_counter() - started,
            num_sentences,
        )

    def predict(self, items: list[Item]) -> list[Result]:
        """Summarize each item's text by picking its most central sentences.

        Args:
            items: ``{"text": str}`` dicts.

        Returns:
            ``{"summary": str}`` per item.
        """
        texts = item_texts(items)
        documents = [split_sentences(text) for text in texts]
        to_rank = [
            i for i, sentences in enumerate(documents) if len(sentences) > self.num_sentences
        ]
        embeddings = self.embedder.embed([s for i in to_rank for s in documents[i]])
        results: list[Result] = [{"summary": text} for text in texts]
        offset = 0
        for i in to_rank:
            sentences = documents[i]
            vectors = embeddings[offset : offset + len(sentences)]
            offset += len(sentences)
            # Rows are unit vectors, so a dot product with the normalised centroid is the
            # cosine similarity.
            centroid = torch.nn.functional.normalize(vectors.mean(dim=0), dim=0)
            best = (vectors @ centroid).topk(self.num_sentences).indices.tolist()
            results[i] = {"summary": " ".join(sentences[j] for j in sorted(best))}
        return results
