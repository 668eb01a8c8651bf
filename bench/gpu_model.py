"""``python -m bench.gpu``'s in-process section: the embed runner alone, on the bench's device.

Each variant is the built-in ``embed`` stage's runner built as a worker builds it
(:func:`workers.build.build_model`, then :func:`workers.build.prepare_shapes`, which gives
it its shape buckets and runs every one before the first batch), so its figures are the
ceiling of the served runner:

- ``eager``: buckets off (``CONVEYOR_BUCKETS=false``): each batch runs at its own shape;
- ``bucketed``: buckets on and warmed (``CONVEYOR_BUCKETS=true``, ``CONVEYOR_WARMUP``);
- ``CUDA graphs``: bucketed, with the worker's CUDA-graph setting on (:data:`GRAPHS_FIELD`),
  measured only when asked (``--graphs``), on cuda, and where the worker has the setting.
  Its figures are published only where graphs were captured and replayed (the runner's
  replays counted, above 0); a capture that failed (the worker then runs eager) leaves
  the row "not captured: <why>", never an eager rate under the graphs' name.

Each is timed at a few batch sizes, by the better of two loops (:func:`ceiling`): serial
(prepare, launch, finish, one batch after another in one thread) and, for a runner the
worker overlaps, overlapped (batch n+1 prepared in a host thread while n runs, n-1
finished beside n's launch, as :class:`workers.runner.Runner` does); on cuda, CUDA events
around each launch give the device's busy share of the wall time (:class:`DeviceClock`).
Its answers on the largest batch are compared with the CPU's float32 answers on the same
texts (the worst cosine of any row).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from bench.workloads import items
from pipelines.model import Item, Model
from pipelines.settings import load_settings
from pipelines.stages import BUILTIN, Stage
from workers.build import build_model, prepare_shapes
from workers.models.buckets import Buckets
from workers.runner import overlapped
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)

GRAPHS_FIELD = "cuda_graphs"
"""The worker setting that captures CUDA graphs per bucket (``CONVEYOR_CUDA_GRAPHS``):
the bench sets it only with ``--graphs`` and only where :class:`WorkerSettings` has it."""
GRAPHS_ENV = f"CONVEYOR_{GRAPHS_FIELD.upper()}"
""":data:`GRAPHS_FIELD` in the served workers' environment."""

CHUNKS = 4
"""Distinct batches cycled per batch size: each is run once before the timing starts, so
an eager runner meets its shapes cold outside the figure, as a warm server would."""


@dataclass
class Variant:
    """One way of running the runner, as measured.

    Attributes:
        name: ``eager``, ``bucketed`` or ``CUDA graphs``.
        rates: sentences per second, by batch size.
        worst_cosine: the least cosine between a row of its answer and the CPU float32
            answer on the same texts (None: not compared).
        warm_s: how long :func:`~workers.build.prepare_shapes` took (buckets, warm-up,
            capture).
        shapes: the buckets it warmed (0: none).
        dtype: the weights' dtype.
        skipped: why it was not measured ("" where it was).
        loops: the loop that gave each batch size's rate (``serial`` or ``overlapped``).
        device_busy: by batch size, the device's busy share of that loop's wall time,
            from CUDA event timings (cuda only).
        replays: batches its CUDA graphs ran (the ``CUDA graphs`` variant only).
        answers: its embeddings of the largest batch's texts.
    """

    name: str
    rates: dict[int, float] = field(default_factory=dict)
    worst_cosine: float | None = None
    warm_s: float = 0.0
    shapes: int = 0
    dtype: str = ""
    skipped: str = ""
    loops: dict[int, str] = field(default_factory=dict)
    device_busy: dict[int, float] = field(default_factory=dict)
    replays: int = 0
    answers: list[list[float]] = field(default_factory=list, repr=False)


def graphs_setting() -> bool:
    """Whether this conveyor's worker has the CUDA-graph setting (:data:`GRAPHS_FIELD`)."""
    return GRAPHS_FIELD in WorkerSettings.model_fields


def embed_stage(quick: bool) -> Stage:
    """The stage the runner is built for: the built-in ``embed``; with ``quick``, texts
    capped at 32 tokens (the bench's sentences have at most 29) and so one bucket length,
    so warming the buckets takes seconds on a small CPU, not minutes."""
    stage = BUILTIN["embed"]
    if quick:
        stage = replace(stage, bucket_lengths=(32,), options={**stage.options, "max_length": 32})
    return stage


def measure(
    device: str, batches: list[int], seconds: float, *, graphs: bool, quick: bool
) -> list[Variant]:
    """Build and time every variant, one at a time, then compare each one's answers with
    the CPU float32 runner's.

    Args:
        device: where the variants run (``cpu``, ``cuda``, ``cuda:N``).
        batches: the batch sizes to time, each for about ``seconds``.
        seconds: time per batch size.
        graphs: measure the CUDA-graph variant (``--graphs``).
        quick: build for :func:`embed_stage`'s quick buckets.
    """
    stage = embed_stage(quick)
    corpus = items(CHUNKS * max(batches), "embed")
    texts = corpus[: max(batches)]
    asked: dict[str, dict[str, Any]] = {
        "eager": {"buckets": False},
        "bucketed": {"buckets": True, "warmup": True},
        "CUDA graphs": {"buckets": True, "warmup": True, GRAPHS_FIELD: True},
    }
    skipped = graphs_skipped(device, graphs)
    out: list[Variant] = []
    for name, values in asked.items():
        if name == "CUDA graphs" and skipped:
            out.append(Variant(name, skipped=skipped))
            continue
        settings = load_settings(
            WorkerSettings, device=device, max_batch_size=max(batches), **values
        )
        out.append(timed(name, stage, settings, corpus, batches, seconds))
    cpu = load_settings(WorkerSettings, device="cpu", dtype="float32", buckets=False)
    reference = _answers(build_model(stage, cpu), texts)
    for variant in out:
        if not variant.skipped:
            variant.worst_cosine = worst_cosine(variant.answers, reference)
    return out


def graphs_skipped(device: str, asked: bool) -> str:
    """Why the CUDA-graph variant is not measured ("" where it is)."""
    if not asked:
        return "not measured (run with --graphs)"
    if not device.startswith("cuda"):
        return "not measured: CUDA graphs need --device cuda"
    if not graphs_setting():
        return f"not measured: this worker has no {GRAPHS_FIELD} setting ({GRAPHS_ENV})"
    return ""


def timed(
    name: str,
    stage: Stage,
    settings: WorkerSettings,
    corpus: list[Item],
    batches: list[int],
    seconds: float,
) -> Variant:
    """One variant: built, prepared (timed), run at each batch size, its answers kept.
    With ``cuda_graphs`` asked, a variant whose runner captured none, or replayed none,
    comes back skipped, "not captured: <why>", its eager figures dropped.

    Args:
        name: the variant's name.
        stage: the stage its runner is built for.
        settings: the worker settings it is built and prepared with.
        corpus: the items, cycled (:data:`CHUNKS` batches of the largest size at least).
        batches: the batch sizes to time.
        seconds: time per batch size and loop.
    """
    model = build_model(stage, settings)
    try:
        started = time.perf_counter()
        with _warnings("workers.build") as warned:
            prepare_shapes(model, stage, settings)
        variant = Variant(name, warm_s=time.perf_counter() - started)
        if settings.cuda_graphs and graph_replays(model) is None:
            # prepare_shapes logged why and left the runner eager: say so, time nothing.
            why = warned[-1] if warned else "the runner has no graphs"
            return Variant(name, skipped=f"not captured: {why}")
        buckets = getattr(model, "buckets", None)
        variant.shapes = len(buckets.shapes()) if isinstance(buckets, Buckets) else 0
        variant.dtype = str(getattr(model, "dtype", "-")).removeprefix("torch.")
        for size in batches:
            rate, loop, busy = ceiling(model, corpus, size, seconds)
            variant.rates[size], variant.loops[size] = rate, loop
            if busy is not None:
                variant.device_busy[size] = busy
            logger.info("in-process %s batch %d: %.1f sentences/s (%s)", name, size, rate, loop)
        variant.answers = _answers(model, corpus[: max(batches)])
        if settings.cuda_graphs:
            variant.replays = graph_replays(model) or 0
            if not variant.replays:  # captured, yet every batch ran eager
                return Variant(name, skipped="not captured: no batch replayed a graph")
        return variant
    finally:
        del model
        _release()


def graph_replays(model: object) -> int | None:
    """How many batches ``model``'s CUDA graphs ran (None: it has none captured)."""
    replays = getattr(getattr(model, "graphs", None), "replays", None)
    return replays if isinstance(replays, int) else None


@contextmanager
def _warnings(name: str) -> Iterator[list[str]]:
    """The WARNING (and worse) messages logger ``name`` logs in this block, each without
    its ``stage <name>:`` head (a capture that failed says why in one)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage().partition(": ")[2] or record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger(name).addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger(name).removeHandler(handler)


def ceiling(
    model: Model, corpus: list[Item], size: int, seconds: float
) -> tuple[float, str, float | None]:
    """The runner's best rate at batch ``size``: the better of a serial loop and, for a
    runner the worker overlaps (:func:`workers.runner.overlapped`), an overlapped one.

    Args:
        model: the runner.
        corpus: at least :data:`CHUNKS` x ``size`` items, cycled in batches of ``size``.
        size: the batch size.
        seconds: time per loop.

    Returns:
        Items per second, the loop that gave it (``serial`` or ``overlapped``), and the
        device's busy share of that loop's time (None: not read, off cuda).
    """
    chunks = [corpus[i : i + size] for i in range(0, CHUNKS * size, size)]
    for chunk in chunks:  # every shape met once, outside the figures
        model.predict(chunk)
    best = (*_serial(model, chunks, seconds), "serial")
    if overlapped(model):
        rate, busy = _overlapped(model, chunks, seconds)
        if rate > best[0]:
            best = (rate, busy, "overlapped")
    return best[0], best[2], best[1]


def _serial(model: Any, chunks: list[list[Item]], seconds: float) -> tuple[float, float | None]:
    """Items per second running the chunks one after another in this thread (a staged
    runner's phases in turn), and the device's busy share."""
    clock = DeviceClock.on(model)
    staged = overlapped(model)
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        chunk = chunks[done % len(chunks)]
        if staged:
            prepared = model.prepare(chunk)
            with clock.timing():
                launched = model.launch(prepared)
            model.finish(launched)
        else:
            with clock.timing():
                model.predict(chunk)
        done += 1
    wall = time.perf_counter() - started
    return done * len(chunks[0]) / wall, clock.busy(wall)


def _overlapped(model: Any, chunks: list[list[Item]], seconds: float) -> tuple[float, float | None]:
    """Items per second with the worker's overlap: batch n+1 prepared in a host thread
    while n runs, n-1 finished in another beside n's launch; launches in this thread, one
    at a time, in order. And the device's busy share."""
    clock = DeviceClock.on(model)
    done = 0
    with ThreadPoolExecutor(2, thread_name_prefix="bench-host") as host:
        started = time.perf_counter()
        prepared = host.submit(model.prepare, chunks[0])
        finishing: Future[Any] | None = None
        launched_n = 0
        while time.perf_counter() - started < seconds:
            ready = prepared.result()
            launched_n += 1
            prepared = host.submit(model.prepare, chunks[launched_n % len(chunks)])
            with clock.timing():
                launched = model.launch(ready)
            if finishing is not None:
                finishing.result()
                done += 1
            finishing = host.submit(model.finish, launched)
        if finishing is not None:
            finishing.result()
            done += 1
        wall = time.perf_counter() - started
        prepared.result()  # the one prepared ahead is not counted
    return done * len(chunks[0]) / wall, clock.busy(wall)


class DeviceClock:
    """The device's busy time from CUDA event timings: an event pair on the runner's
    device's current stream around each launch. Batches queue back to back on the stream,
    so a launch's start event fires when the previous batch's work ends: the pairs' times
    add up to the device's busy time (an upper bound where the device waited for the
    host between two launches). Off cuda it times nothing (:meth:`busy` is None).

    Args:
        device: the runner's device (None: not cuda).
    """

    def __init__(self, device: Any | None) -> None:
        self.device = device
        self._pairs: list[tuple[Any, Any]] = []

    @classmethod
    def on(cls, model: object) -> DeviceClock:
        """A clock for ``model``'s device (its ``device`` attribute), timing only on cuda."""
        device = getattr(model, "device", None)
        return cls(device if getattr(device, "type", None) == "cuda" else None)

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Record an event before and after the block on the device's current stream."""
        if self.device is None:
            yield
            return
        import torch

        stream = torch.cuda.current_stream(self.device)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))  # type: ignore[no-untyped-call]
        start.record(stream)
        yield
        end.record(stream)
        self._pairs.append((start, end))

    def busy(self, wall_s: float) -> float | None:
        """The device's busy share of ``wall_s`` (None: not cuda, or nothing timed)."""
        if self.device is None or not self._pairs or wall_s <= 0:
            return None
        self._pairs[-1][1].synchronize()
        busy_ms = float(sum(start.elapsed_time(end) for start, end in self._pairs))
        return min(1.0, busy_ms / 1000 / wall_s)


def _answers(model: Model, texts: list[Item]) -> list[list[float]]:
    """The embedding of each text, in one call (an item that failed raises here)."""
    out = []
    for result in model.predict(texts):
        if isinstance(result, BaseException):
            raise result
        out.append(result["embedding"])
    return out


def worst_cosine(answer: list[list[float]], reference: list[list[float]]) -> float:
    """The least cosine between matching rows of two lists of embeddings."""
    import torch

    a, b = torch.tensor(answer), torch.tensor(reference)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def _release() -> None:
    """Give back what a dropped runner held on the device (its weights, its graphs)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
