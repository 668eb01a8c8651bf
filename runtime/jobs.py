"""The Redis commands of a request's job record and cancellation marker.

A job's record is created here, with its request, in the gateway's transaction
(:func:`create_job`; its fields are :mod:`pipelines.records`'); a request is cancelled by
its marker (:func:`mark_cancelled`), which every step checks before it starts a request
(:func:`cancelled_among`) and the publish script checks before it publishes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from pipelines.envelope import Request
from pipelines.keys import Keys
from pipelines.outcomes import QUEUED
from pipelines.records import JobField, job_created

CANCEL_GRACE_S = 120
"""A cancellation marker outlives its request's deadline by this long: past anything a
worker could still start or publish for it."""


def create_job(pipe: aioredis.Redis, request: Request, owner: str, ttl_s: int) -> None:
    """Queue on ``pipe`` the commands that create the record of the job ``request`` runs
    (at its ``reply_to``), ``queued``; ``pipe`` is a MULTI that also enqueues the request,
    so a job id handed out always exists.

    The status is set only where there is none: a repeated write (a retry after a lost
    answer) must not turn a job a worker has finished since back to queued.

    Args:
        pipe: the transaction to add the commands to.
        request: the job's request.
        owner: who submits the job (the API key's identity).
        ttl_s: how long the record is kept.
    """
    pipe.hsetnx(request.reply_to, JobField.STATUS, QUEUED)
    pipe.hset(request.reply_to, mapping=job_created(request, owner))
    pipe.expire(request.reply_to, ttl_s)


def mark_cancelled(
    redis: aioredis.Redis | aioredis.client.Pipeline,
    keys: Keys,
    request_id: str,
    deadline: float,
    now: float,
) -> Any:
    """Set ``request_id``'s cancellation marker (``Keys.cancelled``): from when Redis has
    it, no step starts the request, and no finished batch publishes its output. It lasts
    until the request's ``deadline`` (Redis clock, as is ``now``) has long passed.

    Args:
        redis: a client (the command is returned, to be awaited), or a pipeline.
        keys: the namespace's key names.
        request_id: the request.
        deadline: its deadline.
        now: the time now.
    """
    ttl_s = max(1, int(deadline - now)) + CANCEL_GRACE_S
    return redis.set(keys.cancelled(request_id), "1", ex=ttl_s)


async def cancelled_among(
    client: aioredis.Redis, keys: Keys, request_ids: Sequence[str]
) -> set[str]:
    """Which of ``request_ids`` are cancelled: one MGET (nothing sent for none)."""
    if not request_ids:
        return set()
    found = await client.mget([keys.cancelled(rid) for rid in request_ids])
    return {rid for rid, mark in zip(request_ids, found, strict=True) if mark is not None}
