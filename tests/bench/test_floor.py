"""``python -m bench.floor``: the floor is a real echo over a real redis-server (each body
back to its own client, once; every request's done marker set and its entry acknowledged),
for the floor and each step of its ladder; a batch already published is not published
again; and one short run writes its section with every system's figures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from bench.floor import LADDER, TITLE, floor, main
from bench.floor_roles import DONE, GROUP, REPLIES, SCRIPT, STAGE
from bench.loadgen import closed_loop
from bench.systems import HOST


@pytest.mark.parametrize("step", list(LADDER))
def test_the_floor_and_each_step_echo_each_body_to_its_own_client_once(
    step: str, tmp_path: Path
) -> None:
    client, http = LADDER[step]
    sent = [b'{"text": "body %d"}' % i for i in range(300)]
    got: list[bytes] = []
    with (
        floor(tmp_path, client, http) as running,
        redis.Redis(host=HOST, port=running.redis_port) as r,
    ):
        ready = sum(1 for _ in r.scan_iter(match=f"{DONE}*", count=1000))  # the probe's
        result = asyncio.run(
            closed_loop(
                HOST,
                running.port,
                "/v1/echo",
                sent,
                8,
                on_response=lambda status, body: got.append(body),
            )
        )
        markers = sum(1 for _ in r.scan_iter(match=f"{DONE}*", count=1000)) - ready
        pending = r.xpending(STAGE, GROUP)["pending"]
    assert (result.requests, result.errors) == (300, 0)
    assert sorted(got) == sorted(sent)  # each body came back, to a client of its own
    assert markers == 300
    assert pending == 0


def test_a_batch_published_twice_is_answered_once(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as r:
        r.delete(STAGE, REPLIES)
        r.xgroup_create(STAGE, GROUP, id="0", mkstream=True)
        first = r.xadd(STAGE, {"id": "r1", "e": "a"})
        r.xreadgroup(GROUP, "w", {STAGE: ">"})
        keys = [DONE + "r1", REPLIES, STAGE]
        args = [GROUP, first, "r1", "a", 1000]
        assert r.eval(SCRIPT, len(keys), *keys, *args) == 1
        assert r.eval(SCRIPT, len(keys), *keys, *args) == 0  # a retry: nothing again
        assert r.xlen(REPLIES) == 1
        assert r.xpending(STAGE, GROUP)["pending"] == 0
        r.delete(STAGE, REPLIES, DONE + "r1")


def test_a_short_run_writes_every_system_s_figures(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\n## What runs\n\nkept\n")
    main(["--rounds", "1", "--clients", "2", "--seconds", "0.5", "--out", str(out)])
    text = out.read_text()
    assert f"## {TITLE}\n" in text
    assert text.endswith("## What runs\n\nkept\n")  # the rest is kept, the section before
    head, table = text.split("| echo, 2 clients, per request | ", 1)[1].split("\n", 1)
    assert head.split(" | ") == [
        "conveyor (median; rounds)",
        "floor + redis-py + uvicorn (median; rounds)",
        "floor + redis-py (median; rounds)",
        "floor (median; rounds)",
        "conveyor / floor |",
    ]
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[1:8]}
    assert list(rows) == [
        "req/s",
        "p50 ms",
        "p99 ms",
        "Redis commands",
        "Redis CPU µs (`INFO cpu`)",
        "gateway (serve) CPU µs",
        "worker (work) CPU µs",
    ]
    assert "Errors" not in text
