"""``python -m bench.gpu``'s in-process section: the embed runner alone, on the bench's device.

Each variant is the built-in ``embed`` stage's runner built as a worker builds it
(:func:`workers.build.build_model`, then :func:`workers.build.prepare_shapes`, which gives
it its shape buckets and runs every one before the first batch), so its figures are the
ceiling of the served runner:

- ``eager``: buckets off (``CONVEYOR_BUCKETS=false``): each batch runs at its own shape;
- ``bucketed``: buckets on and warmed (``CONVEYOR_BUCKETS=true``, ``CONVEYOR_WARMUP``);
- ``CUDA graphs``: bucketed, with the worker's CUDA-graph setting on (:data:`GRAPHS_FIELD`),
  measured only when asked (``--graphs``), on cuda, and where the worker has the setting.

Each is timed at a few batch sizes, and its answers on the largest batch are compared with
the CPU's float32 answers on the same texts (the worst cosine of any row).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from bench.workloads import items
from pipelines.model import Item, Model
from pipelines.settings import load_settings
from pipelines.stages import BUILTIN, Stage
from workers.build import build_model, prepare_shapes
from workers.models.buckets import Buckets
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
        answers: its embeddings of the largest batch's texts.
    """

    name: str
    rates: dict[int, float] = field(default_factory=dict)
    worst_cosine: float | None = None
    warm_s: float = 0.0
    shapes: int = 0
    dtype: str = ""
    skipped: str = ""
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
        out.append(_timed(name, stage, settings, corpus, batches, seconds))
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


def _timed(
    name: str,
    stage: Stage,
    settings: WorkerSettings,
    corpus: list[Item],
    batches: list[int],
    seconds: float,
) -> Variant:
    """One variant: built, prepared (timed), run at each batch size, its answers kept."""
    model = build_model(stage, settings)
    started = time.perf_counter()
    prepare_shapes(model, stage, settings)
    variant = Variant(name, warm_s=time.perf_counter() - started)
    buckets = getattr(model, "buckets", None)
    variant.shapes = len(buckets.shapes()) if isinstance(buckets, Buckets) else 0
    variant.dtype = str(getattr(model, "dtype", "-")).removeprefix("torch.")
    for size in batches:
        variant.rates[size] = _rate(model, corpus, size, seconds)
        logger.info("in-process %s batch %d: %.1f sentences/s", name, size, variant.rates[size])
    variant.answers = _answers(model, corpus[: max(batches)])
    del model
    _release()
    return variant


def _rate(model: Model, corpus: list[Item], size: int, seconds: float) -> float:
    """Sentences per second at batch ``size``, cycling :data:`CHUNKS` batches, each run
    once first."""
    chunks = [corpus[i : i + size] for i in range(0, CHUNKS * size, size)]
    for chunk in chunks:
        model.predict(chunk)
    done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        model.predict(chunks[(done // size) % CHUNKS])
        done += size
    return done / (time.perf_counter() - started)


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
