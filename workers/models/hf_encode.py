"""The base of the Hugging Face runners for encoder models (:class:`EncoderRunner`): a
batch is one forward pass, and :meth:`EncoderRunner.forward` is the one place the device
is met. Its runners are :mod:`workers.models.hf_embed` (embeddings) and
:mod:`workers.models.hf_classify` (text and token classification).

Each batch is tokenized in one call (padded, truncated to the model's maximum length) and
run under ``torch.inference_mode()``. On an accelerator each batch is padded to a shape
bucket, and every bucket runs once at load (:mod:`workers.models.buckets`); on cuda, where
asked, each bucket's forward pass is a CUDA graph (:mod:`workers.models.graphs`). Nothing
in a launch reads the device (a host sync): whether a batch is padded is read from its
mask on the host, and the model is given its mask in the form it takes as given.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from transformers import BatchEncoding

from pipelines.model import cold_shape
from workers.models.buckets import BucketLengths, Buckets, ShapeRun, fit
from workers.models.graphs import BucketGraphs, capture
from workers.models.hf_base import HFRunner


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
