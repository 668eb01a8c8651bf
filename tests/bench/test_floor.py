"""``python -m bench.floor``: the floor, and each step of its ladder, is a real echo over a
real redis-server (each body back to the client that sent it, once; every request's done
marker set and its entry acknowledged); a batch published twice is answered once; a
request the bare server cannot read closes its connection; and one short run writes its
section with every system's figures at every load."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path

import orjson
import pytest
import redis

from bench import floor as floor_bench
from bench.floor import LADDER, TITLE, floor, main
from bench.floor_roles import DONE, GROUP, SCRIPT, STAGE
from bench.loadgen import Connection
from bench.systems import HOST

CLIENTS = 8
EACH = 40


async def _echo_through(port: int, path: str) -> list[tuple[bytes, int, bytes]]:
    """``CLIENTS`` connections at once, each posting ``EACH`` bodies of its own in turn:
    (sent, status, answer) for every request."""

    async def one(c: int) -> list[tuple[bytes, int, bytes]]:
        connection, seen = Connection(HOST, port), []
        try:
            for i in range(EACH):
                body = b'{"text": "client %d body %d"}' % (c, i)
                status, answer = await asyncio.wait_for(connection.post(path, body), 60)
                seen.append((body, status, answer))
        finally:
            await connection.close()
        return seen

    done = await asyncio.gather(*(one(c) for c in range(CLIENTS)))
    return [row for rows in done for row in rows]


@pytest.mark.parametrize("step", list(LADDER))
def test_the_floor_and_each_step_echo_each_body_to_its_sender_once(
    step: str, tmp_path: Path
) -> None:
    client, http = LADDER[step]
    with (
        floor(tmp_path, client, http) as running,
        redis.Redis(host=HOST, port=running.redis_port) as r,
    ):
        ready = sum(1 for _ in r.scan_iter(match=f"{DONE}*", count=1000))  # the probe's
        rows = asyncio.run(_echo_through(running.port, running.path))
        # A reply is published by the script that sets its marker and acks its entry:
        # every answer in, both are complete.
        markers = sum(1 for _ in r.scan_iter(match=f"{DONE}*", count=1000)) - ready
        pending = r.xpending(STAGE, GROUP)["pending"]
    assert len(rows) == CLIENTS * EACH
    assert all(status == 200 and answer == sent for sent, status, answer in rows)
    assert markers == CLIENTS * EACH
    assert pending == 0


def test_the_floor_s_worker_runs_minilm_on_each_body(tmp_path: Path) -> None:
    texts = [b'{"text": "a cat sat on the mat"}', b'{"text": "queues hold requests"}']
    with floor(tmp_path, model="minilm") as running:
        answers = asyncio.run(_post_each(running.port, running.path, texts))
    vectors = [orjson.loads(answer)["embedding"] for answer in answers]
    assert [len(v) for v in vectors] == [384, 384]
    assert vectors[0] != vectors[1]


async def _post_each(port: int, path: str, sent: list[bytes]) -> list[bytes]:
    connection = Connection(HOST, port)
    try:
        answers = []
        for body in sent:
            status, answer = await asyncio.wait_for(connection.post(path, body), 60)
            assert status == 200
            answers.append(answer)
        return answers
    finally:
        await connection.close()


def test_a_batch_published_twice_is_answered_once(redis_url: str) -> None:
    tag = uuid.uuid4().hex
    stage, replies, marker = f"{tag}:stage", f"{tag}:replies", f"{tag}:done:r1"
    with redis.Redis.from_url(redis_url) as r:
        try:
            r.xgroup_create(stage, GROUP, id="0", mkstream=True)
            first = r.xadd(stage, {"id": "r1", "e": "a"})
            r.xreadgroup(GROUP, "w", {stage: ">"})
            keys, args = [marker, replies, stage], [GROUP, first, "r1", "a", 1000]
            assert r.eval(SCRIPT, len(keys), *keys, *args) == 1
            assert r.eval(SCRIPT, len(keys), *keys, *args) == 0  # a retry: nothing again
            assert r.xlen(replies) == 1
            assert r.xpending(stage, GROUP)["pending"] == 0
        finally:
            r.delete(stage, replies, marker)


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/echo HTTP/1.1\r\nX-Content-Length: 5\r\n\r\n",  # not the header
        b"POST /v1/echo HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    ],
)
def test_a_request_the_bare_server_cannot_read_closes_its_connection(
    head: bytes, tmp_path: Path
) -> None:
    with floor(tmp_path) as running, socket.create_connection((HOST, running.port), 30) as sock:
        sock.sendall(head + b"hello")
        assert sock.recv(1024) == b""  # closed, nothing answered


@pytest.mark.timeout(300)  # eight systems started, conveyor twice: a minute when busy
def test_a_short_run_writes_every_system_s_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(floor_bench, "WARMUP_S", 0.2)
    monkeypatch.setattr(floor_bench, "SETTLE_S", 0.2)
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\n## What runs\n\nkept\n")
    args = ["--rounds", "1", "--clients", "2", "--models", "5", "--seconds", "0.5"]
    main([*args, "--out", str(out)])
    text = out.read_text()
    assert f"## {TITLE}\n" in text
    assert text.endswith("## What runs\n\nkept\n")  # the rest is kept, the section before
    for title in ("echo, 2 clients", "a 5 ms model, 1 client"):
        head, table = text.split(f"| {title}, per request | ", 1)[1].split("\n", 1)
        assert head.split(" | ") == [
            "conveyor (median; rounds)",
            "floor + redis-py + uvicorn (median; rounds)",
            "floor + redis-py (median; rounds)",
            "floor (median; rounds)",
            "conveyor / floor + redis-py + uvicorn",
            "conveyor / floor |",
        ]
        rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[1:9]}
        assert list(rows)[:3] == ["req/s", "p50 ms", "p50 over the model, ms"]
        commands = [float(c.split("**")[1]) for c in rows["Redis commands"].split(" | ")[1:5]]
        # The floor: its XADD, reply and marker, a batch's share, and a blocking read that
        # timed out in the second after the loop.
        assert commands[3] <= 7.5
        assert commands[0] > commands[3]  # conveyor does more
    assert "Errors" not in text
