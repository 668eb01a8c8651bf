"""The benchmark's workloads, their request bodies and their models, and the in-process limit.

- ``echo``: no model (:class:`workers.models.toy.Echo`): what serving alone costs.
- ``embed``: the real all-MiniLM-L6-v2 (:class:`workers.models.hf.Embedder`, model ``minilm``)
  on sentences of 8 to 24 words: uniform text, where batching by count pads almost nothing.
- ``mixed``: the same model, served by the same stage (``embed``), on the texts of
  ``bench/mixed.jsonl`` (:mod:`bench.corpus`): 3 to 300 words, most short, a long tail.
- ``synthetic``: a GPU-like cost model that sleeps ``a + b·n`` per batch
  (:class:`bench.synthetic.Synthetic`).

Every system under test builds its model with :func:`load_model`, so all of them run the
same code on the same inputs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import orjson

from pipelines.builtin import builtin_pipelines
from pipelines.envelope import Request, new_request_id
from pipelines.graph import Pipeline
from pipelines.keys import Keys
from pipelines.model import Item, Model

WORKLOADS = ("echo", "embed", "mixed", "synthetic")

TOKENIZED = ("embed", "mixed")
"""Workloads whose model pads each batch to its longest text: where batching by length
can matter, and where padding efficiency is measured."""

STAGE = {"mixed": "embed"}
"""The served model of a workload that shares another's (``mixed`` is ``embed`` on other
text); any other workload is served under its own name."""

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixed.jsonl")


def stage_of(workload: str) -> str:
    """The stage (and path, ``/v1/STAGE``) that serves ``workload``."""
    return STAGE.get(workload, workload)


def stages_of(workloads: list[str]) -> list[str]:
    """The stages serving ``workloads``, each once, in order."""
    return list(dict.fromkeys(stage_of(w) for w in workloads))


_SENTENCE = (
    "the quick brown fox jumps over a lazy dog while queues hold requests and workers batch them "
    "for the model which embeds every sentence into a vector of floats"
)
_WORDS = _SENTENCE.split()


def texts(n: int) -> list[str]:
    """``n`` different sentences of 8 to 24 words (deterministic)."""
    return [
        " ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(8 + i % 17)) for i in range(n)
    ]


@cache
def _corpus() -> tuple[bytes, ...]:
    with open(CORPUS, "rb") as lines:
        return tuple(line.rstrip(b"\n") for line in lines if line.strip())


def items(n: int, workload: str = "embed") -> list[Item]:
    """``n`` request payloads, ``{"text": ...}``: ``mixed``'s corpus, cycled, for
    ``mixed``; the uniform sentences of :func:`texts` for every other workload."""
    if workload == "mixed":
        return [orjson.loads(body) for body in bodies(n, workload)]
    return [{"text": t} for t in texts(n)]


def stage_request(
    keys: Keys, stage: str, text: str, deadline: float, request_id: str | None = None
) -> Request:
    """A one-step request of ``{"text": text}`` for ``stage`` (its pipeline and step
    named after it), as a gateway would write it, replying to the bench's own stream:
    what a bench that drives a worker without a gateway puts in its stream."""
    payload = {"text": text}
    return Request(
        id=request_id or new_request_id(),
        pipeline=stage,
        stage=stage,
        step=stage,
        payload=payload,
        state={"input": payload},
        reply_to=keys.reply_stream("bench"),
        deadline=deadline,
        reply_batches=True,  # as this release's gateway writes it
    )


def bodies(n: int, workload: str = "embed") -> list[bytes]:
    """``n`` JSON request bodies of ``workload`` (the same for every system)."""
    if workload == "mixed":
        corpus = _corpus()
        return [corpus[i % len(corpus)] for i in range(n)]
    return [orjson.dumps(item) for item in items(n)]


@dataclass
class Tokens:
    """Real and padded tokens of the batches a model has encoded.

    Attributes:
        real: tokens of the texts themselves (the attention mask's ones).
        padded: tokens the model ran on: per batch, items x the longest.
    """

    real: int = 0
    padded: int = 0


def count_tokens(model: Model) -> Tokens | None:
    """Count the real and padded tokens of every batch ``model`` tokenizes from now on.

    The Hugging Face runners tokenize each batch in one ``encode`` call; this wraps that
    call on this instance and sums its attention mask, microseconds per batch, with no
    second tokenization. None for a model with no tokenizer (echo, synthetic).
    """
    encode: Callable[..., Any] | None = getattr(model, "encode", None)
    if encode is None:
        return None
    tokens = Tokens()

    def counted(texts: list[str], **kwargs: Any) -> Any:
        encoding = encode(texts, **kwargs)
        mask = encoding["attention_mask"]
        tokens.real += int(mask.sum())
        tokens.padded += int(mask.numel())
        return encoding

    setattr(model, "encode", counted)  # noqa: B010 (Model, the protocol, has no encode)
    return tokens


def load_model(workload: str, device: str = "auto") -> Model:
    """Build ``workload``'s model exactly as a conveyor worker would.

    Args:
        workload: one of :data:`WORKLOADS`.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (only ``embed`` uses it).

    Raises:
        ValueError: an unknown workload.
    """
    workload = stage_of(workload)
    if workload == "echo":
        from workers.models.toy import Echo

        return Echo()
    if workload == "embed":
        from workers.models.hf import Embedder

        cache = os.path.join(tempfile.gettempdir(), "conveyor-bench-cache")
        return Embedder(model="minilm", device=device, dtype="auto", cache_dir=cache)
    if workload == "synthetic":
        from bench.synthetic import Synthetic

        return Synthetic()
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def conveyor_pipelines() -> list[Pipeline]:
    """What the bench's conveyor gateway serves: built-in ``echo`` and ``embed`` plus
    ``synthetic`` (``CONVEYOR_APP=bench.workloads:conveyor_pipelines``)."""
    from bench.synthetic import pipelines as synthetic

    chosen = [p for p in builtin_pipelines() if p.name in ("echo", "embed")]
    return [*chosen, *synthetic]


@dataclass
class InProcess:
    """The model called directly, with no serving in between.

    Attributes:
        workload: which model.
        batch: the batch size of the throughput measurement.
        throughput: items per second at ``batch``.
        single_p50_ms: median time of one ``predict`` call on one item.
        single_p99_ms: 99th percentile of the same.
        padding: real / padded tokens of the throughput batches (None: no tokenizer).
    """

    workload: str
    batch: int
    throughput: float
    single_p50_ms: float
    single_p99_ms: float
    padding: float | None = None


def in_process(
    workload: str,
    *,
    batch: int,
    total: int,
    singles: int,
    seconds: float,
    device: str,
    threads: int | None = None,
) -> InProcess:
    """Time ``workload``'s model in this process: throughput at ``batch``, latency at 1.

    Args:
        workload: one of :data:`WORKLOADS`.
        batch: items per ``predict`` call for the throughput figure.
        total: at most this many items for the throughput figure.
        singles: at most this many single-item calls for the latency figure.
        seconds: each of the two measurements stops early after about this long.
        device: see :func:`load_model`.
        threads: torch intra-op threads during the measurement (None: as a worker on
            ``device`` would run, :func:`in_process_threads`).
    """
    import torch

    before = torch.get_num_threads()
    chosen = in_process_threads(device, threads)
    if chosen is not None:
        torch.set_num_threads(chosen)
    try:
        return _time_model(workload, batch, total, singles, seconds, device)
    finally:
        torch.set_num_threads(before)


def in_process_threads(device: str, threads: int | None = None) -> int | None:
    """The torch threads of an in-process measurement on ``device``: a worker's rule
    (:func:`workers.threads.torch_threads`: on cuda ``CONVEYOR_CUDA_THREADS``, on cpu
    torch's default), so the bench's in-process figure and its served one agree.

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        threads: held to this many instead (None: the rule decides).
    """
    from workers.settings import WorkerSettings
    from workers.threads import resolved_device, torch_threads

    settings = WorkerSettings()  # the bench's environment: CONVEYOR_THREADS and the like
    return torch_threads(
        resolved_device(device),
        setting=threads or settings.threads,
        cuda_threads=settings.cuda_threads,
    )


def _time_model(
    workload: str, batch: int, total: int, singles: int, seconds: float, device: str
) -> InProcess:
    model = load_model(workload, device)
    corpus = items(max(total, batch), workload)
    batches = [corpus[i : i + batch] for i in range(0, len(corpus) - batch + 1, batch)]
    for chunk in batches[:2]:  # warm-up: first calls allocate
        model.predict(chunk)
        model.predict(chunk[:1])
    tokens = count_tokens(model)
    done = 0
    started = time.perf_counter()
    while done < total and time.perf_counter() - started < seconds:
        model.predict(batches[(done // batch) % len(batches)])
        done += batch
    throughput = done / (time.perf_counter() - started)
    padding = tokens.real / tokens.padded if tokens and tokens.padded else None
    latencies: list[float] = []
    started = time.perf_counter()
    while len(latencies) < singles and time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        model.predict([corpus[len(latencies) % len(corpus)]])
        latencies.append(time.perf_counter() - t0)
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    p50 = 1000 * statistics.median(ordered)
    return InProcess(workload, batch, throughput, p50, 1000 * p99, padding)
