"""``python -m bench.entries``: each way carries every request of a burst whole (one entry
each, or one entry for all, its requests' fields numbered), reads, marks, acks and unmarks
them all, and leaves nothing pending; one short run prints a figure for every way."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import redis

from bench.enqueue import _burst
from bench.entries import WAYS, _raw
from pipelines.envelope import FIELD, decode_request, encode
from pipelines.keys import GROUP, Keys
from tests.helpers import REPO


@pytest.mark.parametrize("way", list(WAYS))
def test_each_way_carries_the_burst_whole_and_leaves_nothing_pending(
    way: str, redis_url: str, namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = f"{namespace}:entries"
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    requests = _burst(4, Keys(namespace))
    fields = [{_raw(k): _raw(v) for k, v in encode(r).items()} for r in requests]
    WAYS[way](client, stream, fields)
    entries: Any = client.xrange(stream)
    if way == "entry per request":
        assert [decode_request(f) for _, f in entries] == requests
    else:
        ((_, joined),) = entries
        assert len(joined) == 2 * len(requests)
        numbered = [FIELD] + [FIELD + b"%d" % i for i in range(1, len(requests))]
        assert [decode_request({FIELD: joined[name]}) for name in numbered] == requests
    assert client.xpending(stream, GROUP)["pending"] == 0
    assert client.hlen(f"{stream}:marks") == 0


def test_a_short_run_prints_a_figure_for_every_way() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.entries", "--sizes", "2", "--rounds", "1", "--bursts", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [line for line in done.stdout.splitlines() if line.startswith("| entry per")]
    assert len(rows) == len(WAYS), done.stdout
    assert all("**" in row for row in rows)
