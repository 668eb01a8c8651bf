"""Several gateway processes on one port (``conveyor up --gateways N``, ``conveyor
gateway`` with ``CONVEYOR_GATEWAYS``): each serves a share of the connections through its
own reply streams, and the supervisor stops every one."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from bench.rss import children
from conveyor.embedded import free_port
from gateway.settings import GatewaySettings
from pipelines.keys import Keys
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import REPO, up_env, wait_for_line, wait_ready

REQUESTS = 40
"""Requests, each on a new connection: the kernel picks a gateway for each (the chance
that one of two gets none is 2**-39)."""


def gateway_pids(pid: int) -> list[int]:
    """The gateway processes among ``pid``'s children."""
    found = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"gateway" in cmdline and b"-m" in cmdline:
            found.append(child)
    return sorted(found)


async def replies_by_gateway(redis_url: str, keys: Keys) -> dict[int, int]:
    """Replies ever written to each gateway's reply stream, by the gateway's pid (its id
    is host-pid-random)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        counts: dict[int, int] = {}
        async for key in client.scan_iter(match=keys.reply_stream("*")):
            info = await client.xinfo_stream(key)
            pid = int(key.decode().rsplit(":", 1)[1].split("-")[-2])
            counts[pid] = counts.get(pid, 0) + int(info["entries-added"])
        return counts
    finally:
        await client.aclose()


def test_up_with_two_gateways_serves_through_both_and_stops_both(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    env = up_env(CONVEYOR_REDIS_URL=redis_url, CONVEYOR_NAMESPACE=namespace)
    cmd = [CONVEYOR, "up", "--port", str(port), "--pipelines", "echo", "--gateways", "2"]
    with log.open("wb") as out:
        up = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_line(log, "conveyor: ready:", up, limit_s=90)
        assert "conveyor: 2 gateways on http://127.0.0.1:" in log.read_text()
        pids = gateway_pids(up.pid)
        assert len(pids) == 2, log.read_text()
        wait_ready(base, {"conveyor up": up}, lambda _: log.read_text())
        for i in range(REQUESTS):
            # A client of its own each time: a new connection, a new source port.
            answer = httpx.post(f"{base}/v1/echo", json={"i": i}, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"i": i}
        replies = asyncio.run(replies_by_gateway(redis_url, Keys(namespace)))
        assert sorted(replies) == pids, replies  # one reply stream per gateway process
        assert all(n > 0 for n in replies.values()), replies  # both answered some
        assert sum(replies.values()) == REQUESTS
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
    assert code == 0, log.read_text()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"gateway {pid} outlived up"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/healthz", timeout=1)


def test_conveyor_gateway_runs_as_many_as_the_setting_says_and_stops_them(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    # What compose's gateway container runs: one command, several processes, one port.
    port = free_port()
    log = tmp_path / "gateway.log"
    env = up_env(
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_NAMESPACE=namespace,
        CONVEYOR_PIPELINES="echo",
        CONVEYOR_PORT=str(port),
        CONVEYOR_GATEWAYS="3",
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "gateway"], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, {"conveyor gateway": proc}, lambda _: log.read_text())
        pids = gateway_pids(proc.pid)
        assert len(pids) == 3, log.read_text()
        for _ in range(10):
            assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"gateway {pid} outlived its supervisor"


def test_the_gateway_count_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert GatewaySettings().gateways == 1
    monkeypatch.setenv("CONVEYOR_GATEWAYS", "4")
    assert GatewaySettings().gateways == 4
    monkeypatch.setenv("CONVEYOR_GATEWAYS", "0")
    with pytest.raises(ValueError, match="gateways"):
        GatewaySettings()


def test_a_lone_gateway_does_not_share_its_port(
    tmp_path: Path, redis_url: str, namespace: str
) -> None:
    # SO_REUSEPORT only where several are meant: one meant to share a lone gateway's port
    # fails at once instead of silently taking part of its connections.
    port = free_port()
    env = up_env(
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_NAMESPACE=namespace,
        CONVEYOR_PIPELINES="echo",
        CONVEYOR_PORT=str(port),
    )
    log = tmp_path / "lone.log"
    with log.open("wb") as out:
        lone = subprocess.Popen(
            [CONVEYOR, "gateway"], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_ready(f"http://127.0.0.1:{port}", {"lone": lone}, lambda _: log.read_text())
        second = subprocess.run(
            [sys.executable, "-m", "gateway"],
            env=env | {"CONVEYOR_GATEWAYS": "2"},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 3, second.stderr
        assert f"cannot bind 127.0.0.1:{port}" in second.stderr
    finally:
        lone.terminate()
        lone.wait(timeout=30)  # uvicorn re-raises the SIGTERM it handled: -15
