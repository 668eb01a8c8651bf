"""A worker process serves every partition of its stage (issue 17): one batch loop per
partition, one model, loaded once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pipelines.model import Item, Result
from pipelines.stages import Stage
from tests.helpers import NumberIn
from workers.partitions import partition_workers
from workers.settings import WorkerSettings


class Counted:
    """Doubles values; counts how often it was built (slowly, so loads would overlap)."""

    built = 0

    def __init__(self, **options: Any) -> None:
        del options
        time.sleep(0.3)  # a model takes a while to load: the other partitions arrive meanwhile
        Counted.built += 1

    def predict(self, items: list[Item]) -> list[Result]:
        """Double."""
        return [{"value": item["value"] * 2} for item in items]


COUNTED = Stage("counted", NumberIn, "tests.workers.test_partition_workers:Counted")


@pytest.mark.usefixtures("env")
async def test_a_stages_partitions_share_one_model_built_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONVEYOR_PARTITIONS", "3")
    Counted.built = 0
    workers = partition_workers(COUNTED, WorkerSettings(block_ms=100))
    try:
        await asyncio.gather(*(w.start() for w in workers))  # as python -m workers does
        assert Counted.built == 1
        assert all(w.runner is workers[0].runner for w in workers)
        assert [w.parts.keys.partition for w in workers] == [0, 1, 2]
        assert len({s for w in workers for s in w.streams}) == 3 * len(workers[0].streams)
        assert {w.consumer for w in workers} == {workers[0].consumer}  # one worker to see
        # The process's batches in flight are shared out, not multiplied by the partitions.
        assert [w.settings.max_concurrent_batches for w in workers] == [1, 1, 1]
    finally:
        for w in workers:
            await w.close()


@pytest.mark.usefixtures("env")
@pytest.mark.parametrize(("partitions", "batches", "share"), [(1, 2, 2), (3, 8, 3), (4, 8, 2)])
def test_batches_in_flight_are_shared_out_among_partitions(
    partitions: int, batches: int, share: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_PARTITIONS", str(partitions))
    settings = WorkerSettings(max_concurrent_batches=batches)
    workers = partition_workers(COUNTED, settings)
    assert [w.settings.max_concurrent_batches for w in workers] == [share] * partitions
