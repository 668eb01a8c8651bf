"""Partitioned streams (issue 17): three partitions on one Redis and on a real three-node
Redis Cluster, through the real gateway and real workers.

Each test runs on both. On the cluster, the three partitions' slots are on three shards,
so every request's keys, scripts and transactions must stay in its partition's slot or
Redis refuses them (CROSSSLOT): a test passing there proves they do.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from conveyor.embedded import Cluster, free_port
from gateway.headers import PRIORITY
from pipelines.builtin import ADDER, builtin_pipelines
from pipelines.envelope import decode_replies, encode
from pipelines.errors import ConfigError
from pipelines.keys import GROUP, Keys
from pipelines.registry import Registry
from pipelines.settings import CommonSettings
from runtime.redisio import connect, ensure_group
from tests.helpers import (
    Doubler,
    Harness,
    conveyor,
    died_running,
    gateway_while_redis_paused,
    number_stage,
    until,
)

PARTITIONS = 3


@pytest.fixture(params=["one-server", "cluster"])
async def parted(
    request: pytest.FixtureRequest, env: None, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Harness]:
    """A harness whose every process uses three partitions, on the session's Redis or
    (``redis+cluster://``) on the cluster."""
    if request.param == "cluster":
        request.getfixturevalue("on_cluster")
    monkeypatch.setenv("CONVEYOR_PARTITIONS", str(PARTITIONS))
    client = connect(CommonSettings())
    assert isinstance(client, RedisCluster) == (request.param == "cluster")
    harness = Harness(client)
    try:
        yield harness
    finally:
        await harness.close()
        await client.aclose()


def builtins(*names: str) -> Registry:
    return Registry(builtin_pipelines()).select(names)


async def per_partition(harness: Harness, stage: str, field: str) -> list[int]:
    """``field`` of the stage's stats hash in each partition."""
    got = []
    for part in harness.keys.each():
        value = await harness.redis.hget(part.stage_stats(stage), field)
        got.append(int(float(value or 0)))
    return got


async def test_partitions_are_on_different_shards_of_a_cluster(redis_cluster: Cluster) -> None:
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        await client.initialize()  # learns which node serves which slots
        keys = Keys("conveyor", PARTITIONS)
        nodes = {str(client.get_node_from_key(k.stage_stream("embed"))) for k in keys.each()}
        assert len(nodes) == PARTITIONS  # one partition per shard: the slots were chosen so
    finally:
        await client.aclose()


async def test_sync_calls_spread_over_partitions_and_are_each_answered_once(
    parted: Harness,
) -> None:
    http = await parted.serve(builtins("chain"))
    got = await asyncio.gather(*(http.post("/v1/chain", json={"value": v}) for v in range(60)))
    assert [r.json() for r in got] == [{"value": (v + 1) * 2} for v in range(60)]
    spread = await per_partition(parted, "adder", "items:ok")
    assert sum(spread) == 60
    assert all(n > 0 for n in spread), spread  # every partition took some
    # Every view sums the partitions.
    assert (await parted.stats("multiplier"))["items:ok"] == 60
    status = (await http.get("/status.json")).json()
    assert status["partitions"] == PARTITIONS
    adder = next(s for s in status["stages"] if s["stage"] == "adder")
    assert adder["items"]["ok"] == 60
    assert len(adder["consumers"]) == 1  # one worker serving three partitions is one
    metrics = (await http.get("/metrics")).text
    assert 'conveyor_stage_items_total{stage="adder",outcome="ok"} 60' in metrics
    shown = await asyncio.to_thread(conveyor, "status")  # the operator's view sums them too
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"{PARTITIONS} partitions; each row sums them\n")
    assert re.search(r"^adder\s+\d+\s+0\s+0\s+1/1\s", shown.stdout, re.M), shown.stdout


async def test_fan_out_join_and_route_within_each_partition(parted: Harness) -> None:
    http = await parted.serve(builtins("broadcast", "hello"))
    fanned = await asyncio.gather(
        *(http.post("/v1/broadcast", json={"value": v}) for v in range(24))
    )
    assert [r.json() for r in fanned] == [
        {"results": [{"value": v + 1}, {"value": v * 2}]} for v in range(24)
    ]
    # Which partition a request lands in is a hash of its random id: 30 requests leave a
    # partition without any once in ~60,000 runs (3 x (2/3)^30); 18 did once in 500.
    languages = ["spanish", "french", "klingon"] * 10
    routed = await asyncio.gather(
        *(http.post("/v1/hello", json={"language": lang, "name": "Ada"}) for lang in languages)
    )
    messages = {"spanish": "Hola Ada", "french": "Bonjour Ada", "klingon": "Please try again."}
    assert [r.json()["message"] for r in routed] == [messages[lang] for lang in languages]
    assert (await parted.stats("hello.french"))["items:ok"] == 10  # the rest were rejected early
    assert all(n > 0 for n in await per_partition(parted, "hello.detect", "items:ok"))


async def test_jobs_are_found_and_cancelled_in_their_partition(parted: Harness) -> None:
    registry = builtins("chain")
    http = await parted.gateway(registry)  # no worker yet: every job stays queued
    ids = []
    for v in range(30):  # enough that every partition gets some (see above)
        resp = await http.post("/v1/jobs/chain", json={"value": v})
        assert resp.status_code == 202, resp.text
        ids.append(resp.json()["id"])
    assert {parted.keys.of(i).partition for i in ids} == set(range(PARTITIONS))
    cancelled = ids[::3]
    for job in cancelled:
        resp = await http.delete(f"/v1/jobs/{job}")
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] == "cancelled"
    await parted.start_workers(registry)

    async def finished() -> bool:
        views = [(await http.get(f"/v1/jobs/{j}")).json() for j in ids]
        return all(v["status"] != "queued" for v in views)

    await until(finished)
    for v, job in enumerate(ids):
        view = (await http.get(f"/v1/jobs/{job}")).json()
        if job in cancelled:
            assert view["status"] == "cancelled", view
        else:
            assert view["status"] == "done", view
            assert view["result"] == {"value": (v + 1) * 2}
    # The cancelled ones never ran: the model took only the others.
    assert (await parted.stats("adder")).get("model_items", 0) == len(ids) - len(cancelled)
    assert (await http.get("/v1/jobs/no-such-job")).status_code == 404


async def test_both_lanes_of_every_partition_are_served(parted: Harness) -> None:
    http = await parted.serve(builtins("chain"))

    async def call(v: int, lane: str) -> httpx.Response:
        return await http.post("/v1/chain", json={"value": v}, headers={PRIORITY.name: lane})

    lanes = ["interactive", "bulk"] * 15
    got = await asyncio.gather(*(call(v, lane) for v, lane in enumerate(lanes)))
    assert [r.json() for r in got] == [{"value": (v + 1) * 2} for v in range(30)]
    status: dict[str, Any] = (await http.get("/status.json")).json()
    adder = next(s for s in status["stages"] if s["stage"] == "adder")
    assert adder["lag"] == adder["pending"] == 0
    assert all(n > 0 for n in await per_partition(parted, "adder", "items:ok"))


async def test_a_namespace_of_one_partition_keeps_its_key_names(tmp_path: Path) -> None:
    del tmp_path
    one = Keys("conveyor")
    assert one.stage_stream("embed") == "{conveyor}:stage:embed"
    assert one.of("any-id") is one
    assert [k.prefix for k in Keys("conveyor", 3).each()] == [
        "{conveyor.p0}",
        "{conveyor.p1}",
        "{conveyor.p2.1}",
    ]


async def test_a_process_with_another_partition_count_refuses_to_start(
    parted: Harness, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker of two partitions among processes of three would leave a third unread.
    await parted.serve(builtins("chain"))  # records the namespace's three partitions
    monkeypatch.setenv("CONVEYOR_PARTITIONS", "2")
    stray = parted.worker(ADDER)
    with pytest.raises(ConfigError, match=r"CONVEYOR_PARTITIONS=2, but namespace .* with 3"):
        await stray.start()
    # The gateway process refuses too, saying why, instead of serving a partition short.
    gateway = conveyor("gateway", "--port", "0", CONVEYOR_NAMESPACE=namespace)
    assert gateway.returncode != 0
    assert "CONVEYOR_PARTITIONS=2, but namespace" in gateway.stderr


async def test_an_entry_answering_outside_its_partition_is_dead_lettered_not_run(
    parted: Harness,
) -> None:
    # Only a foreign writer puts such an entry on a stream; on a cluster its answer would
    # be a write to another slot, failing the whole batch's publish (and the worker).
    home = parted.keys.at(1)
    good = parted.request(
        "double", "double", "double", {"value": 1}, reply_to=home.reply_stream("t")
    )
    elsewhere = parted.keys.at(0).reply_stream("t")
    strays = [
        parted.request("double", "double", "double", {"value": 2}, reply_to=elsewhere),
        parted.request("double", "double", "double", {"value": 3}, reply_to="not:conveyors"),
    ]
    for req in (good, *strays):
        await parted.redis.xadd(home.stage_stream("double"), encode(req))
    worker = parted.worker(number_stage(), Doubler(), partition=1)
    assert await parted.run(worker, burst=True) >= 1
    entries = await parted.redis.xrange(home.reply_stream("t")) or []
    answered = [one for _, f in entries for one in decode_replies(f or {})]
    assert [(r.id, r.result) for r in answered] == [(good.id, {"value": 2})]
    assert await parted.redis.xlen(home.dead_letters("double")) == 2
    assert not await parted.redis.exists(elsewhere)
    assert not await parted.redis.exists("not:conveyors")


async def test_stream_reads_on_a_cluster_ask_no_node_where_their_keys_are(
    on_cluster: Cluster,
) -> None:
    # redis-py asks a server for the keys of XREAD/XREADGROUP (COMMAND GETKEYS, a round
    # trip to one node) before each; conveyor's client finds their slot itself.
    client = connect(CommonSettings())
    nodes = [aioredis.Redis(host="127.0.0.1", port=p) for p in on_cluster.ports]
    try:
        keys = Keys("getkeys", PARTITIONS)
        for part in keys.each():
            await ensure_group(client, part.stage_stream("s"))

        async def getkeys() -> int:
            stats = [await n.info("commandstats") for n in nodes]
            return sum(int(s.get("cmdstat_command|getkeys", {}).get("calls", 0)) for s in stats)

        before = await getkeys()
        for part in keys.each():
            stream = part.stage_stream("s")
            await client.xadd(stream, {"f": "v"})
            got = await client.xreadgroup(GROUP, "c", {stream: ">"}, count=10)
            assert got, stream
            assert await client.xread({stream: "0"}, count=10)
        assert await getkeys() == before
    finally:
        await client.aclose()
        for n in nodes:
            await n.aclose()


async def test_a_cluster_no_node_answers_is_503_not_500(harness: Harness) -> None:
    # redis-py raises a plain RedisClusterException when no node answers; conveyor reads it
    # as Redis being down, from the start on (the gateway still starts and says so).
    dead = f"redis+cluster://127.0.0.1:{free_port()}/0"
    http = await harness.gateway(builtins("chain"), redis_url=dead, redis_timeout_s=0.5)
    assert (await http.get("/readyz")).status_code == 503
    for resp in (
        await http.post("/v1/chain", json={"value": 1}),
        await http.post("/v1/jobs/chain", json={"value": 1}),
        await http.get("/v1/jobs/some-job"),
        await http.get("/status.json"),
    ):
        assert resp.status_code == 503, resp.text
        assert resp.headers["Retry-After"] == "1"


async def test_a_foreign_entry_dead_lettered_by_recovery_answers_nowhere(
    parted: Harness,
) -> None:
    # Delivered too often (its first worker died), such an entry is dead-lettered by the
    # reclaim, not by intake: that path must not answer outside the partition either.
    home = parted.keys.at(1)
    stream = home.stage_stream("double")
    elsewhere = parted.keys.at(0).reply_stream("t")
    stray = parted.request("double", "double", "double", {"value": 2}, reply_to=elsewhere)
    worker = parted.worker(
        number_stage(batch_wait_ms=0),
        Doubler(),
        partition=1,
        max_deliveries=1,
        min_idle_ms=10,
        reclaim_interval_ms=10,
    )
    await worker.start()
    await parted.redis.xadd(stream, encode(stray))
    await died_running(parted.redis, home, stream)  # then it died running it

    async def dead_lettered() -> bool:
        await worker.run(max_batches=1, burst=True)
        return bool(await parted.redis.xlen(home.dead_letters("double")) == 1)

    await until(dead_lettered)
    assert not await parted.redis.exists(elsewhere)
    assert (await parted.stats("double")).get("dead_letters") == 1


async def test_a_gateway_started_while_redis_was_down_checks_the_partition_count_later(
    own_redis: Any, harness: Harness
) -> None:
    # It could not check at start; its first request does, and a mismatch takes it out of
    # rotation (503, /readyz) instead of enqueueing into partitions nobody reads.
    stage = number_stage(batch_wait_ms=0)
    http = await gateway_while_redis_paused(harness, own_redis, [stage])
    await harness.redis.set(harness.keys.partition_count(), 5)  # the deployment runs 5
    for _ in range(2):  # found once, then remembered
        resp = await http.post("/v1/double", json={"value": 1})
        assert resp.status_code == 503, resp.text
        assert "CONVEYOR_PARTITIONS=1, but namespace" in resp.json()["detail"]
    assert (await http.get("/readyz")).status_code == 503
    assert not await harness.redis.exists(harness.keys.stage_stream("double"))
