"""Hugging Face runners that classify with an encoder model: a text's label
(:class:`TextClassifier`), and the named entities in it (:class:`TokenClassifier`, its
tokens' labels merged by :func:`aggregate_entities`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, TypedDict

import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from pipelines.model import Item, Result
from workers.models.hf_base import item_texts
from workers.models.hf_encode import EncoderRunner, Fetched, HostBatch, padded


class TextClassifier(EncoderRunner):
    """Single-label text classification: the most probable label and its probability.

    Result per item: ``{"label": str, "score": float}``.

    Args:
        load: how to load the model (:class:`~workers.models.hf_base.LoadOptions`),
            such as ``model="tiny:sentiment"``.
    """

    auto_cls = AutoModelForSequenceClassification

    def prepare(self, items: list[Item]) -> HostBatch:
        """The host phase: the items' texts tokenized."""
        return self.host_encoding(item_texts(items))

    def launch(self, prepared: HostBatch) -> Fetched:
        """The device phase: each item's best label and its probability, on their way
        back (a bucket's extra rows come last: only the first ones are answers)."""
        rows, encoding, masked = prepared
        with torch.inference_mode(), self.on_device():
            on_device = encoding.to(self.device, non_blocking=True)
            logits = self.forward(on_device, masked).logits[:rows]
            scores, indices = logits.float().softmax(dim=-1).max(dim=-1)
        return self.fetch([scores, indices])

    def finish(self, launched: Fetched) -> list[Result]:
        """The results, once the device is done."""
        scores, indices = launched.ready()
        id2label = self.model.config.id2label
        return [
            {"label": id2label[index], "score": score}
            for index, score in zip(indices.tolist(), scores.tolist(), strict=True)
        ]

    def warm_batch(self, host: HostBatch) -> None:
        """:meth:`launch` and :meth:`finish` (:meth:`EncoderRunner.warm_batch`)."""
        self.finish(self.launch(host))

    def predict(self, items: list[Item]) -> list[Result]:
        """Classify each item's text.

        Args:
            items: ``{"text": str}`` dicts.

        Returns:
            ``{"label": str, "score": float}`` per item.
        """
        if not items:
            return []
        return self.finish(self.launch(self.prepare(items)))


class TokenTag(NamedTuple):
    """One token's prediction, as :func:`aggregate_entities` consumes it."""

    label: str
    """Predicted label: ``"O"``, ``"B-PER"``, ``"I-PER"`` or a bare type such as ``"PER"``."""
    score: float
    """Probability of ``label``."""
    start: int
    """Character offset where the token starts in the text."""
    end: int
    """Character offset where the token ends (exclusive)."""
    word_id: int | None
    """Index of the word the token belongs to; ``None`` for special tokens."""


class Entity(TypedDict):
    """One named entity found in a text."""

    word: str
    entity_group: str
    score: float
    start: int
    end: int


def _split_label(label: str) -> tuple[str, str] | None:
    """``"B-PER"`` → ``("B", "PER")``, ``"PER"`` → ``("", "PER")``, ``"O"`` → ``None``."""
    if label in ("O", ""):
        return None
    prefix, dash, entity_type = label.partition("-")
    if dash and prefix in ("B", "I", "E", "S") and entity_type:
        return prefix, entity_type
    return "", label


def aggregate_entities(text: str, tags: Sequence[TokenTag]) -> list[Entity]:
    """Merge per-token labels into entities ("simple" aggregation, word-aware).

    A token labelled ``I-X`` (or a bare ``X``) joins the entity right before it when that
    entity has type ``X``; ``B-X``, or a type change, starts a new entity; ``O`` ends it and
    is dropped. Tokens continuing a word (same ``word_id`` as the token before) always go
    with their word's first token, whatever their own label, so a word is never split
    between entities. BIOES tags work too: ``S-`` acts like ``B-`` and ``E-`` like ``I-``.
    Special tokens (``word_id`` ``None``) end the current entity.

    Args:
        text: the text the offsets point into.
        tags: the text's tokens in order.

    Returns:
        Entities in text order; ``score`` is the mean of their tokens' scores.
    """
    entities: list[Entity] = []
    current: tuple[str, int, int, list[float]] | None = None  # type, start, end, scores
    previous_word: int | None = None
    word_in_entity = False

    def close() -> None:
        if current is not None:
            entity_type, start, end, scores = current
            entities.append(
                Entity(
                    word=text[start:end],
                    entity_group=entity_type,
                    score=sum(scores) / len(scores),
                    start=start,
                    end=end,
                )
            )

    for tag in tags:
        if tag.word_id is None:
            close()
            current, previous_word, word_in_entity = None, None, False
            continue
        if tag.word_id == previous_word:
            if word_in_entity and current is not None:
                current = (
                    current[0],
                    current[1],
                    max(current[2], tag.end),
                    [*current[3], tag.score],
                )
            continue
        previous_word = tag.word_id
        parsed = _split_label(tag.label)
        if parsed is None:
            close()
            current, word_in_entity = None, False
            continue
        prefix, entity_type = parsed
        if current is not None and current[0] == entity_type and prefix in ("I", "E", ""):
            current = (entity_type, current[1], max(current[2], tag.end), [*current[3], tag.score])
        else:
            close()
            current = (entity_type, tag.start, tag.end, [tag.score])
        word_in_entity = True
    close()
    return entities


class TokenClassifier(EncoderRunner):
    """Named-entity recognition with word-aware "simple" aggregation.

    Result per item: ``{"entities": [{"word", "entity_group", "score", "start", "end"}]}``
    where ``word == text[start:end]``. Needs a fast tokenizer (for character offsets).

    Args:
        load: how to load the model (:class:`~workers.models.hf_base.LoadOptions`),
            such as ``model="tiny:ner"``; entities past ``max_length`` tokens are not found.
    """

    auto_cls = AutoModelForTokenClassification

    def __init__(self, **load: Any) -> None:
        super().__init__(**load)
        if not self.tokenizer.is_fast:
            raise ValueError(
                f"{self.load.model!r} has no fast tokenizer; TokenClassifier needs offsets"
            )

    def predict(self, items: list[Item]) -> list[Result]:
        """Find the entities in each item's text.

        Args:
            items: ``{"text": str}`` dicts.

        Returns:
            ``{"entities": [...]}`` per item.
        """
        if not items:
            return []
        texts = item_texts(items)
        encoding = self.tokenize(texts, return_offsets_mapping=True)
        offsets = encoding.pop("offset_mapping").tolist()
        masked = padded(encoding)
        encoding = encoding.to(self.device)
        with torch.inference_mode():
            logits = self.forward(encoding, masked).logits
            scores, indices = logits.float().softmax(dim=-1).max(dim=-1)
        id2label = self.model.config.id2label
        results: list[Result] = []
        for row, text in enumerate(texts):
            # word_ids covers the tokenizer's own padding; a bucket's positions past it
            # are masked and read by nobody.
            width = len(encoding.word_ids(row))
            tags = [
                TokenTag(id2label[index], score, start, end, word_id)
                for index, score, (start, end), word_id in zip(
                    indices[row, :width].tolist(),
                    scores[row, :width].tolist(),
                    offsets[row][:width],
                    encoding.word_ids(row),
                    strict=True,
                )
            ]
            results.append({"entities": aggregate_entities(text, tags)})
        return results
