"""``python -m bench.scriptcost``: both ways of writing a batch's replies are measured at
every size (packing unbounded there), and each batch's replies read back whole."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, cast

import redis

from bench.scriptcost import measure
from pipelines.envelope import decode_replies
from pipelines.keys import Keys
from tests.helpers import REPO


def test_each_way_is_measured_and_its_replies_read_back(redis_url: str, namespace: str) -> None:
    client = redis.Redis.from_url(redis_url)
    got = measure(client, "embed", 3, 4, namespace)  # 23 KB a batch: packed here all the same
    assert {way: len(values) for way, values in got.items()} == dict.fromkeys(got, 2)
    entries = cast(list[Any], client.xrange(Keys(namespace).reply_stream("g")))
    assert [list(fields) for _, fields in entries] == [[b"e", b"e1", b"e2"], [b"E"]] * 2
    assert all(len(decode_replies(fields)) == 3 for _, fields in entries)


def test_a_short_run_prints_a_row_for_every_size_and_batch() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scriptcost",
            "--sizes",
            "echo,embed",
            "--batches",
            "2,3",
            "--calls",
            "4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| echo", "| embed"))]
    assert len(rows) == 4, done.stdout
