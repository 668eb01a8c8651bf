"""Test harness: real workers and gateways on a test's own namespace, and small models."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from gateway.app import create_app
from gateway.serve import http_protocol
from gateway.settings import GatewaySettings
from pipelines.envelope import Request, new_request_id, reply_values
from pipelines.graph import single
from pipelines.keys import GROUP, Keys, Lane
from pipelines.model import Item, Model, Result
from pipelines.registry import Registry
from pipelines.settings import CommonSettings
from pipelines.stages import Stage
from runtime.redisio import enqueue
from runtime.stats import read_stats
from runtime.waiting import cancel_and_wait
from workers.claims import mark_now
from workers.loop import Worker
from workers.partitions import partition_workers
from workers.settings import WorkerSettings
from workers.values import Entry


async def until(check: Callable[[], Awaitable[bool]], limit_s: float = 60) -> None:
    """Wait for ``check`` to hold, looking every 20 ms, for at most ``limit_s`` seconds."""
    give_up = time.monotonic() + limit_s
    while not await check():
        if time.monotonic() > give_up:
            pytest.fail(f"condition not met within {limit_s} s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def commands_seen(redis: aioredis.Redis) -> AsyncIterator[list[list[str]]]:
    """Every command Redis runs inside the block (``MONITOR``, watching before the block
    starts), each as its words, in the list given."""
    seen: list[list[str]] = []
    watching = asyncio.Event()

    async def watch() -> None:
        async with redis.monitor() as monitor:
            watching.set()
            while True:
                said = await monitor.next_command()
                seen.append([word.strip("'\"") for word in str(said["command"]).split()])

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(watching.wait(), timeout=10)
        yield seen
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def replies_in(redis: aioredis.Redis, stream: str) -> int:
    """How many replies reply stream ``stream`` holds: an entry holds each reply a batch
    wrote there (``workers/publish.lua``), so its length counts batches, not replies."""
    return sum(len(reply_values(f or {})) for _, f in await redis.xrange(stream) or [])


def wait_ready(
    base: str,
    procs: Mapping[str, subprocess.Popen[bytes]],
    log_of: Callable[[str], str],
    limit_s: float = 90,
) -> None:
    """Block until the gateway at ``base`` answers /readyz; fail at once, with the
    process's log, if one of ``procs`` exits first."""
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited:\n{log_of(name)}"
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # other processes are starting; nothing to await here
    logs = "\n".join(f"--- {name}:\n{log_of(name)}" for name in procs)
    pytest.fail(f"gateway not ready within {limit_s:g} s\n{logs}")


_DATA_ROOT: list[Path] = []  # this test run's data folders' parent, made on first use


def _fresh_data_dir() -> str:
    """A data folder of its own for one ``conveyor up`` (removed when the tests end): one
    left in the checkout (``.conveyor/``, the default) would carry one test's queued
    work into the next ``up`` started there."""
    if not _DATA_ROOT:
        _DATA_ROOT.append(Path(tempfile.mkdtemp(prefix="conveyor-test-data-")))
        atexit.register(shutil.rmtree, _DATA_ROOT[0], True)
    return tempfile.mkdtemp(dir=_DATA_ROOT[0])


def up_env(**extra: str) -> dict[str, str]:
    """``conveyor up``'s environment for a test: this one without its ``CONVEYOR_*``
    settings, this checkout's code, offline, a data folder of its own, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    own = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    if "CONVEYOR_DATA_DIR" not in extra and "CONVEYOR_REDIS_URL" not in extra:
        own["CONVEYOR_DATA_DIR"] = _fresh_data_dir()
    return env | own | extra


def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], limit_s: float = 120) -> str:
    """Wait until ``proc``'s output, written to ``log``, holds ``text``; returns it all.
    Fails if the process exits first or ``limit_s`` passes."""
    give_up = time.monotonic() + limit_s
    while text not in (out := log.read_text()):
        assert proc.poll() is None, out
        assert time.monotonic() < give_up, out
        time.sleep(0.1)  # another process writes its log as it starts; nothing to await
    return out


def worker_process(log: Path, env: dict[str, str], stages: str) -> subprocess.Popen[bytes]:
    """``python -m workers <stages>`` started by hand in this checkout with ``env``, its
    output written to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "workers", stages],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


class NumberIn(BaseModel):
    """Input of the test stages."""

    model_config = ConfigDict(extra="forbid")
    value: int
    fail: bool = False


class Doubler:
    """Doubles ``value``; fails an item with ``fail``; records every batch it ran."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.batches: list[list[int]] = []
        self.lock = threading.Lock()
        self.started = threading.Event()

    def predict(self, items: list[Item]) -> list[Result]:
        """Double each value (after ``delay_s``, standing in for model time)."""
        with self.lock:
            self.batches.append([i["value"] for i in items])
        self.started.set()
        if self.delay_s:
            time.sleep(self.delay_s)  # the model's own cost, in its thread
        if any(i["fail"] for i in items):
            raise ValueError("poisoned item")
        return [{"value": i["value"] * 2} for i in items]


class WrongCount:
    """Breaks the batch contract: always one result short."""

    def predict(self, items: list[Item]) -> list[Result]:
        """Return one result fewer than items."""
        return [{"value": 0}] * (len(items) - 1)


def number_stage(name: str = "double", **options: Any) -> Stage:
    """A test stage on :class:`NumberIn` (its model is passed to the worker directly)."""
    return Stage(name, NumberIn, runner="tests.helpers:Doubler", **options)


IN_PROCESS_GRACE_S = 3600.0
"""The hung grace of a worker in the test's process: one that found a model call hung
would end the whole test run (``os._exit``); a test's model waits far less."""


class Harness:
    """Starts workers and gateways for one test and stops them after it.

    Args:
        redis: a client on the test's Redis.
    """

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.settings = CommonSettings()
        self.keys = self.settings.keys
        self._tasks: list[asyncio.Task[int]] = []
        self._workers: list[Worker] = []
        self._stack = contextlib.AsyncExitStack()
        self._servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    def worker(
        self,
        stage: Stage,
        model: Model | None = None,
        registry: Registry | None = None,
        partition: int = 0,
        **overrides: Any,
    ) -> Worker:
        """A worker for ``stage`` (not yet running), reading ``partition``."""
        # Short blocking reads so a stopped worker notices at once.
        settings = WorkerSettings(
            **{"block_ms": 100, "hung_grace_s": IN_PROCESS_GRACE_S, **overrides}
        )
        w = Worker(stage, settings, model, registry, partition=partition)
        self._workers.append(w)
        return w

    def run(self, worker: Worker, **kwargs: Any) -> asyncio.Task[int]:
        """Run ``worker`` in the background until it stops or the test ends."""
        task = asyncio.create_task(worker.run(**kwargs))
        self._tasks.append(task)
        return task

    async def start_workers(self, registry: Registry) -> None:
        """A running worker for every stage of ``registry`` (real runners), models loaded;
        one per partition (``CONVEYOR_PARTITIONS``), as ``python -m workers`` starts."""
        settings = WorkerSettings(
            block_ms=100, device="cpu", threads=1, hung_grace_s=IN_PROCESS_GRACE_S
        )
        workers = [
            w
            for stage in registry.stages.values()
            for w in partition_workers(stage, settings, registry)
        ]
        self._workers += workers
        for w in workers:
            await w.start()
        for w in workers:
            self.run(w)

    async def serve(self, registry: Registry, **gateway: Any) -> httpx.AsyncClient:
        """Workers for every stage of ``registry`` (real runners) and a gateway routing it."""
        await self.start_workers(registry)
        return await self.gateway(registry, **gateway)

    async def gateway(self, routed: list[Stage] | Registry, **overrides: Any) -> httpx.AsyncClient:
        """An HTTP client on a started gateway app routing ``routed`` (stages, each as its
        one-step pipeline, or a registry)."""
        settings = GatewaySettings(**{"reply_block_ms": 100, **overrides})
        registry = routed if isinstance(routed, Registry) else Registry(map(single, routed))
        app: FastAPI = create_app(settings, registry)
        await self._stack.enter_async_context(app.router.lifespan_context(app))
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        )
        await self._stack.enter_async_context(client)
        return client

    async def http_server(self, routed: list[Stage] | Registry, **overrides: Any) -> str:
        """A gateway served by uvicorn on a loopback port (real sockets, real streaming);
        returns its base URL. Stopped with the harness."""
        settings = GatewaySettings(**{"reply_block_ms": 100, **overrides})
        registry = routed if isinstance(routed, Registry) else Registry(map(single, routed))
        # A socket listening before uvicorn starts: connections queue in its backlog until
        # the app is up, so nothing has to wait for "started".
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        app = create_app(settings, registry)
        config = uvicorn.Config(
            app,
            log_level="warning",
            http=http_protocol(app, settings),  # as python -m gateway serves it
            # As python -m gateway runs it: a connection still open at the end of a test
            # (a keep-alive the client left) is cut then, instead of holding the teardown.
            timeout_graceful_shutdown=10,
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        self._servers.append((server, task))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def request(
        self, pipeline: str, stage: str, step: str, payload: dict[str, Any], **fields: Any
    ) -> Request:
        """A request for ``step`` of ``pipeline`` (on ``stage``), as a gateway writes it
        (deadline a minute away, replies to the test's stream, several an entry, unless
        ``fields`` say)."""
        fields.setdefault("deadline", time.time() + 60.0)
        fields.setdefault("reply_batches", True)
        fields.setdefault("reply_to", self.keys.reply_stream("test"))
        return Request(
            id=new_request_id(),
            pipeline=pipeline,
            stage=stage,
            step=step,
            payload=payload,
            state={"input": payload},
            **fields,
        )

    async def enqueue(
        self,
        stage: str,
        payloads: list[dict[str, Any]],
        *,
        deadline_in: float = 60.0,
        reply_to: str | None = None,
        lane: Lane = "interactive",
        **fields: Any,
    ) -> list[Request]:
        """XADD requests straight to a stage stream (of ``lane``), as a gateway would
        (``fields``: more of the request's, as :meth:`request` takes them)."""
        deadline = time.time() + deadline_in
        reply_to = reply_to or self.keys.reply_stream("test")
        requests = [
            self.request(
                stage, stage, stage, p, deadline=deadline, reply_to=reply_to, lane=lane, **fields
            )
            for p in payloads
        ]
        pipe = self.redis.pipeline(transaction=False)
        for r in requests:
            enqueue(pipe, self.keys, r)
        await pipe.execute()
        return requests

    async def stats(self, stage: str) -> dict[str, int]:
        """The stage's integer counters from its Redis stats hashes (every partition's)."""
        raw = await read_stats(self.redis, self.keys, stage)
        return {k: int(v) for k, v in raw.items() if ":sum" not in k}

    async def close_gateways(self) -> None:
        """Stop every gateway app started so far (their lifespans end)."""
        await self._stack.aclose()
        self._stack = contextlib.AsyncExitStack()

    async def close(self) -> None:
        """Stop every worker and gateway started through the harness."""
        for w in self._workers:
            w.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)
        await cancel_and_wait(self._tasks)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server, serving in self._servers:
            server.should_exit = True
            await serving
        await self._stack.aclose()
        for w in self._workers:
            await w.close()


REPO = Path(__file__).resolve().parents[1]


def conveyor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The ``conveyor`` console script, run from this worktree's code."""
    full = dict(os.environ) | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"} | env
    code = "import sys; from conveyor.cli import main; main(sys.argv[1:])"
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, cwd=REPO, env=full, capture_output=True, text=True, timeout=60)


class GatewayProcess:
    """A real ``python -m gateway`` on a free loopback port, from this worktree's code, with
    only the ``CONVEYOR_*`` settings given (none inherited); ready once entered.

    Args:
        redis_url: the Redis it uses; its namespace is its own.
        log: where its output goes.
        python_flags: interpreter flags (``-X importtime``).
        settings: more ``CONVEYOR_*`` variables.
    """

    def __init__(self, redis_url: str, log: Path, *python_flags: str, **settings: str) -> None:
        from conveyor.embedded import free_port

        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        self.env |= {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        self.env |= {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": f"gw{port}"}
        self.env |= {"CONVEYOR_PORT": str(port), **settings}
        self.argv = [sys.executable, *python_flags, "-m", "gateway"]
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    def log(self, _: str = "gateway") -> str:
        """Everything it wrote so far (stdout and stderr)."""
        return self.log_path.read_bytes().decode(errors="replace")

    def __enter__(self) -> GatewayProcess:
        with self.log_path.open("wb") as out:
            argv, env = self.argv, self.env
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            wait_ready(self.base, {"gateway": self.proc}, self.log, limit_s=60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


async def gateway_while_redis_paused(
    harness: Harness, redis_proc: subprocess.Popen[bytes], routed: list[Stage]
) -> httpx.AsyncClient:
    """A gateway started while its Redis is paused (SIGSTOP: connections hang, commands
    time out after 0.5 s), the Redis resumed once the gateway has started."""
    redis_proc.send_signal(signal.SIGSTOP)
    try:
        return await harness.gateway(routed, redis_timeout_s=0.5)
    finally:
        redis_proc.send_signal(signal.SIGCONT)


async def died_running(
    redis: aioredis.Redis, keys: Keys, stream: str, consumer: str = "crashed-worker"
) -> list[Any]:
    """Read ``stream``'s new entries as ``consumer`` and mark them on the model, as a
    worker does just before its model runs them (:mod:`workers.claims`): what a worker
    that died running them leaves behind. Returns what was read."""
    got = cast(list[Any], await redis.xreadgroup(GROUP, consumer, {stream: ">"}))
    entries = [Entry(eid, fields, stream) for _, read in got or [] for eid, fields in read]
    await mark_now(redis, keys, entries)
    return list(got or [])


async def beating(redis: aioredis.Redis, keys: Keys, stage: str, consumer: str) -> None:
    """Give ``consumer`` of ``stage`` a heartbeat good for a minute, as a live worker's
    (:class:`workers.alive.Presence`): a stand-in worker of a test counts as live."""
    seconds, _ = await redis.time()
    await redis.hset(keys.alive(stage), consumer, str((seconds + 60) * 1000))


async def read_sse(
    resp: httpx.Response, on_token: Callable[[], None] = lambda: None
) -> list[tuple[str, Any]]:
    """The events of a Server-Sent Events response, as (event, data) pairs, calling
    ``on_token`` as each ``token`` event arrives."""
    events: list[tuple[str, Any]] = []
    event = ""
    async for line in resp.aiter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((event, orjson.loads(line[len("data: ") :])))
            if event == "token":
                on_token()
    return events
