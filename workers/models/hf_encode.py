"""Hugging Face runners for encoder models: embeddings, text and token classification.

Each batch is tokenized in one call (padded, truncated to the model's maximum length) and
run in one forward pass under ``torch.inference_mode()``. Results hold plain JSON types.
On an accelerator each batch is padded to a shape bucket, and every bucket runs once at
load (:class:`EncoderRunner`, :mod:`workers.models.buckets`); on cuda, where asked, each
bucket's forward pass is a CUDA graph (:mod:`workers.models.graphs`). The :class:`Embedder`
runs a batch in three phases (:class:`~pipelines.model.StagedModel`): tokenized on the
host, launched on the device, its pooled rows fetched once the device is done, so the
worker prepares the next batch while the device runs this one. Nothing in a launch reads
the device (a host sync): whether a batch is padded is read from its mask on the host, and
the model is given its mask in the form it takes as given (:meth:`EncoderRunner.forward`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, TypedDict

import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BatchEncoding,
)

from pipelines.model import Item, Result, check_deadline, cold_shape
from workers.models.buckets import BucketLengths, Buckets, ShapeRun, fit
from workers.models.graphs import BucketGraphs, capture
from workers.models.hf_base import HFRunner, WeightsKey, item_texts


def padded(encoding: Mapping[str, torch.Tensor]) -> bool:
    """Whether a batch's attention mask masks any position: read on the host, where a
    look costs nothing, before the batch goes to the device (where it would be a sync)."""
    mask = encoding.get("attention_mask")
    return mask is not None and not bool(mask.all())


def takes_given_mask(model: Any) -> bool:
    """Whether ``model`` runs a 4D attention mask as given, with no look at its values.

    Given the tokenizer's 2D mask, transformers 5's ``create_bidirectional_mask``
    (``masking_utils``) asks ``attention_mask.all()`` to drop an all-ones mask: a Python
    bool of a device value, so a sync in every forward pass (not under a CUDA graph's
    capture, which it notices). A 4D mask it returns as is, and no mask it does not read.
    True for the models built on that function (BERT, DistilBERT, RoBERTa, MPNet, ...)
    with the ``sdpa`` or ``eager`` attention, which take a 4D mask; others keep the 2D one.
    """
    module = sys.modules.get(type(model).__module__)
    attention = getattr(model.config, "_attn_implementation", None)
    return attention in ("sdpa", "eager") and hasattr(module, "create_bidirectional_mask")


class HostBatch(NamedTuple):
    """A batch tokenized on the host: its real rows (a bucket's extra rows come after),
    its encoding, and whether its mask masks a position (:func:`padded`)."""

    rows: int
    encoding: BatchEncoding
    padded: bool


class Fetched(NamedTuple):
    """Tensors on their way from the device to the host (:meth:`EncoderRunner.fetch`)."""

    tensors: list[torch.Tensor]
    done: Any  # a blocking cuda event, None off a GPU

    def ready(self) -> list[torch.Tensor]:
        """The tensors, once the device has written them: a wait that sleeps (a blocking
        event: no core spins) and releases the GIL."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensors


class EncoderRunner(HFRunner):
    """A runner whose batch is one forward pass (no ``generate``): its batches can be
    padded to shape buckets, each bucket run once at load (:mod:`workers.models.buckets`;
    the worker calls :meth:`use_buckets`, :meth:`use_graphs` where asked, and
    :meth:`warm_up`). Every forward pass goes through :meth:`forward`, the one place the
    device is met; on an accelerator it says when a pass meets a shape the device had not
    run (:func:`~pipelines.model.cold_shape`).
    """

    graphs: BucketGraphs | None = None
    """Where captured (:meth:`use_graphs`), a CUDA graph per bucket, which :meth:`forward`
    replays instead of running the model eagerly."""

    def __init__(self, **load: Any) -> None:
        super().__init__(**load)
        self.met: set[tuple[int, ...]] = set()  # shapes the device has run
        self.given_mask = takes_given_mask(self.model)

    @property
    def accelerated(self) -> bool:
        """Whether the model runs on an accelerator, where a new shape costs a first call
        (buckets default to on there, off on the CPU)."""
        return self.device.type != "cpu"

    @property
    def overlapped(self) -> bool:
        """Whether the worker overlaps this runner's phases across batches (a staged
        runner's): on an accelerator; on the CPU its host work would only contend with
        its compute for the same cores."""
        return self.accelerated

    def max_rows(self, max_items: int) -> int:
        """The most rows one forward pass runs when a batch holds up to ``max_items``."""
        return max_items

    def use_buckets(
        self, enabled: bool | None, max_items: int, lengths: BucketLengths
    ) -> Buckets | None:
        """Pad batches to buckets from now on, or not.

        Args:
            enabled: pad; None: where the model is :attr:`accelerated`.
            max_items: the most items of one batch the worker sends.
            lengths: how lengths are bucketed, up to the runner's ``max_length``.

        Returns:
            The buckets (None: off).
        """
        on = self.accelerated if enabled is None else enabled
        self.graphs = None  # captured for the old buckets, if any
        self.buckets = (
            Buckets.build(self.max_rows(max_items), lengths, self.max_length) if on else None
        )
        return self.buckets

    def use_graphs(self) -> int:
        """Capture a CUDA graph per bucket (:func:`workers.models.graphs.capture`), which
        :meth:`forward` replays from now on; returns how many.

        Raises:
            CannotCapture: the model is not on cuda, there are no buckets, or a capture
                failed; the forward passes stay eager.
        """
        self.graphs = None
        shared = self.weights.graphs  # captured once for every runner on these weights
        self.graphs = capture(self.model, self.device, self.buckets, self._dummy, shared)
        return len(self.graphs.shapes)

    def on_device(self) -> AbstractContextManager[Any]:
        """Where the runner makes a CUDA call: under its own device, not the thread's
        current one (device 0 unless set), so that ``cuda:N`` gets its streams, events and
        page-locked memory; nothing off cuda."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def forward(self, encoding: Mapping[str, torch.Tensor], padded: bool) -> Any:
        """Run the model on one tokenized (and padded) batch: its bucket's CUDA graph
        where there is one (:attr:`graphs`), else eagerly. Either way the outputs are
        the caller's to keep.

        Args:
            encoding: the batch, on the device, with its 2D attention mask.
            padded: whether that mask masks a position (:func:`padded`, read on the
                host). Eagerly, a model that takes a mask as given
                (:func:`takes_given_mask`) is given none where nothing is masked, else
                the 4D mask transformers would build from the 2D one (made on the
                device: no read), so it never reads the mask to choose.
        """
        if self.accelerated:
            shape = tuple(encoding["input_ids"].shape)
            if shape not in self.met:
                self.met.add(shape)
                cold_shape()
        with self.on_device():
            if self.graphs is not None:
                outputs = self.graphs.run(encoding)
                if outputs is not None:
                    return outputs
            return self.model(**self._eager_inputs(encoding, padded))

    def _eager_inputs(
        self, encoding: Mapping[str, torch.Tensor], padded: bool
    ) -> dict[str, torch.Tensor]:
        inputs = dict(encoding)
        if not self.given_mask or "attention_mask" not in inputs:
            return inputs
        mask = inputs.pop("attention_mask")
        if padded:
            # As masking_utils' sdpa_mask and eager_mask make it: (rows, 1, query, key),
            # True (sdpa) or 0 (eager) where a position is read.
            rows, length = mask.shape
            keep = mask.bool()[:, None, None, :].expand(rows, 1, length, length)
            if self.model.config._attn_implementation == "eager":
                zero = torch.zeros((), device=keep.device, dtype=self.dtype)
                keep = torch.where(keep, zero, torch.finfo(self.dtype).min)
            inputs["attention_mask"] = keep
        return inputs

    def warm_up(self) -> list[ShapeRun]:
        """Run every bucket on dummy batches the way a served batch runs
        (:meth:`warm_batch`: the page-locked host copy, the forward pass, the head or
        pooling, the copy back): padded, its cold cost; with no position masked (an
        unmasked batch can pick another attention kernel); padded again, its warm cost.
        Graphs replay where captured. Nothing without buckets."""
        if self.buckets is None:
            return []
        runs = []
        for rows, length in self.buckets.shapes():
            masked = self._host_batch(rows, length, masked=True)
            unmasked = self._host_batch(rows, length, masked=False)
            first = self._timed(masked)
            self._timed(unmasked)
            runs.append(ShapeRun(rows, length, first, self._timed(masked)))
        return runs

    def warm_batch(self, host: HostBatch) -> None:
        """Run a host batch through every kernel a served batch of its shape meets, and
        wait for the device. Here the forward pass; a staged runner's override runs its
        ``launch`` and ``finish``."""
        with torch.inference_mode(), self.on_device():
            self.forward(host.encoding.to(self.device, non_blocking=True), host.padded)
            if self.device.type == "cuda":  # kernels are queued: wait for them
                torch.cuda.synchronize(self.device)

    def _host_batch(self, rows: int, length: int, *, masked: bool) -> HostBatch:
        """:meth:`_host_dummy` as :meth:`host_encoding` makes a served batch: whether it
        is :func:`padded` read from its mask, and :meth:`pinned`."""
        dummy = self._host_dummy(rows, length, masked=masked)
        return self.pinned(HostBatch(rows, dummy, padded(dummy)))

    def _host_dummy(self, rows: int, length: int, *, masked: bool) -> BatchEncoding:
        """A host batch of ``rows`` rows of ``length`` tokens: the shortest text, padded;
        ``masked``: its attention mask masks the padding, as a bucketed batch's nearly
        always does, else it masks nothing (a batch of texts all of the bucket's length:
        a mask can pick another attention kernel than none)."""
        dummy: BatchEncoding = self.tokenizer(["x"], return_tensors="pt")
        for key in list(dummy.keys()):
            dummy[key] = dummy[key][:, :length]
        fit(dummy, rows, length, int(self.tokenizer.pad_token_id or 0))
        if not masked:
            dummy["attention_mask"] = torch.ones_like(dummy["attention_mask"])
        return dummy

    def _dummy(self, rows: int, length: int) -> BatchEncoding:
        """A padded batch of ``rows`` rows of ``length`` tokens on the device (what a
        graph is captured on)."""
        moved: BatchEncoding = self._host_dummy(rows, length, masked=True).to(self.device)
        return moved

    def host_encoding(self, texts: list[str]) -> HostBatch:
        """:meth:`tokenize`, whether it is :func:`padded` (read here, on the host), and
        :meth:`pinned` (:meth:`launch` moves it)."""
        encoding = self.tokenize(texts)
        return self.pinned(HostBatch(len(texts), encoding, padded(encoding)))

    def pinned(self, host: HostBatch) -> HostBatch:
        """``host`` with its encoding page-locked on cuda (allocated under the runner's
        device), so that its copy to the device is asynchronous; as it is elsewhere."""
        if self.device.type != "cuda":
            return host
        with self.on_device():
            encoding = BatchEncoding({k: v.pin_memory() for k, v in host.encoding.items()})
        return host._replace(encoding=encoding)

    def fetch(self, tensors: list[torch.Tensor]) -> Fetched:
        """Queue the copy of device ``tensors`` back to the host, and mark when they are
        there: on cuda, an event recorded on the runner's device's current stream (where
        the copies are queued), blocking, so that waiting for it sleeps; off a GPU they
        already are."""
        with self.on_device():
            copies = [t.to("cpu", non_blocking=True) for t in tensors]
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                done.record(torch.cuda.current_stream(self.device))
        return Fetched(copies, done)

    def _timed(self, host: HostBatch) -> float:
        started = time.perf_counter()
        self.warm_batch(host)
        return time.perf_counter() - started


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
