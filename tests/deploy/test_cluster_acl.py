"""The shipped ACL rules on a real Redis Cluster: the gateway and the workers, each as its
own user, serve a join pipeline over three partitions with no denial, and KEDA's user reads
every partition's streams (issue 17)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from conveyor.embedded import Cluster, cluster
from pipelines.builtin import builtin_pipelines
from pipelines.keys import GROUP, LANES, Keys
from pipelines.registry import Registry
from pipelines.settings import CommonSettings
from runtime.redisio import connect
from tests.deploy.test_deploy import DUMMY_ENV, KEDA_PASSWORD, render_acl
from tests.helpers import Harness

PARTITIONS = 3


@pytest.fixture
def acl_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of its own whose nodes have the shipped users (the default user stays on:
    it is this test's admin)."""
    rules = [
        line.split()[1:]
        for line in render_acl(tmp_path / "users.acl").splitlines()
        if line.startswith("user ") and line.split()[1] != "default"
    ]
    with cluster(tmp_path / "cluster") as nodes:
        for port in nodes.ports:
            with redis.Redis(port=port) as node:
                for name, *rule in rules:
                    node.acl_setuser(name, reset=False)  # created, then its rules applied
                    node.execute_command("ACL", "SETUSER", name, *rule)
                node.acl_log_reset()
        yield nodes


def url(nodes: Cluster, user: str, password: str) -> str:
    return f"redis+cluster://{user}:{password}@127.0.0.1:{nodes.ports[0]}/0"


def denials(nodes: Cluster) -> list[str]:
    """Every node's ACL refusals but CLIENT SETINFO (refused by design, ignored by redis-py)."""
    found = []
    for port in nodes.ports:
        with redis.Redis(port=port) as node:
            found += [
                f"{port} {e['username']}: {e['reason']} {e['object']}"
                for e in node.acl_log()
                if e["object"] != "client|setinfo"
            ]
    return found


async def test_the_shipped_users_serve_a_partitioned_deployment_on_a_cluster(
    acl_cluster: Cluster, monkeypatch: pytest.MonkeyPatch, env: None
) -> None:
    monkeypatch.setenv("CONVEYOR_NAMESPACE", "conveyor")  # the namespace the rules name
    monkeypatch.setenv("CONVEYOR_PARTITIONS", str(PARTITIONS))
    worker_url = url(acl_cluster, "worker", DUMMY_ENV["REDIS_WORKER_PASSWORD"])
    monkeypatch.setenv("CONVEYOR_REDIS_URL", worker_url)  # what the workers read
    admin = connect(CommonSettings(redis_url=f"redis+cluster://127.0.0.1:{acl_cluster.ports[0]}"))
    harness = Harness(admin)
    try:
        registry = Registry(builtin_pipelines()).select(["broadcast", "chain"])
        await harness.start_workers(registry)
        gateway_url = url(acl_cluster, "gateway", DUMMY_ENV["REDIS_GATEWAY_PASSWORD"])
        http = await harness.gateway(registry, redis_url=gateway_url)
        fanned = await asyncio.gather(
            *(http.post("/v1/broadcast", json={"value": v}) for v in range(12))
        )
        assert [r.json() for r in fanned] == [
            {"results": [{"value": v + 1}, {"value": v * 2}]} for v in range(12)
        ], denials(acl_cluster)
        job = (await http.post("/v1/jobs/chain", json={"value": 1})).json()["id"]
        assert (await http.delete(f"/v1/jobs/{job}")).status_code == 200
        assert (await http.get("/status.json")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
    finally:
        await harness.close()
        await admin.aclose()
    # KEDA's user reads every partition's lag and pending, and may do nothing else.
    keda = RedisCluster.from_url(url(acl_cluster, "keda", KEDA_PASSWORD).replace("+cluster", ""))
    try:
        for part in Keys("conveyor", PARTITIONS).each():
            for lane in LANES:
                stream = part.stage_stream("adder", lane)
                assert await keda.xlen(stream) >= 0
                assert any(g["name"] == GROUP.encode() for g in await keda.xinfo_groups(stream))
                await keda.xpending(stream, GROUP)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await keda.xadd(Keys("conveyor", PARTITIONS).at(1).stage_stream("adder"), {"x": 1})
    finally:
        await keda.aclose()
    refused = [d for d in denials(acl_cluster) if "keda: command xadd" not in d]
    assert not refused, refused
