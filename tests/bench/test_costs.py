"""``python -m bench.costs``: both packers pack conveyor's commands to the same bytes, and
the worker drains its stream either way (a real worker, real Redis), as it does with
either write (direct, redis-py's ``wait_for``); the script part writes markers as a
publish does, new ones every call."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from bench.costs import (
    PACKED,
    SCRIPTS,
    SENDERS,
    _sender,
    packing_costs,
    script_costs,
    sending_costs,
)
from pipelines.settings import CommonSettings
from runtime.packing import packing
from runtime.redisio import connect


async def test_the_packing_part_measures_both_packers_on_a_draining_worker(
    redis_url: str,
) -> None:
    lines = await packing_costs(redis_url, requests=24, batches=[8], rounds=1)
    client = aioredis.Redis.from_url(redis_url)
    try:  # the drains' namespaces, left in the session's Redis
        keys = [key async for key in client.scan_iter(match="*costs8-*")]
        assert keys
        await client.delete(*keys)
    finally:
        await client.aclose()
    packed = [line for line in lines if line.startswith("| a ")]
    assert [line.split(" | ")[0][2:] for line in packed] == list(PACKED)
    workers = [line for line in lines if line.startswith(("| redis-py", "| hiredis"))]
    assert len(workers) == 2
    for line in workers:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[1:3] == ["8", "3"]  # batch 8: 24 requests drained in 3 batches
    summary = lines[-1].strip("|").split("|")
    assert summary[0].strip() == "8"
    assert summary[-1].strip().endswith("x")


async def test_the_sending_part_compares_both_writes_on_a_draining_worker(
    redis_url: str,
) -> None:
    lines = await sending_costs(redis_url, requests=24, batches=[8], rounds=1)
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match="*costs8-*")]
        assert keys
        await client.delete(*keys)
    finally:
        await client.aclose()
    rows = [line for line in lines if line.startswith(tuple(f"| {w}" for w in SENDERS.values()))]
    assert len(rows) == 4  # a PING and pipeline row, then a drain, each way
    for line in rows[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[1:3] == ["8", "3"]
    assert lines[-1].strip("|").split("|")[-1].strip().endswith("x")


def test_the_sending_part_writes_each_way_it_names(redis_url: str) -> None:
    settings = CommonSettings(redis_url=redis_url)
    with _sender(direct=False):
        theirs = connect(settings).connection_pool.connection_class
    with _sender(direct=True):
        ours = connect(settings).connection_pool.connection_class
    assert ours is packing(ours)
    assert theirs is not ours
    assert issubclass(theirs, ours)
    assert theirs.send_packed_command is not ours.send_packed_command


def test_the_script_part_writes_new_markers_every_call(redis_url: str) -> None:
    # A marker written again costs Redis less than a new one, and a publish's markers are
    # all new: the bench's must be too.
    client = redis.Redis.from_url(redis_url)
    try:
        port = client.connection_pool.connection_kwargs["port"]
        lines = script_costs(port, n=4, calls=5)
        markers = list(client.scan_iter(match="{bench}:done:*:echo"))
        hashes = list(client.scan_iter(match="{bench}:done:*:batch"))
        assert len(markers) == 4 * 5
        assert len(hashes) == 5
        assert len(client.hkeys(hashes[0])) == 4
        client.delete(*markers, *hashes, "bench:r1", "bench:r2")
    finally:
        client.close()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| a batch")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(SCRIPTS)
    for row in rows:
        per_call, per_request = (float(c) for c in row.strip("|").split("|")[1:])
        assert per_call > 0
        assert per_request == pytest.approx(per_call / 4, abs=0.01)
