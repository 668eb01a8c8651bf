"""Async jobs are readable only under the API key (or the absence of one) that created them."""

from __future__ import annotations

import httpx
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from pipelines.outcomes import DONE, QUEUED
from pipelines.records import JobField
from runtime.redisio import text
from tests.helpers import Doubler, Harness, number_stage, until

KEY_A = "alpha-secret-key"
KEY_B = "bravo-secret-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def submit(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    resp = await http.post("/v1/jobs/double", json={"value": 4}, headers=headers)
    assert resp.status_code == 202, resp.text
    return str(resp.json()["id"])


async def test_a_job_is_read_only_under_the_key_that_created_it(
    harness: Harness, redis: aioredis.Redis
) -> None:
    stage = number_stage(batch_wait_ms=0)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    keyed = await harness.gateway([stage], api_keys=[KEY_A, KEY_B])
    open_ = await harness.gateway([stage])  # same Redis and namespace, no keys

    job_a = await submit(keyed, bearer(KEY_A))

    async def done() -> bool:
        resp = await keyed.get(f"/v1/jobs/{job_a}", headers=bearer(KEY_A))
        assert resp.status_code == 200, resp.text
        return bool(resp.json()["status"] == "done")

    await until(done)
    assert (await keyed.get(f"/v1/jobs/{job_a}", headers={"X-API-Key": KEY_A})).json()[
        "result"
    ] == {"value": 8}

    # Another key, and a gateway without keys, see exactly what an unknown id gets.
    unknown = await keyed.get("/v1/jobs/no-such-job", headers=bearer(KEY_B))
    assert unknown.status_code == 404
    for resp in (
        await keyed.get(f"/v1/jobs/{job_a}", headers=bearer(KEY_B)),
        await keyed.get(f"/v1/jobs/{job_a}", headers={"X-API-Key": KEY_B}),
        await open_.get(f"/v1/jobs/{job_a}"),
        await open_.get(f"/v1/jobs/{job_a}", headers=bearer(KEY_A)),  # keys off: ignored
    ):
        assert resp.status_code == 404, resp.text
        assert resp.json() == {"detail": unknown.json()["detail"].replace("no-such-job", job_a)}
    assert (await keyed.get(f"/v1/jobs/{job_a}")).status_code == 401

    # A job made without a key is the keyless gateway's alone.
    job_open = await submit(open_, {})
    assert (await open_.get(f"/v1/jobs/{job_open}")).status_code == 200
    for key in (KEY_A, KEY_B):
        resp = await keyed.get(f"/v1/jobs/{job_open}", headers=bearer(key))
        assert resp.status_code == 404, resp.text

    # The record holds a digest of the key, never the key.
    for job_id in (job_a, job_open):
        record = await redis.hgetall(harness.keys.job(job_id))
        assert record
        values = " ".join(text(v) for v in record.values())
        assert KEY_A not in values
        assert KEY_B not in values


async def test_a_record_without_an_owner_is_nobodys(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # e.g. a worker's late result recreating a record that had expired
    http = await harness.gateway([number_stage()])
    late: dict[FieldT, EncodableT] = {JobField.STATUS: DONE, JobField.RESULT: "1"}
    await redis.hset(harness.keys.job("orphan"), mapping=late)
    resp = await http.get("/v1/jobs/orphan")
    assert resp.status_code == 404, resp.text


async def test_a_job_written_before_owners_stays_readable(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # A record from before jobs had owners (it lives job_ttl_s): readable as it was, so a
    # deploy does not strand the jobs in flight.
    http = await harness.gateway([number_stage()], api_keys=["k1"])
    record: dict[FieldT, EncodableT] = {
        JobField.STATUS: QUEUED,
        JobField.PIPELINE: "double",
        JobField.DEADLINE: "9999999999",
    }
    await redis.hset(harness.keys.job("legacy"), mapping=record)
    resp = await http.get("/v1/jobs/legacy", headers={"X-API-Key": "k1"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "queued"
