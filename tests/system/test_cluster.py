"""Redis Cluster (issue 17): the cluster the tests run against forms and spreads slots."""

from __future__ import annotations

from pathlib import Path

from redis.asyncio.cluster import RedisCluster

from conveyor.embedded import cluster


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
