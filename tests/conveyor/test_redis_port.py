"""``up``'s embedded Redis keeps its port across starts on the same data folder, so a
``CONVEYOR_REDIS_URL`` written down from one start still reads the next; a port taken
since is left, in one line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from redis import StrictRedis

from conveyor.data import PORTFILE
from conveyor.embedded import UpRedis, free_port, up_port


def start(data: Path) -> UpRedis:
    redis = UpRedis(data)
    redis.start(avoid=0)
    return redis


def test_a_second_start_on_the_same_folder_takes_the_same_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = start(tmp_path)
    try:
        port = first.port
    finally:
        first.stop()
    assert (tmp_path / PORTFILE).read_text().strip() == str(port)
    second = start(tmp_path)
    try:
        assert second.port == port
    finally:
        second.stop()
    assert "is taken" not in capsys.readouterr().out


def test_a_remembered_port_taken_since_is_left_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        (tmp_path / PORTFILE).write_text(f"{taken}\n")
        redis = start(tmp_path)
        try:
            assert redis.port != taken
        finally:
            redis.stop()
    moved = [line for line in capsys.readouterr().out.splitlines() if "is taken" in line]
    assert len(moved) == 1
    assert f"port {taken}" in moved[0]
    assert f"now on {redis.port}" in moved[0]
    assert (tmp_path / PORTFILE).read_text().strip() == str(redis.port)


def test_the_port_choice(tmp_path: Path) -> None:
    assert up_port(None, avoid=0)[1] is None  # --ephemeral: a free port, nothing said
    assert up_port(tmp_path, avoid=0)[1] is None  # nothing remembered yet
    (tmp_path / PORTFILE).write_text("not a port\n")
    assert up_port(tmp_path, avoid=0)[1] is None
    free = free_port()
    (tmp_path / PORTFILE).write_text(f"{free}\n")
    assert up_port(tmp_path, avoid=0) == (free, None)
    port, why = up_port(tmp_path, avoid=free)  # the gateway's port wins
    assert port != free
    assert why is not None
    assert "the gateway's" in why


def test_the_embedded_redis_is_bounded_in_memory_and_never_evicts(tmp_path: Path) -> None:
    # Round four, lesser f: the embedded Redis had no memory bound (16 jobs of 400 KB
    # filled a small disk). It holds CONVEYOR_REDIS_MAXMEMORY_MB, refusing writes at it
    # (noeviction: queued work is never dropped to make room).
    redis = UpRedis(tmp_path, maxmemory_mb=32)
    redis.start(avoid=0)
    try:
        client = StrictRedis(port=redis.port)
        try:
            assert client.config_get("maxmemory")["maxmemory"] == str(32 * 1024 * 1024)
            assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        finally:
            client.close()
    finally:
        redis.stop()
