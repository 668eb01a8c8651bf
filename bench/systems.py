"""Start and stop the systems under test, each as real processes on 127.0.0.1.

- ``conveyor``: redis-server, the gateway (``python -m gateway``) and one worker per
  stage (``python -m workers STAGE``), as ``conveyor up`` runs them; its stages batch as
  they are defined (the built-in ``embed`` by tokens, where it sets ``max_batch_tokens``).
- ``conveyor-items``: the same, every worker started with ``CONVEYOR_MAX_BATCH_TOKENS=0``:
  batches bounded by item count only.
- ``celery``: redis-server (broker and result backend), a Celery worker and the FastAPI
  app of :mod:`bench.celery_app` under uvicorn.
- ``hf-batching``: the single FastAPI process of :mod:`bench.hf_batching` under uvicorn.
- ``litserve``: ``python -m bench.litserve_app``, which starts LitServe's own processes.

A workload is served by its stage (:func:`bench.workloads.stage_of`): ``mixed`` goes to
``/v1/embed``, with other text.

Each is a context manager that yields a :class:`Server` once every workload answers, and
stops every process it started on the way out, whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from bench.workloads import stage_of, stages_of
from conveyor.embedded import free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
READY_TIMEOUT_S = 180.0


@dataclass
class Options:
    """How the systems are configured (the same for every workload).

    Attributes:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` for every model.
        max_batch: the batch bound of conveyor's stages and of the asyncio batcher.
        batch_wait_ms: the batch window of the asyncio batcher (conveyor's stages keep
            their own, 5 ms for all three workloads).
        celery_pool: the Celery worker's ``--pool``.
        celery_concurrency: the Celery worker's ``--concurrency``.
        litserve_batch_timeout_ms: LitServe's ``batch_timeout`` (its batch bound is
            ``max_batch``).
        env: extra environment for every process (e.g. the synthetic cost).
    """

    device: str = "auto"
    max_batch: int = 32
    batch_wait_ms: float = 5.0
    celery_pool: str = "solo"
    celery_concurrency: int = 1
    litserve_batch_timeout_ms: float = 10.0
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Server:
    """A running system: where to send requests and what its processes cost.

    Attributes:
        name: the system's name.
        port: the HTTP port on 127.0.0.1.
        procs: every process it started, by role.
    """

    name: str
    port: int
    procs: dict[str, subprocess.Popen[bytes]]

    def path(self, workload: str) -> str:
        """The request path of ``workload`` (its stage's)."""
        return f"/v1/{stage_of(workload)}"

    def cpu_seconds(self) -> float:
        """CPU seconds its processes have used so far (Linux /proc)."""
        return cpu_seconds([p.pid for p in self.procs.values() if p.poll() is None])

    def batch_totals(self, workload: str) -> tuple[float, float] | None:
        """(items, batches) run so far for ``workload``; None where every batch is one."""
        del workload
        return None

    def token_totals(self, workload: str) -> tuple[float, float] | None:
        """(real, padded) tokens of the batches run so far for ``workload``; None where
        the system does not count them."""
        del workload
        return None


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Prometheus samples by (metric name, labels)."""


def parse_metrics(text: str) -> Series:
    """The samples of a Prometheus text exposition (comments skipped)."""
    out: Series = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        pairs = (pair.split("=", 1) for pair in labels.rstrip("}").split(",") if "=" in pair)
        out[name, frozenset((k.strip(), v.strip().strip('"')) for k, v in pairs)] = float(value)
    return out


def total(samples: Series, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples that carry ``labels`` (None: there are none)."""
    wanted = set(labels.items())
    found = [v for (n, have), v in samples.items() if n == name and wanted <= have]
    return sum(found) if found else None


class ConveyorServer(Server):
    """conveyor, with its batch and token counters read from the gateway's ``/metrics``."""

    def __init__(
        self,
        name: str,
        port: int,
        procs: dict[str, subprocess.Popen[bytes]],
        env: dict[str, str],
        log: Path,
    ) -> None:
        super().__init__(name, port, procs)
        self._env = env
        self._log = log

    @property
    def log(self) -> Path:
        """The file its processes log to."""
        return self._log

    @property
    def redis_url(self) -> str:
        """The URL of its Redis (``redis+cluster://`` where it uses a cluster)."""
        return self._env["CONVEYOR_REDIS_URL"]

    def _metrics(self) -> Series:
        return parse_metrics(httpx.get(f"http://{HOST}:{self.port}/metrics", timeout=10).text)

    def batch_totals(self, workload: str) -> tuple[float, float] | None:
        """(items, batches) the stage has run, from ``conveyor_stage_batch_size_*``."""
        m, stage = self._metrics(), stage_of(workload)
        return (
            total(m, "conveyor_stage_batch_size_sum", stage=stage) or 0.0,
            total(m, "conveyor_stage_batch_size_count", stage=stage) or 0.0,
        )

    def token_totals(self, workload: str) -> tuple[float, float] | None:
        """(real, padded) tokens the stage has run, from ``conveyor_stage_tokens_total``
        (None while the gateway does not expose them)."""
        m, stage = self._metrics(), stage_of(workload)
        real = total(m, "conveyor_stage_tokens_total", stage=stage, kind="real")
        padded = total(m, "conveyor_stage_tokens_total", stage=stage, kind="padded")
        return None if real is None or padded is None else (real, padded)

    def run_seconds(self, workload: str) -> float:
        """Seconds the stage's model has run so far, summed over its workers (the sum of
        ``conveyor_stage_run_seconds``): over a wall-clock span, how busy its device was."""
        return (
            total(self._metrics(), "conveyor_stage_run_seconds_sum", stage=stage_of(workload))
            or 0.0
        )

    def workers(self, stage: str) -> int:
        """Worker processes this server runs for ``stage``."""
        return sum(1 for role in self.procs if role.startswith(f"worker {stage} "))

    def scale(self, stage: str, count: int) -> None:
        """Start workers until ``count`` serve ``stage``; return once all have joined."""
        while self.workers(stage) < count:
            role = f"worker {stage} {self.workers(stage) + 1}"
            self.procs[role] = _spawn(
                [sys.executable, "-m", "workers", stage], self._env, self._log
            )
        give_up = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if (total(self._metrics(), "conveyor_stage_consumers", stage=stage) or 0) >= count:
                    return
            except httpx.TransportError:
                pass  # the gateway is still starting
            if time.monotonic() > give_up:
                raise RuntimeError(f"{count} {stage} workers did not join; see {self._log}")
            _check_alive(self.procs, self._log)
            time.sleep(0.2)  # other processes are starting


class StatsServer(Server):
    """A system that counts its own batches and tokens at ``GET /stats`` (the asyncio
    batcher, LitServe): ``{stage: {"items", "batches", "real_tokens", "padded_tokens"}}``."""

    def _stats(self, workload: str) -> dict[str, int]:
        stats: dict[str, dict[str, int]] = httpx.get(
            f"http://{HOST}:{self.port}/stats", timeout=10
        ).json()
        return stats[stage_of(workload)]

    def batch_totals(self, workload: str) -> tuple[float, float] | None:
        """(items, batches) its loop for ``workload`` has run."""
        stats = self._stats(workload)
        return float(stats["items"]), float(stats["batches"])

    def token_totals(self, workload: str) -> tuple[float, float] | None:
        """(real, padded) tokens of those batches (None: the model has no tokenizer)."""
        stats = self._stats(workload)
        if not stats.get("padded_tokens"):
            return None
        return float(stats["real_tokens"]), float(stats["padded_tokens"])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` and all their live descendants
    (Celery's prefork children, say), from Linux's /proc; gone processes count 0."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    tree = set(pids)
    grew = True
    while grew:  # add children of the tree until nothing new joins
        joined = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= joined
        grew = bool(joined)
    return sum(cpu.get(pid, 0.0) for pid in tree)


def _spawn(
    args: list[str], env: Mapping[str, str], log: Path, *, session: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``args`` in the repository root, output appended to ``log``; with
    ``session``, as the leader of a new process group (see :func:`_stop_group`)."""
    with log.open("ab") as out:  # the child keeps its own handle
        return subprocess.Popen(
            args, env=dict(env), cwd=ROOT, stdout=out, stderr=out, start_new_session=session
        )


def _stop(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process, then SIGKILL whatever has not exited in 15 s."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    give_up = time.monotonic() + 15
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, give_up - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stop_group(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """:func:`_stop`, then SIGKILL whatever is left in each process's group: processes
    it started itself and did not stop (it was started with ``session=True``)."""
    _stop(procs)
    for proc in procs.values():
        with suppress(ProcessLookupError):  # the group is empty: everything exited
            os.killpg(proc.pid, signal.SIGKILL)


def _stop_all_but_redis(procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """Stop the clients of Redis before Redis (its own context stops it)."""
    _stop({role: proc for role, proc in procs.items() if role != "redis"})


def _check_alive(procs: Mapping[str, subprocess.Popen[bytes]], log: Path) -> None:
    for role, proc in procs.items():
        if proc.poll() is not None:
            raise RuntimeError(f"{role} exited with {proc.returncode}; see {log}")


def _wait_answers(server: Server, workloads: list[str], log: Path) -> None:
    """Post one request per workload until each gets a 200 (models load meanwhile)."""
    give_up = time.monotonic() + READY_TIMEOUT_S
    for workload in workloads:
        url = f"http://{HOST}:{server.port}{server.path(workload)}"
        while True:
            _check_alive(server.procs, log)
            try:
                reply = httpx.post(url, json={"text": "warm up"}, timeout=60)
                if reply.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > give_up:
                raise RuntimeError(f"{server.name} did not answer {url} in time; see {log}")
            time.sleep(0.2)  # another process is starting


def _base_env(options: Options) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(options.env)
    return env


@contextmanager
def _redis(workdir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = start_redis(port, workdir)
    try:
        yield f"redis://{HOST}:{port}/0", proc
    finally:
        _stop({"redis": proc})


@contextmanager
def conveyor(
    workloads: list[str],
    options: Options,
    workdir: Path,
    *,
    log_name: str = "conveyor",
    name: str = "conveyor",
    app: str = "bench.workloads:conveyor_pipelines",
    workers: list[str] | None = None,
    redis_url: str | None = None,
    gateways: int = 1,
) -> Iterator[ConveyorServer]:
    """redis-server, the gateway(s) and one worker per stage, as separate processes.

    Args:
        workloads: the workloads to serve; their stages get one worker each to begin with.
        options: how to configure them.
        workdir: where Redis and the process log (``{log_name}.log``) live.
        log_name: names the log file, so two runs in one workdir keep theirs apart.
        name: the system's name in the results.
        app: ``CONVEYOR_APP``, whose pipelines the workloads name.
        workers: the stages that get one worker each (default: the workloads' stages; a
            pipeline of several steps names the stages of its steps here).
        redis_url: a Redis (or ``redis+cluster://`` cluster) the caller runs, used
            instead of starting a redis-server (extra settings, such as
            ``CONVEYOR_PARTITIONS``, go in ``options.env``).
        gateways: gateway processes on the one port (``CONVEYOR_GATEWAYS``: above 1,
            each binds it with ``SO_REUSEPORT`` and the kernel spreads connections).
    """
    stages = stages_of(workloads)
    log = workdir / f"{log_name}.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as stack:
        url = redis_url
        if url is None:
            url, procs["redis"] = stack.enter_context(_redis(workdir / f"redis-{log_name}"))
        stack.callback(_stop_all_but_redis, procs)
        port = free_port()
        env = _base_env(options)
        env.update(
            CONVEYOR_REDIS_URL=url,
            CONVEYOR_HOST=HOST,
            CONVEYOR_PORT=str(port),
            CONVEYOR_APP=app,
            CONVEYOR_PIPELINES=",".join(stages),
            CONVEYOR_DEVICE=options.device,
            CONVEYOR_MAX_BATCH_SIZE=str(options.max_batch),
            CONVEYOR_GATEWAYS=str(gateways),
        )
        for i in range(gateways):
            role = "gateway" if i == 0 else f"gateway {i + 1}"
            procs[role] = _spawn([sys.executable, "-m", "gateway"], env, log)
        server = ConveyorServer(name, port, procs, env, log)
        for stage in stages if workers is None else workers:
            server.scale(stage, 1)
        _wait_answers(server, stages, log)
        yield server


@contextmanager
def conveyor_items(
    workloads: list[str], options: Options, workdir: Path
) -> Iterator[ConveyorServer]:
    """:func:`conveyor` with batches bounded by item count only: every worker started
    with ``CONVEYOR_MAX_BATCH_TOKENS=0``, whatever the stage sets."""
    options = replace(options, env={**options.env, "CONVEYOR_MAX_BATCH_TOKENS": "0"})
    with conveyor(
        workloads, options, workdir, log_name="conveyor-items", name="conveyor-items"
    ) as server:
        yield server


@contextmanager
def celery(workloads: list[str], options: Options, workdir: Path) -> Iterator[Server]:
    """redis-server, a Celery worker and the FastAPI app that sends it one task a request."""
    log = workdir / "celery.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as stack:
        url, redis = stack.enter_context(_redis(workdir / "redis-celery"))
        stack.callback(_stop_all_but_redis, procs)
        port = free_port()
        env = _base_env(options)
        env.update(BENCH_REDIS_URL=url, BENCH_DEVICE=options.device)
        procs["redis"] = redis
        worker = [
            *(sys.executable, "-m", "celery", "-A", "bench.celery_app:celery", "worker"),
            f"--pool={options.celery_pool}",
            f"--concurrency={options.celery_concurrency}",
            *("--queues=bench", "--loglevel=WARNING", "--without-gossip", "--without-mingle"),
        ]
        procs["celery worker"] = _spawn(worker, env, log)
        procs["api"] = _spawn(_uvicorn("bench.celery_app:api", port), env, log)
        server = Server("celery", port, procs)
        _wait_answers(server, stages_of(workloads), log)
        yield server


@contextmanager
def hf_batching(workloads: list[str], options: Options, workdir: Path) -> Iterator[Server]:
    """One uvicorn process: FastAPI, an asyncio queue and a batching loop per model."""
    env = {"BENCH_BATCH_WAIT_MS": str(options.batch_wait_ms)}
    with _launched("hf-batching", workloads, options, workdir, env) as server:
        yield server


@contextmanager
def litserve(workloads: list[str], options: Options, workdir: Path) -> Iterator[Server]:
    """LitServe (:mod:`bench.litserve_app`): its launcher, queue manager, one inference
    worker per stage and one API server, all descendants of the launcher (their CPU is
    counted with it)."""
    env = {"BENCH_BATCH_TIMEOUT_MS": str(options.litserve_batch_timeout_ms)}
    with _launched("litserve", workloads, options, workdir, env) as server:
        yield server


LAUNCH: dict[str, Callable[[int], list[str]]] = {
    "hf-batching": lambda port: _uvicorn("bench.hf_batching:app", port),
    "litserve": lambda port: [sys.executable, "-m", "bench.litserve_app"],
}
"""The command of each system that is one process of ours, given its port."""


@contextmanager
def _launched(
    name: str, workloads: list[str], options: Options, workdir: Path, env: Mapping[str, str]
) -> Iterator[Server]:
    """A system started as one process (:data:`LAUNCH`) that counts its own batches at
    ``/stats``. It leads its own process group, so whatever processes it starts in turn
    do not outlive the run even if its shutdown hangs."""
    log = workdir / f"{name}.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as stack:
        stack.callback(_stop_group, procs)
        port = free_port()
        full = _base_env(options)
        full.update(
            BENCH_WORKLOADS=",".join(stages_of(workloads)),
            BENCH_PORT=str(port),
            BENCH_DEVICE=options.device,
            BENCH_MAX_BATCH=str(options.max_batch),
            **env,
        )
        procs[name] = _spawn(LAUNCH[name](port), full, log, session=True)
        server = StatsServer(name, port, procs)
        _wait_answers(server, stages_of(workloads), log)
        yield server


def _uvicorn(app: str, port: int) -> list[str]:
    return [
        *(sys.executable, "-m", "uvicorn", app, "--host", HOST, "--port", str(port)),
        *("--no-access-log", "--log-level", "warning"),
    ]


STARTERS = {
    "conveyor": conveyor,
    "conveyor-items": conveyor_items,
    "celery": celery,
    "hf-batching": hf_batching,
    "litserve": litserve,
}
"""The served systems, by name, in the order a run starts them."""
