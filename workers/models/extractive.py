"""Extractive summaries from a sentence encoder: a document's most central sentences.

No model here writes text: the sentences of each document are ranked by how close their
embeddings (:func:`~workers.models.hf_embed.sentence_encoder`, MiniLM by default) are to
the document's mean, so the offline profile summarizes with real weights.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch

from pipelines.model import Item, Result
from workers.models.buckets import BucketLengths, Buckets
from workers.models.hf_base import item_texts
from workers.models.hf_embed import OnSentenceEncoder, sentence_encoder

logger = logging.getLogger(__name__)


# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and
# whitespace; a line break always ends one. Abbreviations ("e.g. this") split wrongly,
# which costs little here: a fragment is simply a less central "sentence".
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"'\u201d\u2019)\]])\s+|\s*\n\s*")


MAX_SENTENCES = 256
"""The sentences of one text an extractive summary ranks, by default: on the 2-core CPU
machine, 8 texts at this bound (a full batch) take about 2-4 s of MiniLM."""


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with a simple punctuation rule.

    Args:
        text: any text.

    Returns:
        The non-empty sentences, stripped, in order.
    """
    return [part.strip() for part in _SENTENCE_BREAK.split(text) if part.strip()]


class ExtractiveSummarizer(OnSentenceEncoder):
    """Extractive summaries: the sentences closest in meaning to the whole document.

    Each text is split into sentences; its first ``max_sentences`` are embedded with a
    real sentence encoder (all sentences of the batch together, in chunks of
    ``batch_size``), scored by cosine similarity to the mean of the text's sentence
    embeddings, and the best ``num_sentences`` are kept in their original order. A text
    with no more sentences than that is returned as it is. Result per item:
    ``{"summary": str}``.

    The bound on sentences bounds a batch's cost whatever its texts hold: 25,000 short
    sentences (100k characters of ``"Go. "``) once held the model thread, shared with
    embed and sentiment, for 40 s. Past it, a document is summarized from its opening,
    as wiki-summary does by characters.

    Args:
        num_sentences: sentences per summary.
        max_sentences: the most sentences of one text that are ranked (its first).
        batch_size: most sentences per forward pass.
        load: how to load the sentence encoder
            (:func:`~workers.models.hf_embed.sentence_encoder`); ``max_length`` bounds
            the tokens per sentence.
    """

    def __init__(
        self,
        *,
        num_sentences: int = 3,
        max_sentences: int = MAX_SENTENCES,
        batch_size: int = 64,
        **load: Any,
    ) -> None:
        if not 1 <= num_sentences <= max_sentences:
            raise ValueError(
                f"need 1 <= num_sentences <= max_sentences, got {num_sentences}, {max_sentences}"
            )
        self.max_sentences = max_sentences
        started = time.perf_counter()
        self.embedder = sentence_encoder(load, batch_size)
        self.num_sentences = num_sentences
        logger.info(
            "ExtractiveSummarizer loaded %s on %s as %s in %.2fs (num_sentences=%d)",
            self.embedder.model_path,
            self.embedder.device,
            self.embedder.dtype,
            time.perf_counter() - started,
            num_sentences,
        )

    def use_buckets(
        self, enabled: bool | None, max_items: int, lengths: BucketLengths
    ) -> Buckets | None:
        """The encoder's buckets (:meth:`~workers.models.hf_encode.EncoderRunner.use_buckets`),
        for up to ``batch_size`` sentences a pass whatever ``max_items`` is: a batch's
        texts hold any number of sentences, embedded together in chunks."""
        return self.embedder.use_buckets(enabled, self.embedder.batch_size, lengths)

    def predict(self, items: list[Item]) -> list[Result]:
        """Summarize each item's text by picking its most central sentences.

        Args:
            items: ``{"text": str}`` dicts.

        Returns:
            ``{"summary": str}`` per item.
        """
        texts = item_texts(items)
        documents = [split_sentences(text)[: self.max_sentences] for text in texts]
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
