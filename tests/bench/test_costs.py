"""``python -m bench.costs --parts packing``: both packers pack conveyor's commands to the
same bytes, and the worker drains its stream either way (a real worker, real Redis)."""

from __future__ import annotations

import redis.asyncio as aioredis

from bench.costs import PACKED, packing_costs


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
