"""The lanes' one-round-trip look under a lost group (workers/lanes.py): a lane whose
group is gone fails the read as a lone read would, and what the other lane's read in the
same round trip delivered to this consumer is not stranded in its pending list. Real Redis."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.envelope import decode_request
from pipelines.keys import Lane
from runtime.redisio import group_missing
from tests.helpers import Doubler, Harness, number_stage
from tests.workers.test_lanes import send, streams


@pytest.mark.parametrize("lost", ["interactive", "bulk"])
async def test_a_lost_group_in_the_look_strands_nothing_the_other_lane_delivered(
    harness: Harness, redis: aioredis.Redis, lost: Lane
) -> None:
    stage = number_stage(max_batch_size=4)
    worker = harness.worker(stage, Doubler(), bulk_every=4)  # room 3, reserve 1
    await worker.parts.source.ensure_stream()
    await send(harness, "interactive", [100, 101])
    await send(harness, "bulk", [1, 2, 3])
    await redis.delete(streams(harness)[lost])  # its group is gone with it
    lanes = worker.parts.lanes
    with pytest.raises(ResponseError) as raised:
        await lanes.read(4, None)
    assert group_missing(raised.value)  # as a lone read says it: the worker re-creates
    await worker.parts.source.ensure_stream()
    got = [decode_request(e.fields).payload["value"] for e in await lanes.read(4, None)]
    # What the other lane's read delivered before the refusal is handed out now, not
    # left pending on this consumer until a reclaim long after.
    if lost == "bulk":
        assert got == [100, 101]
    else:
        assert got == [1, 2, 3]


async def test_entries_carried_over_survive_a_look_that_fails(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # A blocking read over both lanes may deliver more than a batch takes: the rest is
    # carried to the next read. Should that read's look fail (a lost group), what it had
    # taken from the carry is still handed out by the read after, first.
    stage = number_stage(max_batch_size=4)
    worker = harness.worker(stage, Doubler(), bulk_every=4)
    await worker.parts.source.ensure_stream()
    await send(harness, "interactive", [100, 101])
    await send(harness, "bulk", [1, 2])
    lanes = worker.parts.lanes
    lanes._empty = True  # as after an empty look: the next read waits over both lanes
    first = await lanes.read(2, 1000)  # two of each stream delivered, two carried
    assert len(first) == 2
    assert len(lanes._carry) == 2
    carried = [e.id for e in lanes._carry]
    await redis.delete(streams(harness)["bulk"])
    with pytest.raises(ResponseError):
        await lanes.read(4, None)
    await worker.parts.source.ensure_stream()
    again = await lanes.read(4, None)
    assert [e.id for e in again][:2] == carried
