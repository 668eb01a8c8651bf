"""Shape buckets: every batch a runner sends to its device padded to one of a few shapes.

An accelerator pays for each input shape the first time it runs it (kernel selection,
workspace and allocator growth): on an H100, MiniLM's first batch of a new (rows, tokens)
shape took ~80 ms against 9 ms warm, and with 32 batch sizes times every padded
length, a worker met cold shapes for minutes. Padding each batch up to a bucket, rows to a
power of two (up to the stage's max batch) and tokens to a multiple of 16 (or a listed
length, up to ``max_length``), bounds the shapes a runner ever runs, so all of them can run
once at load (:meth:`Bucketed.warm_up`), before the worker joins its group.

Padding never changes an answer: padded positions carry attention mask 0 and are pooled
or read by nobody; padded rows are copies of the batch's first row (never a fully masked
row, which some attention kernels turn into NaN) whose outputs are dropped.

On a CPU a new shape costs little (~5 ms for MiniLM on the 2-core machine) while padding
costs its full compute (rows and tokens run at a near-linear cost), so buckets default to
on for accelerators and off on the CPU (:attr:`pipelines.stages.Stage.buckets`).

Light on purpose (no torch import): the worker runtime imports it for every stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import BatchEncoding

BucketLengths = int | tuple[int, ...]
"""How lengths are bucketed: an int pads up to a multiple of it; a tuple pads up to the
least of its lengths that fits (``max_length`` is always a bucket too)."""


def batch_sizes(max_rows: int) -> tuple[int, ...]:
    """The powers of two below ``max_rows``, then ``max_rows`` itself.

    Args:
        max_rows: the most rows one forward pass runs (at least 1).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    sizes = [1 << k for k in range(max_rows.bit_length()) if 1 << k < max_rows]
    return (*sizes, max_rows)


def padded_lengths(spec: BucketLengths, max_length: int) -> tuple[int, ...]:
    """The lengths a batch is padded to, ascending, the last being ``max_length``.

    Args:
        spec: a multiple (``16``: 16, 32, ...) or explicit lengths (``(32, 128)``).
        max_length: the model's cap on tokens per text.

    Raises:
        ValueError: ``spec`` holds a length below 1, or is an empty tuple.
    """
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"bucket length multiple must be at least 1, got {spec}")
        listed: Iterable[int] = range(spec, max_length, spec)
    else:
        if not spec or min(spec) < 1:
            raise ValueError(f"bucket lengths must be a non-empty list of lengths >= 1: {spec}")
        listed = spec
    return (*sorted({n for n in listed if n < max_length}), max_length)


def _least_at_least(buckets: Sequence[int], n: int) -> int:
    """The least bucket >= ``n``; ``n`` itself past the largest (left as it is)."""
    return next((b for b in buckets if b >= n), n)


class ShapeRun(NamedTuple):
    """One bucket's runs at warm-up."""

    rows: int
    length: int
    first_s: float
    """The first run: what a request would have waited for on top (the cold cost)."""
    warm_s: float
    """A second run of the same shape: the bucket's own cost."""


@dataclass(frozen=True)
class Buckets:
    """The shapes one runner pads its batches to.

    Attributes:
        rows: batch sizes, ascending (:func:`batch_sizes`).
        lengths: padded lengths, ascending (:func:`padded_lengths`).
    """

    rows: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def build(cls, max_rows: int, lengths: BucketLengths, max_length: int) -> Buckets:
        """Buckets for batches of up to ``max_rows`` rows of up to ``max_length`` tokens."""
        return cls(batch_sizes(max_rows), padded_lengths(lengths, max_length))

    def shape(self, rows: int, length: int) -> tuple[int, int]:
        """The bucket a batch of ``rows`` rows, ``length`` tokens long, is padded to.

        A batch past the largest bucket keeps that dimension (it cannot be cut; a worker
        never sends one, its batches being bounded by the same max batch).
        """
        return _least_at_least(self.rows, rows), _least_at_least(self.lengths, length)

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket, smallest batches and lengths first."""
        return [(rows, length) for rows in self.rows for length in self.lengths]

    def pad(self, encoding: BatchEncoding, pad_id: int) -> BatchEncoding:
        """Pad a right-padded tokenizer output to its bucket (:func:`fit`), in place.

        Args:
            encoding: the tokenizer's output (``return_tensors="pt"``, right padding).
            pad_id: the tokenizer's pad token id.

        Returns:
            ``encoding``, its tensors replaced by padded ones.
        """
        rows, length = encoding["input_ids"].shape[:2]
        return fit(encoding, *self.shape(rows, length), pad_id) if rows else encoding


def fit(encoding: BatchEncoding, rows: int, length: int, pad_id: int) -> BatchEncoding:
    """Pad a right-padded tokenizer output (tensors of ``(rows, length, ...)``) up to
    ``(rows, length)``, in place.

    New positions hold ``pad_id`` in ``input_ids`` and 0 elsewhere (attention mask 0:
    masked); new rows are copies of the first row. Whoever reads the outputs keeps the
    first rows and positions, the real ones.

    Args:
        encoding: the tokenizer's output, at most ``rows`` rows of ``length`` tokens.
        rows: the rows it ends with.
        length: the tokens per row it ends with.
        pad_id: the tokenizer's pad token id.

    Returns:
        ``encoding``, its tensors replaced where they grew.
    """
    had_rows, had_length = encoding["input_ids"].shape[:2]
    if (had_rows, had_length) == (rows, length):
        return encoding
    for key, tensor in list(encoding.items()):
        padded = tensor.new_full((rows, length, *tensor.shape[2:]), 0)
        if key == "input_ids":
            padded.fill_(pad_id)
        padded[:had_rows, :had_length] = tensor
        padded[had_rows:] = padded[0]
        encoding[key] = padded
    return encoding


@runtime_checkable
class Bucketed(Protocol):
    """A runner that can pad its batches to :class:`Buckets`, capture a CUDA graph per
    bucket and warm them at load (the encoder runners of :mod:`workers.models.hf`); the
    worker calls these, in the model thread, before it joins its stage's group
    (:func:`workers.build.prepare_shapes`)."""

    def use_buckets(
        self, enabled: bool | None, max_items: int, lengths: BucketLengths
    ) -> Buckets | None:
        """Decide the runner's buckets; returns them (None: batches run as they come).

        Args:
            enabled: pad to buckets; None: where the device is an accelerator.
            max_items: the most items of one batch the worker sends.
            lengths: how lengths are bucketed (:data:`BucketLengths`).
        """
        ...

    def use_graphs(self) -> int:
        """Capture a CUDA graph per bucket, replayed from then on instead of the eager
        forward pass (:mod:`workers.models.graphs`); returns how many.

        Raises:
            CannotCapture: why the forward passes stay eager.
        """
        ...

    def warm_up(self) -> list[ShapeRun]:
        """Run every bucket twice (the first cold, the second timed warm); nothing
        without buckets."""
        ...


class CannotCapture(Exception):
    """Why a runner's forward passes stay eager though CUDA graphs were asked for: one
    line, which the worker logs (:func:`workers.build.prepare_shapes`). Here, with
    :class:`Bucketed`, so that the worker need not import torch to name it."""


def summary(runs: Sequence[ShapeRun]) -> str:
    """One line: the warm-up's shapes and time, and the warm rate (rows/s) per batch size at
    the shortest and the longest length."""
    total = sum(r.first_s + r.warm_s for r in runs)
    first = sum(r.first_s for r in runs)
    shortest, longest = min(r.length for r in runs), max(r.length for r in runs)

    def rate(rows: int, length: int) -> str:
        found = [r for r in runs if r.rows == rows and r.length == length]
        return f"{rows / found[0].warm_s:,.0f}" if found and found[0].warm_s > 0 else "-"

    per_size = ", ".join(
        f"{rows}: {rate(rows, shortest)}/{rate(rows, longest)}"
        for rows in sorted({r.rows for r in runs})
    )
    return (
        f"warmed {len(runs)} shapes in {total:.2f}s (first runs {first:.2f}s); "
        f"warm rows/s per batch size at {shortest}/{longest} tokens: {per_size}"
    )
