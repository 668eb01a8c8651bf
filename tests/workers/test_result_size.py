"""Results bounded in size (issue 36, lesser f): a result over ``CONVEYOR_MAX_RESULT_BYTES``
is not written to Redis; its caller is told, naming the bound; its batch-mates are not
touched. Real redis-server, a real worker and gateway in the test's process."""

from __future__ import annotations

import asyncio
import threading
from typing import cast

import redis.asyncio as aioredis

from pipelines.model import Item, Result
from tests.helpers import Harness, number_stage, until


class Blobs:
    """Answers ``value`` characters of text per item; records every batch it ran."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.lock = threading.Lock()

    def predict(self, items: list[Item]) -> list[Result]:
        """A blob as long as each item asks."""
        with self.lock:
            self.batches.append([i["value"] for i in items])
        return [{"blob": "x" * i["value"]} for i in items]


async def test_a_result_over_the_bound_fails_alone_and_is_not_written(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 36, f): job results of any size were written to Redis and kept 24 h:
    # 16 jobs of 400 KB filled a 20 MB disk, and then everything answered 503. A result
    # over the bound is now refused alone, its caller told the bound; nothing of it is
    # stored.
    stage = number_stage("blobs", max_batch_size=8, batch_wait_ms=300)
    model = Blobs()
    worker = harness.worker(stage, model, max_result_bytes=4096, adaptive_batching=False)
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    sizes = [10, 100_000, 20]
    got = await asyncio.gather(*(http.post("/v1/blobs", json={"value": n}) for n in sizes))
    small, big, other = got
    assert big.status_code == 422, big.text
    detail = str(big.json()["detail"])
    assert "4096" in detail, detail
    assert "CONVEYOR_MAX_RESULT_BYTES" in detail, detail
    assert small.status_code == 200, small.text
    assert small.json() == {"blob": "x" * 10}
    assert other.status_code == 200, other.text
    assert other.json() == {"blob": "x" * 20}
    assert sorted(sizes) in [sorted(b) for b in model.batches], model.batches  # one batch

    # As a job: its record says failed, and holds no part of the result.
    job = await http.post("/v1/jobs/blobs", json={"value": 200_000})
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]

    async def finished() -> bool:
        resp = await http.get(f"/v1/jobs/{job_id}")
        return bool(resp.json()["status"] not in ("queued", "running"))

    await until(finished, 30)
    record = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert record["status"] == "failed", record
    assert "CONVEYOR_MAX_RESULT_BYTES" in str(record), record
    stored = await redis.hgetall(harness.keys.job(job_id))
    assert sum(len(k) + len(v) for k, v in stored.items()) < 4096, stored.keys()


async def test_the_default_bound_refuses_a_result_of_nine_mib(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # The bound is on by default (8 MiB): a 9 MiB result is refused, a 7 MiB one sent.
    stage = number_stage("blobs", batch_wait_ms=0)
    worker = harness.worker(stage, Blobs())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    big = await http.post("/v1/blobs", json={"value": 9 * 1024 * 1024}, timeout=60)
    assert big.status_code == 422, big.text[:300]
    assert "8388608" in str(big.json()["detail"]), big.text[:300]
    fits = await http.post("/v1/blobs", json={"value": 7 * 1024 * 1024}, timeout=60)
    assert fits.status_code == 200, fits.text[:300]
    assert len(fits.json()["blob"]) == 7 * 1024 * 1024
    # The reply stream holds the 7 MiB reply only, not the 9 MiB one.
    replies = [k async for k in redis.scan_iter(match=f"{harness.keys.prefix}:reply:*")]
    total = 0
    for key in replies:
        for _, fields in cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(key)):
            total += sum(len(v) for v in fields.values())
    assert total < 8 * 1024 * 1024, total
