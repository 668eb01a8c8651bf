"""Redis Cluster (issue 17): the cluster the tests run against forms and spreads slots."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ResponseError

from conveyor.embedded import cluster
from pipelines.settings import CommonSettings
from runtime.redisio import REDIS_DOWN, RedisRefused, connect
from tests.helpers import until


async def test_a_real_three_node_cluster_serves_every_slot(tmp_path: Path) -> None:
    with cluster(tmp_path) as nodes:
        client = RedisCluster.from_url(nodes.url)
        try:
            # Keys of different hash tags land on different nodes; all are served.
            for tag in range(12):
                await client.set(f"{{p{tag}}}:k", tag)
            owners = {str(client.get_node_from_key(f"{{p{tag}}}:k")) for tag in range(12)}
            assert len(owners) == 3
            values = [await client.get(f"{{p{tag}}}:k") for tag in range(12)]
            assert values == [str(tag).encode() for tag in range(12)]
        finally:
            await client.aclose()


async def test_a_node_down_even_the_clients_default_one_leaves_the_others_served(
    tmp_path: Path,
) -> None:
    # Issue 23, break 9. The node killed is the one redis-py 8.1 fetched its command table
    # from at every refresh of its slot map (the default node); a pipeline failing on it
    # closed every node's connections and had every later command on every node fail, until
    # it came back. The other nodes' slots must stay served, by commands and pipelines, and
    # a command in flight on one of them must not fail with the node that went down.
    with cluster(tmp_path) as nodes:
        settings = CommonSettings(redis_url=nodes.url.replace("redis://", "redis+cluster://"))
        client = connect(settings, block_ms=5000)
        try:
            await client.ping()
            rc = cast(RedisCluster, client)  # for the node lookups
            victim = rc.get_default_node()
            owner: dict[str, ClusterNode] = {}
            for tag in range(12):
                node = rc.get_node_from_key(f"{{p{tag}}}:s")
                assert node is not None
                owner.setdefault(f"{{p{tag}}}:s", node)
            dead = next(k for k, n in owner.items() if n == victim)
            live = {n.name: k for k, n in owner.items() if n != victim}
            assert len(live) == 2
            # A blocking read on a healthy node, in flight while the other node fails.
            key = next(iter(live.values()))
            reading = asyncio.create_task(_read_one(client, key))
            reader = owner[key]
            await until(lambda: _blocked(int(reader.port)), limit_s=10)
            nodes.kill(int(victim.port))
            for _ in range(3):  # a pipeline, then a plain command, to the node that is down
                pipe = client.pipeline(transaction=False)
                pipe.xadd(dead, {"v": 1})
                with pytest.raises(REDIS_DOWN):
                    await pipe.execute()
                with pytest.raises(REDIS_DOWN):
                    await client.xadd(dead, {"v": 1})
            for key in live.values():  # the healthy nodes answer both
                assert await client.xadd(key, {"v": 2})
                pipe = client.pipeline(transaction=False)
                pipe.xadd(key, {"v": 3})
                assert all(await pipe.execute())
            assert await client.ping()  # a keyless command finds a live node
            assert await asyncio.wait_for(reading, 10) == {b"v": b"2"}
        finally:
            await client.aclose()


async def _read_one(client: aioredis.Redis, stream: str) -> dict[bytes, bytes]:
    """The fields of the next entry added to ``stream`` (a blocking read, up to 5 s)."""
    read: Any = await client.xread({stream: "$"}, block=5000)
    assert read, "nothing read"
    return cast(dict[bytes, bytes], read[0][1][0][1])


async def _blocked(port: int) -> bool:
    """Whether the node on ``port`` holds a client blocked in a read."""
    direct = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        return int((await direct.info("clients"))["blocked_clients"]) > 0
    finally:
        await direct.aclose()


async def test_a_busy_node_is_a_refusal_to_wait_out_on_a_cluster_too(tmp_path: Path) -> None:
    # Issue 23, break 2, on a cluster: the refusals are classified where a reply is parsed,
    # and the cluster client takes no parser of its own: each node's connections must.
    with cluster(tmp_path) as nodes:
        settings = CommonSettings(redis_url=nodes.url.replace("redis://", "redis+cluster://"))
        client = connect(settings)
        try:
            await client.set("{p0}:k", 1)
            node = cast(RedisCluster, client).get_node_from_key("{p0}:k")
            assert node is not None
            admin = aioredis.Redis(port=int(node.port))
            killer = aioredis.Redis(port=int(node.port))
            await admin.config_set("busy-reply-threshold", 50)
            await killer.ping()  # connected before: a new connection's handshake is refused

            async def spin() -> object:
                return await admin.eval("while true do end", 0)

            busy = asyncio.create_task(spin())
            try:
                refused = await _first_refusal(client, "{p0}:k")
                assert isinstance(refused, RedisRefused), repr(refused)
            finally:
                await killer.script_kill()
                with pytest.raises(ResponseError):
                    await busy
                await admin.aclose()
                await killer.aclose()
            assert await client.get("{p0}:k") == b"1"
        finally:
            await client.aclose()


async def _first_refusal(client: aioredis.Redis, key: str) -> BaseException | None:
    """The first error a read of ``key`` meets, within about 4 s (None: none)."""
    for _ in range(200):  # until the script has run past the threshold
        try:
            await client.get(key)
        except REDIS_DOWN as exc:
            return exc
        await asyncio.sleep(0.02)
    return None
