"""Admission's view of a stage: refreshed off the request path, refusals on fresh data."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.admission import Admission
from pipelines.errors import Overloaded
from tests.helpers import Harness


async def test_a_refusal_is_decided_on_a_fresh_view(
    harness: Harness, redis: aioredis.Redis
) -> None:
    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await harness.enqueue("double", [{"value": i} for i in range(3)])
    with pytest.raises(Overloaded, match="capacity"):
        await admission.admit("double", 3, 30.0, 8)
    # The backlog drains; the view that refused is stale, but it does not refuse again.
    await redis.delete(harness.keys.stage_stream("double"))
    await admission.admit("double", 3, 30.0, 8)


async def test_admitted_requests_do_not_wait_for_a_refresh(
    harness: Harness, redis: aioredis.Redis
) -> None:
    admission = Admission(redis, harness.keys, refresh_s=0.0, retry_after_s=1)
    await admission.admit("double", 3, 30.0, 8)  # the first view is measured at once
    await redis.client_pause(1500)  # Redis stops answering for 1.5 s
    # Stale, and the refresh cannot finish before the pause ends; the request is decided
    # on the view it has, which admits it.
    await asyncio.wait_for(admission.admit("double", 3, 30.0, 8), timeout=1.0)
    # The refresh it started lands once Redis answers (joined here), and counts both
    # admitted requests as already on the books: only later ones are added to its backlog.
    view = await admission.refresh("double")
    assert (view.backlog, view.counted) == (0, 2)
