"""``python -m bench.enqueue``: each way of enqueueing a burst writes every request whole
to the stream (the figures compare like with like), and one short run of the command
prints both tables with a figure for every way."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import redis.asyncio as aioredis

from bench.enqueue import SENDS, _burst
from pipelines.envelope import decode_request
from pipelines.keys import Keys
from tests.helpers import REPO


@pytest.mark.parametrize("way", list(SENDS))
async def test_each_way_enqueues_every_request_whole(
    way: str, redis: aioredis.Redis, namespace: str
) -> None:
    keys = Keys(namespace)
    requests = _burst(5, keys)
    answers = await SENDS[way](redis, keys, requests)
    assert len(answers) == 5
    assert all(isinstance(a, bytes) for a in answers), answers
    entries: Any = await redis.xrange(keys.stage_stream("echo"))
    assert [eid for eid, _ in entries] == answers
    assert [decode_request(fields) for _, fields in entries] == requests


def test_a_short_run_prints_both_tables() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.enqueue",
            "--sizes",
            "2,4",
            "--rounds",
            "1",
            "--requests",
            "40",
            "--round-trips",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    ways = [r for r in rows if r.split("|")[2].strip() in SENDS]
    assert len(ways) == 2 * len(SENDS)  # each burst size, each way
    assert sum("redis-py" in r or "conveyor" in r for r in rows if "claim" in r) == 2
    assert sum("EVALSHA" in r for r in rows) == 2
