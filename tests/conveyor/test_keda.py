"""``conveyor keda STAGE``: the KEDA triggers of a stage, every lane and partition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from conveyor.keda import TriggerOptions, triggers
from pipelines.keys import LANES, Keys
from tests.helpers import REPO, conveyor


def scaled_object_triggers(path: Path) -> list[dict[str, Any]]:
    """The triggers of the ScaledObject in a manifest."""
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "ScaledObject":
            found: list[dict[str, Any]] = doc["spec"]["triggers"]
            return found
    raise AssertionError(f"no ScaledObject in {path}")


def test_one_partition_gives_the_shipped_manifests_triggers() -> None:
    # The manifests are written for one partition: the command prints exactly their list.
    options = TriggerOptions("redis.conveyor.svc.cluster.local:6379", 64)
    for stage in ("embed", "sentiment"):
        printed = yaml.safe_load(triggers(Keys("conveyor"), stage, options))
        shipped = scaled_object_triggers(REPO / "deploy" / "k8s" / "stages" / f"{stage}.yaml")
        assert printed == shipped


def test_every_lane_of_every_partition_is_watched_on_a_cluster() -> None:
    keys = Keys("prod", 3)
    options = TriggerOptions("redis-0:6379,redis-1:6379", 64, cluster=True)
    printed: list[dict[str, Any]] = yaml.safe_load(triggers(keys, "embed", options))
    assert len(printed) == 2 * len(LANES) * 3
    assert len({t["name"] for t in printed}) == len(printed)
    assert {t["type"] for t in printed} == {"redis-cluster-streams"}
    streams = {part.stage_stream("embed", lane) for part in keys.each() for lane in LANES}
    lag = [t["metadata"] for t in printed if "lagCount" in t["metadata"]]
    pending = [t["metadata"] for t in printed if "pendingEntriesCount" in t["metadata"]]
    assert {m["stream"] for m in lag} == {m["stream"] for m in pending} == streams
    # The HPA takes the largest trigger: each partition's lag target is a third of the
    # stage's; a worker holds entries of every partition at once, so pending's stays whole.
    assert {m["lagCount"] for m in lag} == {"22"}
    assert {m["pendingEntriesCount"] for m in pending} == {"64"}
    assert {m["addresses"] for m in lag} == {"redis-0:6379,redis-1:6379"}


def test_the_command_reads_the_deployments_settings() -> None:
    done = conveyor(
        "keda",
        "ner",
        "--target",
        "32",
        CONVEYOR_NAMESPACE="prod",
        CONVEYOR_PARTITIONS="2",
        CONVEYOR_REDIS_URL="redis+cluster://redis-0:6379",
    )
    assert done.returncode == 0, done.stderr
    printed: list[dict[str, Any]] = yaml.safe_load(done.stdout)
    assert {t["metadata"]["stream"] for t in printed} == {
        part.stage_stream("ner", lane) for part in Keys("prod", 2).each() for lane in LANES
    }
    assert {t["metadata"].get("lagCount", "16") for t in printed} == {"16"}
    assert {t["metadata"].get("pendingEntriesCount", "32") for t in printed} == {"32"}
