"""Shared fixtures: a real redis-server for the session, a fresh namespace per test."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from conveyor.embedded import Cluster, cluster, free_port, start_redis
from pipelines.settings import CommonSettings
from runtime.redisio import connect
from tests.helpers import Harness

pytest_plugins = ["tests.leaks"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Stats go out with every publish, as a test reads them against its answers (a worker
# holds them back a second by default; tests/workers/test_report.py covers that).
os.environ.setdefault("CONVEYOR_STATS_FLUSH_S", "0")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port (or CONVEYOR_TEST_REDIS_URL)."""
    given = os.environ.get("CONVEYOR_TEST_REDIS_URL")
    if given:
        yield given
        return
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where tiny models are generated, once per session."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def env(redis_url: str, namespace: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point every settings class at the test's Redis and namespace."""
    monkeypatch.setenv("CONVEYOR_REDIS_URL", redis_url)
    monkeypatch.setenv("CONVEYOR_NAMESPACE", namespace)
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(cache_dir))


@pytest.fixture
async def redis(env: None) -> AsyncIterator[aioredis.Redis]:
    """A client on the test's Redis."""
    client = connect(CommonSettings())
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def harness(env: None, redis: aioredis.Redis) -> AsyncIterator[Harness]:
    """Builds workers and gateways on the test's namespace and tears them down."""
    h = Harness(redis)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
def own_redis(
    env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[subprocess.Popen[bytes]]:
    """A redis-server of this test alone (so it can be paused), used by everything the
    test starts afterwards."""
    port = free_port()
    proc = start_redis(port, tmp_path)
    monkeypatch.setenv("CONVEYOR_REDIS_URL", f"redis://127.0.0.1:{port}/0")
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A real three-node Redis Cluster on loopback, for the tests that ask (started once)."""
    with cluster(tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes


@pytest.fixture
def on_cluster(redis_cluster: Cluster, env: None, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """Everything the test starts afterwards uses three partitions on the cluster."""
    monkeypatch.setenv(
        "CONVEYOR_REDIS_URL", redis_cluster.url.replace("redis://", "redis+cluster://")
    )
    monkeypatch.setenv("CONVEYOR_PARTITIONS", "3")
    return redis_cluster
