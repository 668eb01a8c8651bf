"""Sentiment from a sentence encoder, with no trained classifier head.

The offline profile has real weights only for MiniLM, a sentence encoder. Texts are
embedded and compared with the mean embeddings of a few plainly positive and plainly
negative anchor sentences; the nearer side wins, and a softmax over the two cosine
similarities (sharpened by ``temperature``) gives the score. Coarse, but a real reading
of the text: clearly negative writing comes out NEGATIVE, clearly positive POSITIVE.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.model import Item, Result
from workers.models.hf_base import item_texts
from workers.models.hf_embed import OnSentenceEncoder, sentence_encoder

POSITIVE_ANCHORS = (
    "This is wonderful, I love it.",
    "A great success that made everyone happy.",
    "Excellent, delightful and inspiring.",
    "The celebration was joyful and the results were fantastic.",
)
NEGATIVE_ANCHORS = (
    "This is terrible, I hate it.",
    "A horrible disaster that caused great suffering.",
    "Awful, painful and depressing.",
    "The war brought death, destruction and misery.",
)


class AnchorSentiment(OnSentenceEncoder):
    """``{"label": "POSITIVE" | "NEGATIVE", "score"}`` from embedding similarity.

    Args:
        temperature: divides the similarities before the softmax (smaller: surer scores).
        load: how to load the sentence encoder
            (see :func:`~workers.models.hf_embed.sentence_encoder`).
    """

    def __init__(self, *, temperature: float = 0.05, **load: Any) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.embedder = sentence_encoder(load)
        self.max_length = self.embedder.max_length  # the input cap, for length-aware batching
        self.temperature = temperature
        anchors = self.embedder.embed([*POSITIVE_ANCHORS, *NEGATIVE_ANCHORS])
        n = len(POSITIVE_ANCHORS)
        self.poles = torch.nn.functional.normalize(
            torch.stack([anchors[:n].mean(0), anchors[n:].mean(0)]), dim=1
        )

    def predict(self, items: list[Item]) -> list[Result]:
        """Label each item's text."""
        vectors = self.embedder.embed(item_texts(items))
        probs = torch.softmax(vectors @ self.poles.T / self.temperature, dim=1)
        out: list[Result] = []
        for positive, negative in probs.tolist():
            if positive >= negative:
                out.append({"label": "POSITIVE", "score": float(positive)})
            else:
                out.append({"label": "NEGATIVE", "score": float(negative)})
        return out
