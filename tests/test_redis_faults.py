"""Redis-side faults on real processes and a real redis-server of the test's own: Redis
killed and restarted from its AOF, a worker paused mid-batch, a gateway killed, a gateway
out of pooled connections, clients that give up.

Waiting is on conditions, each bounded; nothing sleeps and hopes, and no test asserts a
speed: "promptly" is proven by making the slow path (the reclaim) impossible.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pipelines.embedded import free_port, start_redis
from tests.helpers import Harness, number_stage

REPO = Path(__file__).resolve().parents[1]


class Server:
    """A redis-server of one test, persisting every write (AOF, ``appendfsync always``).

    Args:
        workdir: where its AOF lives (kept across restarts).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = start_redis(self.port, workdir, appendonly=True)

    def kill(self) -> None:
        """SIGKILL: no shutdown save, only what the AOF holds survives."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Start it again on the same port, loading its AOF."""
        self.proc = start_redis(self.port, self.workdir, appendonly=True)

    def stop(self) -> None:
        """Stop it for good."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def server(env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The test's own Redis; every process the test starts afterwards is pointed at it.
    (Requested before ``harness``, so the harness's client connects here too.)"""
    srv = Server(tmp_path / "redis")
    monkeypatch.setenv("CONVEYOR_REDIS_URL", srv.url)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
async def admin(server: Server) -> AsyncIterator[aioredis.Redis]:
    """A plain client on the test's Redis, outside every pool under test."""
    client = aioredis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        await client.aclose()


def spawn(module: str, *args: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """A real process (``python -m module``) with the test's environment, logging to
    ``log``; the stages are tests/faultapp.py's."""
    full = dict(os.environ) | {"CONVEYOR_APP": "tests.faultapp:pipelines",
                               "PYTHONPATH": str(REPO)} | env  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=full, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a process this test started (SIGTERM, then SIGKILL)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def test_a_pool_wait_timeout_is_overload_not_an_outage(
    server: Server, harness: Harness, admin: aioredis.Redis
) -> None:
    # Two pooled connections, both held by writes Redis is holding (CLIENT PAUSE WRITE):
    # the other requests wait for a connection, not for Redis, and are told so.
    http = await harness.gateway(
        [number_stage(batch_wait_ms=0)], redis_max_connections=2, redis_timeout_s=0.5
    )
    assert (await http.post("/v1/jobs/double", json={"value": 0})).status_code == 202
    await admin.client_pause(5000, all=False)
    try:
        calls = [http.post("/v1/jobs/double", json={"value": v}, timeout=30) for v in range(8)]
        got = await asyncio.gather(*calls)
    finally:
        await admin.client_unpause()
    details = [r.json()["detail"] for r in got]
    assert {r.status_code for r in got} == {503}, details
    saturated = [r for r in got if "saturated" in r.json()["detail"]]
    assert saturated, details  # all said "the queue is unreachable" before
    for r in saturated:
        assert r.json()["detail"].startswith("the gateway is saturated: no free Redis connection")
        assert r.headers["Retry-After"] == "1"
    # Redis itself was fine all along, and once the writes go through, so do requests.
    assert (await http.post("/v1/jobs/double", json={"value": 1})).status_code == 202
