"""``python -m bench.gpu``'s served section: conveyor started fresh, driven from the moment
it is ready, its first seconds reported apart from its steady state.

Each :class:`Session` starts one conveyor (:mod:`bench.systems`: redis-server, the
gateway(s), one worker per stage), drives its first workload at the most clients straight
away, and splits that run in two windows: the first seconds after ready (where a cold
shape would show) and the steady state after them. Then it measures every workload at
every client count, each after a short unmeasured warm-up.

Every window reports what the clients saw (throughput, p50, p99, errors), the CPU seconds
per request of all the system's processes (Redis included, from /proc), and how busy the
stage's model was: its run time over the window's wall time (the gateway's
``conveyor_stage_run_seconds_sum``), and on cuda the GPU's own utilization
(``torch.cuda.utilization``, NVML: needs ``pynvml``, the bench extra's ``nvidia-ml-py``),
sampled through the window, where it answers.

With CUDA graphs asked (:data:`~bench.gpu_model.GRAPHS_ENV` in the workers' environment),
each row says what its stage's worker did with them, read from the worker's log once it
has stopped (:func:`graphs_said`): the batches its graphs replayed, or "not captured: <why>"
(a capture that failed leaves the worker eager, and its rates are eager ones).
"""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

from bench.gpu_model import GRAPHS_ENV
from bench.loadgen import closed_loop
from bench.systems import HOST, ConveyorServer, Options, conveyor, conveyor_items
from bench.workloads import bodies, stage_of, stages_of

logger = logging.getLogger(__name__)

UTILIZATION_EVERY_S = 0.25
"""How often the GPU's utilization is sampled during a window."""


@dataclass(frozen=True)
class Session:
    """One conveyor, started fresh for what it measures.

    Attributes:
        system: ``conveyor`` (batching by length where the stage says) or
            ``conveyor-items`` (``CONVEYOR_MAX_BATCH_TOKENS=0``: by item count only).
        workloads: what it serves and measures; the first is driven from ready.
        gateways: gateway processes on its port.
    """

    system: str
    workloads: tuple[str, ...]
    gateways: int = 1


@dataclass
class Window:
    """One stretch of a closed-loop run.

    Attributes:
        seconds: its wall time.
        ok: requests answered 200 within it.
        errors: other answers (and failed connections) within it.
        latencies: seconds, of the requests it saw answered.
        cpu_s: CPU seconds of the system's processes over it.
        model_s: seconds the stage's model ran over it.
        gpu_util: the GPU's mean utilization over it, 0..1 (None: not read).
    """

    seconds: float
    ok: int
    errors: int
    latencies: list[float] = field(repr=False)
    cpu_s: float
    model_s: float
    gpu_util: float | None = None

    @property
    def throughput(self) -> float:
        """Requests answered 200 per second."""
        return self.ok / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms(self) -> float:
        """CPU milliseconds per request answered 200."""
        return 1000 * self.cpu_s / max(1, self.ok)

    @property
    def busy(self) -> float:
        """The model's run time over the window's wall time."""
        return self.model_s / self.seconds if self.seconds > 0 else 0.0

    def pct(self, q: float) -> float:
        """Latency quantile ``q`` (0..1) in milliseconds (NaN: nothing answered)."""
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Served:
    """One measurement of one workload at one client count.

    Attributes:
        system: which conveyor (:attr:`Session.system`).
        gateways: its gateway processes.
        workload: what was sent.
        clients: closed-loop clients.
        steady: the measured window.
        first: the first window after ready (only the run that started at ready).
        graphs: with CUDA graphs asked, what the stage's worker did with them
            (:func:`graphs_said`); "" where they were not asked.
    """

    system: str
    gateways: int
    workload: str
    clients: int
    steady: Window
    first: Window | None = None
    graphs: str = ""


@dataclass(frozen=True)
class Timing:
    """How long the served measurements run.

    Attributes:
        clients: closed-loop client counts (the most is driven from ready).
        first_s: the window right after ready.
        steady_s: the steady window that follows it.
        warm_s: unmeasured load before every other measurement.
        window_s: every other measurement.
    """

    clients: list[int]
    first_s: float
    steady_s: float
    warm_s: float
    window_s: float


class Probe(NamedTuple):
    """Counters read at one instant."""

    at: float
    cpu_s: float
    model_s: float


def serve(sessions: list[Session], timing: Timing, options: Options, workdir: Path) -> list[Served]:
    """Start each session's conveyor in turn, measure it, stop it.

    Args:
        sessions: what to start, in order.
        timing: client counts and windows.
        options: device, max batch and extra environment of every process.
        workdir: where Redis and the process logs live.
    """
    rows: list[Served] = []
    top = max(timing.clients)
    for session in sessions:
        logger.info("starting %s, %d gateway(s)", session.system, session.gateways)
        first_row = len(rows)
        with _started(session, options, workdir) as server:

            def measured(workload: str, clients: int, spans: list[float]) -> list[Window]:
                return asyncio.run(_windows(server, workload, clients, spans, options.device))

            head = session.workloads[0]
            first, steady = measured(head, top, [timing.first_s, timing.steady_s])
            rows.append(Served(session.system, session.gateways, head, top, steady, first))
            for workload in session.workloads:
                for clients in timing.clients:
                    if (workload, clients) != (head, top):  # that one ran from ready
                        _, window = measured(workload, clients, [timing.warm_s, timing.window_s])
                        rows.append(
                            Served(session.system, session.gateways, workload, clients, window)
                        )
        if options.env.get(GRAPHS_ENV) == "true":  # stopped: its workers' last lines are in
            said = server.log.read_text(errors="replace")
            for row in rows[first_row:]:
                row.graphs = graphs_said(said, stage_of(row.workload))
    return rows


def graphs_said(log: str, stage: str) -> str:
    """What a served worker of ``stage`` said in its ``log`` of its CUDA graphs: "replayed
    N batches" where its graphs ran (N > 0), else "not captured: <why>".

    Args:
        log: the worker's log, read after it stopped (it counts replays as it closes).
        stage: the stage.
    """
    head = rf"stage {re.escape(stage)}: "
    replays = re.findall(head + r"(\d+) batches replayed CUDA graphs", log)
    if replays and int(replays[-1]) > 0:
        return f"replayed {int(replays[-1]):,} batches"
    why = re.findall(head + r"no CUDA graphs[,:]? ?(.*)", log)
    if why:
        return f"not captured: {why[-1].strip()}"
    if replays:
        return "not captured: no batch replayed a graph"
    return "not captured: its worker logged nothing of graphs"


@contextmanager
def _started(session: Session, options: Options, workdir: Path) -> Iterator[ConveyorServer]:
    workloads = list(session.workloads)
    if session.system == "conveyor-items":
        with conveyor_items(workloads, options, workdir) as server:
            yield server
        return
    name = f"conveyor-{session.gateways}gw"
    with conveyor(workloads, options, workdir, log_name=name, gateways=session.gateways) as server:
        yield server


async def _windows(
    server: ConveyorServer, workload: str, clients: int, spans: list[float], device: str
) -> list[Window]:
    """One closed-loop run of ``workload`` lasting ``sum(spans)``, cut into a window per
    span; requests answered after the last span (the wind-down) count in none."""
    stage = stages_of([workload])[0]
    answered: list[tuple[float, int]] = []  # (when, status), in the order of load.latencies
    samples: list[tuple[float, float]] = []
    probes = [_probe(server, stage)]
    ends = [probes[0].at + sum(spans[: i + 1]) for i in range(len(spans))]

    async def probe_at(when: float) -> None:
        await asyncio.sleep(max(0.0, when - time.perf_counter()))
        probes.append(await asyncio.to_thread(_probe, server, stage))

    async def sample() -> None:
        read = utilization_reader(device)
        while read is not None and time.perf_counter() < ends[-1]:
            samples.append((time.perf_counter(), read()))
            await asyncio.sleep(UTILIZATION_EVERY_S)

    watchers = [asyncio.create_task(probe_at(end)) for end in ends]
    watchers.append(asyncio.create_task(sample()))
    load = await closed_loop(
        HOST,
        server.port,
        server.path(workload),
        _bodies(workload),
        clients,
        on_response=lambda status, _: answered.append((time.perf_counter(), status)),
        duration=sum(spans),
    )
    await asyncio.gather(*watchers)
    windows = []
    for start, end in pairwise(sorted(probes)):
        seen = [
            (status, latency)
            for (when, status), latency in zip(answered, load.latencies, strict=True)
            if start.at <= when < end.at
        ]
        util = [u for t, u in samples if start.at <= t < end.at]
        windows.append(
            Window(
                seconds=end.at - start.at,
                ok=sum(1 for status, _ in seen if status == 200),
                errors=sum(1 for status, _ in seen if status != 200),
                latencies=[latency for _, latency in seen],
                cpu_s=end.cpu_s - start.cpu_s,
                model_s=end.model_s - start.model_s,
                gpu_util=statistics.mean(util) if util else None,
            )
        )
    for w in windows:
        logger.info(
            "%s %s c=%d: %.1f s, %.1f req/s, p50 %.1f ms, p99 %.1f ms, errors %d, "
            "cpu %.2f ms/req, model busy %.0f%%",
            server.name,
            workload,
            clients,
            w.seconds,
            w.throughput,
            w.pct(0.5),
            w.pct(0.99),
            w.errors,
            w.cpu_ms,
            100 * w.busy,
        )
    return windows


def _probe(server: ConveyorServer, stage: str) -> Probe:
    at = time.perf_counter()
    cpu = server.cpu_seconds()  # first: /proc answers at once, HTTP may wait
    return Probe(at, cpu, server.run_seconds(stage))


BODIES = 3000
"""Distinct request bodies per workload (``mixed``: its whole corpus), cycled."""


def _bodies(workload: str) -> list[bytes]:
    """Enough bodies for any run here: :data:`BODIES` of them, repeated."""
    return bodies(BODIES, workload) * 200


@cache
def utilization_reader(device: str) -> Callable[[], float] | None:
    """A function reading the GPU's utilization now (0..1), or None where there is none
    to read: not cuda, or NVML does not answer (``torch.cuda.utilization`` needs pynvml);
    the reason is logged once."""
    if not device.startswith("cuda"):
        return None
    import torch

    where = torch.device(device)
    try:
        torch.cuda.utilization(where)
    except Exception as exc:  # pynvml missing, or NVML refusing: either way, none to read
        logger.info("GPU utilization not read: %s", exc)
        return None
    return lambda: torch.cuda.utilization(where) / 100
