"""A worker started by hand beside others (``conveyor worker``, ``python -m workers``) takes
its share of the host's cores for torch, not torch's default of all of them: it counts the
other live workers of its host that run a model with torch on the CPU, from their
heartbeats in Redis, and says so in one line naming ``CONVEYOR_THREADS`` (before: it ran
as many threads as cores beside ``up``'s workers, which had divided the cores among
themselves; batches ran 5x slower). A worker that runs no torch thread on the CPU (a toy,
a function step, a model on a GPU) is not counted: beside the bench's echo worker, MiniLM
ran on one of two cores, 83 against 125 requests a second at 64 clients."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import torch

from pipelines.keys import Keys
from pipelines.settings import CommonSettings
from runtime.redisio import RedisClock, text
from tests.helpers import up_env, wait_for_line, worker_process
from tests.support.deviceapp import ON_DEVICE
from workers.alive import Presence
from workers.build import build_model
from workers.settings import WorkerSettings
from workers.threads import _pid_on, count_host_workers, host_cores, host_share, share_host

HOST = socket.gethostname()


async def beat(
    client: aioredis.Redis, stage: str, name: str, in_ms: int = 60_000, cpu_model: bool = True
) -> None:
    """A heartbeat of consumer ``name`` of ``stage`` that runs out ``in_ms`` from now (as
    :class:`workers.alive.Presence` writes it), of a worker whose model runs torch on the
    CPU unless ``cpu_model`` is False."""
    keys = CommonSettings().keys
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    await client.sadd(keys.stages_set(), stage)
    await client.hset(keys.alive(stage), name, str(now_ms + in_ms))
    if cpu_model:
        await client.hset(keys.cpu_models(), name, str(now_ms + in_ms))


async def two_others(client: aioredis.Redis) -> None:
    """Two other live workers of this host (one of them serving two stages), and what
    must not count: another host's, one whose beat ran out, this process's own, a forged
    field."""
    await beat(client, "embed", f"{HOST}-4101-aa")
    await beat(client, "ner", f"{HOST}-4101-bb")  # the same process, a second stage
    await beat(client, "ner", f"{HOST}-4102-cc")
    await beat(client, "ner", f"elsewhere-{HOST}-4103-dd")
    await beat(client, "embed", "otherhost-4104-ee")
    await beat(client, "embed", f"{HOST}-4105-ff", in_ms=-1000)
    await beat(client, "embed", f"{HOST}-{os.getpid()}-gg")
    await client.hset(CommonSettings().keys.cpu_models(), f"{HOST}-4106-hh", "not a time")
    # Live on this host, but running no torch thread on the CPU (a toy, a function step).
    await beat(client, "adder", f"{HOST}-4107-ii", cpu_model=False)


async def test_the_other_live_workers_of_this_host_are_counted_by_process(
    redis: aioredis.Redis,
) -> None:
    assert await count_host_workers(CommonSettings()) == 0
    await two_others(redis)
    assert await count_host_workers(CommonSettings()) == 2
    assert await count_host_workers(CommonSettings(), host="otherhost") == 1


async def test_a_forged_hash_of_cpu_models_counts_no_one_and_stops_no_beat(
    redis: aioredis.Redis,
) -> None:
    keys = CommonSettings().keys
    await redis.set(keys.cpu_models(), "forged")
    assert await count_host_workers(CommonSettings()) == 0
    name = f"{HOST}-4108-jj"
    presence = Presence(redis, keys, "embed", name, RedisClock(), 30.0)
    presence.cpu_model = True
    await presence.beat()  # its stage's beat is set all the same
    assert await redis.hexists(keys.alive("embed"), name)
    await presence.stop(leave=True)
    assert not await redis.hexists(keys.alive("embed"), name)
    assert await redis.get(keys.cpu_models()) == b"forged"


@pytest.fixture
def kept_threads() -> Iterator[None]:
    """torch's threads and the host share as they were, after the test."""
    before = torch.get_num_threads()
    yield
    share_host(0)
    torch.set_num_threads(before)


@pytest.mark.usefixtures("kept_threads")
def test_the_share_is_taken_on_cpu_and_said_but_cuda_keeps_its_few(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workers.threads")
    assert share_host(0) is None
    assert host_share() is None
    share = share_host(2, cores=8)
    assert share is not None
    assert (share.cores, share.processes) == (8, 3)
    assert "2 other worker process(es)" in caplog.text
    assert "CONVEYOR_THREADS" in caplog.text
    build_model(ON_DEVICE, WorkerSettings(device="cpu"))
    assert torch.get_num_threads() == 2  # 8 cores among 3 processes
    build_model(ON_DEVICE, WorkerSettings(device="cuda"))
    assert torch.get_num_threads() == 1  # on cuda the host only launches kernels
    build_model(ON_DEVICE, WorkerSettings(device="cpu", threads=5))
    assert torch.get_num_threads() == 5  # CONVEYOR_THREADS wins


@pytest.fixture
async def others(redis: aioredis.Redis) -> None:
    """The beats of :func:`two_others`, in the test's namespace."""
    await two_others(redis)


@pytest.mark.timeout(240)  # a worker's start, torch's import and its stop, on a busy machine
@pytest.mark.usefixtures("others")
def test_a_worker_started_by_hand_beside_others_takes_its_share(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    log = tmp_path / "worker.log"
    env = up_env(
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_NAMESPACE=namespace,
        CONVEYOR_APP="tests.support.deviceapp:pipelines",
        CONVEYOR_PIPELINES="ondevice",
        CONVEYOR_DEVICE="cpu",
    )
    worker = worker_process(log, env, "ondevice")
    try:
        wait_for_line(log, "stage ondevice: on ", worker, limit_s=90)
        text = wait_for_line(log, "torch thread(s)", worker, limit_s=10)
        # Three others: the two, and the beat this test process wrote as its own.
        want = max(1, host_cores() // 4)
        assert "3 other worker process(es) live on this host" in text, text
        assert re.search(rf"stage ondevice: on cpu, {want} torch thread\(s\)\n", text), text
        # It runs torch on the CPU: counted by the next worker started by hand here.
        wait_for_line(log, "consumer ", worker, limit_s=30)
        assert worker.pid in cpu_model_pids(redis_url, namespace)
    finally:
        worker.terminate()
        assert worker.wait(timeout=30) == 0, log.read_text()
    assert worker.pid not in cpu_model_pids(redis_url, namespace)  # an orderly stop leaves


def cpu_model_pids(redis_url: str, namespace: str) -> set[int]:
    """The pids of this host's workers in the namespace's hash of CPU model processes."""
    client = redis.Redis.from_url(redis_url)
    try:
        names = client.hkeys(Keys(namespace).cpu_models())
    finally:
        client.close()
    return {pid for pid in map(pid_of, names) if pid is not None}


def pid_of(name: bytes | str) -> int | None:
    """The pid in a consumer name ``host-pid-random`` of this host (None: another's)."""
    return _pid_on(text(name), HOST)


@pytest.mark.timeout(240)
def test_a_toy_worker_takes_no_share_of_the_cores(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    """A toy's worker runs no torch (it never loads it): live, but not among the
    processes a worker started beside it divides the cores among."""
    log = tmp_path / "toy.log"
    env = up_env(
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_NAMESPACE=namespace,
        CONVEYOR_PIPELINES="chain",
    )
    worker = worker_process(log, env, "adder")
    try:
        wait_for_line(log, "consumer ", worker, limit_s=60)
        client = redis.Redis.from_url(redis_url)
        try:
            beats = client.hkeys(Keys(namespace).alive("adder"))
        finally:
            client.close()
        assert {pid_of(b) for b in beats} == {worker.pid}  # it is live
        assert cpu_model_pids(redis_url, namespace) == set()
        settings = CommonSettings(redis_url=redis_url, namespace=namespace)
        assert asyncio.run(count_host_workers(settings)) == 0
    finally:
        worker.terminate()
        assert worker.wait(timeout=30) == 0, log.read_text()
