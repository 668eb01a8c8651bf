"""Sentence embeddings from an encoder model (:class:`Embedder`: the mean of its last
hidden states), and the runners built on them (:func:`sentence_encoder`,
:class:`OnSentenceEncoder`).

The :class:`Embedder` runs a batch in three phases (:class:`~pipelines.model.StagedModel`):
tokenized on the host, launched on the device, its pooled rows fetched once the device is
done, so the worker prepares the next batch while the device runs this one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AutoModel

from pipelines.model import Item, Result, check_deadline
from workers.models.buckets import BucketLengths, Buckets, ShapeRun
from workers.models.hf_base import WeightsKey, item_texts
from workers.models.hf_encode import EncoderRunner, Fetched, HostBatch


class Embedder(EncoderRunner):
    """Sentence embeddings: mean of the last hidden states over real (unpadded) tokens.

    Result per item: ``{"embedding": [float, ...]}`` (384 floats for MiniLM); an item with
    ``usage`` true also gets ``prompt_tokens``, its text's tokens as the model read them
    (special tokens included, after truncation).

    Args:
        normalize: scale each embedding to unit L2 norm, so a dot product is a cosine.
        batch_size: most texts per forward pass; bigger batches run in chunks.
        load: how to load the model (:class:`~workers.models.hf_base.LoadOptions`).
    """

    auto_cls = AutoModel

    def __init__(self, *, normalize: bool = True, batch_size: int = 64, **load: Any) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        super().__init__(**load)
        self.normalize = normalize
        self.batch_size = batch_size

    def max_rows(self, max_items: int) -> int:
        """Batches run in chunks of at most ``batch_size``."""
        return min(max_items, self.batch_size)

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Embed texts in chunks of at most ``batch_size``.

        Args:
            texts: the texts to embed.

        Returns:
            A float32 CPU tensor of shape ``(len(texts), hidden_size)``, rows in input order.
        """
        return self._gather(self._launch(self._tokenize(texts)))

    def prepare(self, items: list[Item]) -> Chunks:
        """The host phase: each item's text tokenized, in chunks of similar length (and
        counted, for the items that ask for ``usage``)."""
        asked = {i for i, item in enumerate(items) if item.get("usage") is True}
        return self._tokenize(item_texts(items), asked)

    def launch(self, prepared: Chunks) -> Pooled:
        """The device phase: each chunk run and pooled on the device, the copies back
        queued (asynchronous on a GPU: nothing here waits for the device)."""
        return self._launch(prepared)

    def finish(self, launched: Pooled) -> list[Result]:
        """The results, once the device is done (a wait that releases the GIL)."""
        rows = self._gather(launched).tolist()
        return [
            {"embedding": row} if tokens is None else {"embedding": row, "prompt_tokens": tokens}
            for row, tokens in zip(rows, launched.tokens, strict=True)
        ]

    def warm_batch(self, host: HostBatch) -> None:
        """:meth:`launch` and :meth:`finish`'s wait: the copy in, the forward pass, the
        pooling, the copy back (:meth:`EncoderRunner.warm_batch`)."""
        rows = host.rows
        self._gather(self._launch(Chunks(list(range(rows)), [host], [None] * rows)))

    def predict(self, items: list[Item]) -> list[Result]:
        """Embed each item's text.

        Args:
            items: ``{"text": str, "usage": bool (optional)}`` dicts.

        Returns:
            ``{"embedding": [float, ...]}`` per item, with ``prompt_tokens`` where asked.
        """
        return self.finish(self.launch(self.prepare(items)))

    def _tokenize(self, texts: list[str], counted: Collection[int] = ()) -> Chunks:
        # Chunking texts of similar length together keeps padding (wasted compute) low.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        chunks = []
        tokens: list[int | None] = [None] * len(texts)
        for start in range(0, len(order), self.batch_size):
            check_deadline()
            rows = order[start : start + self.batch_size]
            host = self.host_encoding([texts[i] for i in rows])
            if counted:
                # The mask as the model reads it: truncated, and 0 over the padding (a
                # bucket's too); a bucket's extra rows come after these.
                real = host.encoding["attention_mask"][: len(rows)].sum(dim=1).tolist()
                for index, length in zip(rows, real, strict=True):
                    if index in counted:
                        tokens[index] = int(length)
            chunks.append(host)
        return Chunks(order, chunks, tokens)

    def _launch(self, prepared: Chunks) -> Pooled:
        rows_out = []
        with torch.inference_mode(), self.on_device():
            for rows, encoding, masked in prepared.chunks:
                check_deadline()  # a long call (many chunks) stops once nobody waits
                on_device = encoding.to(self.device, non_blocking=True)
                hidden = self.forward(on_device, masked).last_hidden_state[:rows].float()
                # Padded positions (a bucket's included) have mask 0: they add nothing.
                mask = on_device["attention_mask"][:rows].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
                if self.normalize:
                    pooled = F.normalize(pooled, dim=-1)
                rows_out.append(pooled)
        return Pooled(prepared.order, self.fetch(rows_out), prepared.tokens)

    def _gather(self, launched: Pooled) -> torch.Tensor:
        rows = launched.rows.ready()
        if not rows:
            return torch.empty(0, int(self.model.config.hidden_size))
        sorted_rows = torch.cat(rows)
        result = torch.empty_like(sorted_rows)
        result[torch.tensor(launched.order)] = sorted_rows
        return result


class Chunks(NamedTuple):
    """A batch tokenized on the host: its order by length, its chunks, and each text's
    tokens, in input order, where counted (else None)."""

    order: list[int]
    chunks: list[HostBatch]
    tokens: list[int | None]


class Pooled(NamedTuple):
    """A batch launched: its rows' pooled embeddings, in the order of :class:`Chunks`, and
    its :attr:`Chunks.tokens`."""

    order: list[int]
    rows: Fetched
    tokens: list[int | None]


def sentence_encoder(load: dict[str, Any], batch_size: int = 64) -> Embedder:
    """The normalizing :class:`Embedder` under the runners built on sentence embeddings.

    Args:
        load: the runner's loading options (:class:`~workers.models.hf_base.LoadOptions`);
            ``model`` defaults to ``"minilm"`` (the bundled all-MiniLM-L6-v2), so these
            runners load offline with no model named.
        batch_size: most texts per forward pass.
    """
    return Embedder(normalize=True, batch_size=batch_size, **{"model": "minilm", **load})


class OnSentenceEncoder:
    """A runner built on a :func:`sentence_encoder` (its :attr:`embedder`): its shape
    buckets, CUDA graphs and warm-up are the encoder's, and it runs in the model thread
    of the encoder's weights (:attr:`weights_key`)."""

    embedder: Embedder

    @property
    def weights_key(self) -> WeightsKey:
        """The encoder's weights: one model thread with their other stages."""
        return self.embedder.weights_key

    def use_buckets(
        self, enabled: bool | None, max_items: int, lengths: BucketLengths
    ) -> Buckets | None:
        """The encoder's buckets (:meth:`EncoderRunner.use_buckets`): a batch's texts are
        one forward pass of it."""
        return self.embedder.use_buckets(enabled, max_items, lengths)

    def use_graphs(self) -> int:
        """Capture the encoder's graphs (:meth:`EncoderRunner.use_graphs`)."""
        return self.embedder.use_graphs()

    def warm_up(self) -> list[ShapeRun]:
        """Run each of the encoder's buckets (:meth:`EncoderRunner.warm_up`)."""
        return self.embedder.warm_up()
