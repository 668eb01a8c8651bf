"""Removing gone workers' consumers from a stage's groups, so that a stage scaled out and
back in does not list its departed workers in ``conveyor status`` and ``/status`` forever.

A consumer is gone when no heartbeat of it is live (:class:`workers.alive.Presence`) and
Redis has delivered it nothing for ``CONVEYOR_PRUNE_GONE_S``; it is removed only once it
holds nothing pending (its entries are first taken back by recovery, once idle:
:mod:`workers.claims`), checked and removed in one script (``prune.lua``), since
``XGROUP DELCONSUMER`` drops a consumer's pending entries with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import GROUP, Keys
from runtime.redisio import group_missing, text
from runtime.status import live_workers

logger = logging.getLogger(__name__)

PRUNE_SCRIPT = resources.files("workers").joinpath("prune.lua").read_text()


async def prune_gone(
    client: aioredis.Redis,
    keys: Keys,
    stage: str,
    streams: Sequence[str],
    consumer: str,
    gone_s: float,
) -> list[str]:
    """Remove from each of ``streams``' groups the consumers gone for ``gone_s`` that hold
    nothing pending there; the names removed (once per stream it was removed from). A
    stream Redis refuses to read (a key of another type) is skipped with a warning.

    Args:
        client: Redis client.
        keys: key names (the heartbeats' hash).
        stage: the stage.
        streams: the stage's stream of each lane.
        consumer: this worker's consumer name (never removed).
        gone_s: how long a consumer without a live heartbeat must have had nothing
            delivered (Redis's idle time) to be removed.
    """
    live = await live_workers(client, keys, stage)
    removed: list[str] = []
    for stream in streams:
        try:
            removed += await _prune_stream(client, stream, consumer, live, gone_s)
        except ResponseError as exc:
            if group_missing(exc):  # not created yet, or lost: nothing to prune
                continue
            # Hygiene only: a stream forged to another type must not stop the work.
            logger.warning("stage %s: could not prune %s: %s", stage, stream, exc)
    if removed:
        logger.info(
            "stage %s: removed %d gone worker(s) from its groups (no heartbeat, nothing "
            "delivered for %gs): %s",
            stage,
            len(removed),
            gone_s,
            ", ".join(sorted(set(removed))),
        )
    return removed


async def _prune_stream(
    client: aioredis.Redis, stream: str, consumer: str, live: set[str], gone_s: float
) -> list[str]:
    """Remove the gone consumers holding nothing of one stream's group; their names."""
    removed: list[str] = []
    for member in await client.xinfo_consumers(stream, GROUP):
        name = text(member["name"])
        if name == consumer or name in live or int(member["pending"]) > 0:
            continue
        if int(member["idle"]) < gone_s * 1000:
            continue
        if await client.eval(PRUNE_SCRIPT, 1, stream, GROUP, name):
            removed.append(name)
    return removed
