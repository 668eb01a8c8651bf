"""What a batch runs: its entries decoded, and each request admitted or ended at once.

An entry that does not decode is dead-lettered and its caller told; one written after its
gateway refused it is dropped (as its id tells: an id ahead of the clock tells no time);
the same request twice in one batch runs once; a request past its deadline, or whose
input is invalid, is answered without running; so is one cancelled by the time the model
is free for its batch (:meth:`Intake.withdraw_cancelled`, one round trip per batch). What is
left are the batch's live items, in entry order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.cluster import RedisCluster

from pipelines.envelope import Request, decode_request
from pipelines.errors import EnvelopeError
from pipelines.model import Item
from pipelines.outcomes import Outcome
from pipelines.stages import Stage
from runtime.jobs import cancelled_among
from runtime.packing import pipelined
from runtime.redisio import REDIS_DOWN, IdsAhead, arrival, on_live_connection, written_at
from workers import claims
from workers.route import LATE_S, Router
from workers.values import Batch, BatchRecord, Entry, Letter, Outbox

Unreadable = Callable[[Outbox, bytes, dict[bytes, bytes], EnvelopeError], tuple[Letter, bool]]
"""Dead-letters an entry that does not decode, answering its caller in the outbox where
it can (recovery's decision); returns the letter and whether it was answered."""

logger = logging.getLogger(__name__)


class Intake:
    """Opens batches for one stage.

    Args:
        client: Redis client (asks which requests are cancelled).
        stage: the stage served (its input model).
        router: ends the requests that do not run.
        unreadable: dead-letters the entries that do not decode.
    """

    def __init__(
        self, client: aioredis.Redis, stage: Stage, router: Router, unreadable: Unreadable
    ) -> None:
        self.client = client
        self.stage = stage
        self.router = router
        self.unreadable = unreadable
        self.one_slot_mget = not isinstance(client, RedisCluster)
        self.ahead = IdsAhead(f"stage {stage.name}")

    def open(self, entries: list[Entry], now: float) -> Batch:
        """The batch of ``entries``, closed at ``now``: its live items, and the outbox
        entries of those that end here."""
        keys = self.router.keys
        for entry in entries:
            self.ahead.check(entry.stream, entry.id, now)
        oldest_ms = int(arrival(entries[0].id, now) * 1000)
        record = BatchRecord(size=len(entries), oldest_ms=oldest_ms, closed_at=now)
        batch = Batch(entries, record, [now - arrival(e.id, now) for e in entries], Outbox())
        seen: set[str] = set()
        for eid, fields, _ in entries:
            try:
                req = decode_request(fields)
                if not keys.is_reply_target(req.reply_to):
                    # Only a foreign writer names another address: answering there would
                    # write outside this partition (another slot on a cluster, where the
                    # batch's publish would fail whole).
                    raise EnvelopeError(f"reply_to {req.reply_to!r} is not of {keys.prefix}")
            except EnvelopeError as exc:
                # The gateway sends nothing a worker cannot decode (envelope.wire_problem):
                # this entry is foreign, corrupted or from another version. Acknowledged so
                # it cannot poison the stage, kept as a dead letter, and its caller told.
                letter, answered = self.unreadable(batch.out, eid, fields, exc)
                batch.letters.append(letter)
                if not answered:  # an answered one counts its error with its reply
                    batch.dropped.append(keys.dropped(self.stage.name, eid.decode()))
                continue
            written = written_at(eid, now)
            if req.enqueue_by is not None and written is not None and written > req.enqueue_by:
                # Written after its gateway gave up on the write (Redis stalled) and told
                # the client 503: running it would answer a request the client may resend.
                # Only an id that is a write time says so: one ahead of the clock (a
                # forged future id before it in the stream) says nothing of the kind.
                logger.warning(
                    "stage %s: request %s arrived after its gateway refused it; dropped",
                    self.stage.name,
                    req.id,
                )
                continue
            marker = keys.done(req.id, req.step)
            if marker in seen:
                # The same request twice in one batch (an enqueue retried after a lost
                # answer): one run, one answer; the copy is only acknowledged.
                continue
            seen.add(marker)
            record.request_ids.append(req.id)
            record.trace_ids.append(req.trace_id)
            record.arrivals.append(arrival(eid, now))
            item = self._admit(batch.out, req, now)
            if item is not None:
                batch.live.append((req, item))
        return batch

    async def withdraw_cancelled(self, batch: Batch, now: float, *, mark: bool = False) -> None:
        """End the batch's live requests that are cancelled by ``now`` as ``cancelled``
        (:meth:`Router.cancel`), so the model never runs them: one round trip
        (:meth:`cancelled`), none for a batch with nothing live."""
        found = await self.cancelled(batch.entries, [req.id for req, _ in batch.live], mark=mark)
        if not found:
            return
        for req, _ in batch.live:
            if req.id in found:
                self.router.cancel(batch.out, req, now)
        batch.live = [(req, item) for req, item in batch.live if req.id not in found]

    async def cancelled(self, entries: list[Entry], ids: list[str], *, mark: bool) -> set[str]:
        """Which of the requests ``ids`` are cancelled: one MGET; with ``mark``, in the
        same round trip, ``entries`` are marked on the model (:mod:`workers.claims`: what
        a crash from here on is charged to). Empty when Redis cannot say (logged)."""
        if not ids:
            return set()
        keys = self.router.keys

        async def ask() -> set[str]:
            if not mark:
                return await cancelled_among(self.client, keys, ids)
            commands = claims.mark(keys, entries)
            queued = len(commands)
            markers = [keys.cancelled(rid) for rid in ids]
            if self.one_slot_mget:
                commands.append(["MGET", *markers])
            else:  # a GET each: a cluster client's pipeline takes no MGET
                commands += (["GET", marker] for marker in markers)
            found = (await pipelined(self.client, commands, raise_on_error=True))[queued:]
            if self.one_slot_mget:
                found = found[0]
            return {rid for rid, m in zip(ids, found, strict=True) if m is not None}

        # The batch's first command since it was read: after a restart of Redis it may
        # meet a dead pooled connection, which must not leave the batch to a reclaim.
        try:
            return await on_live_connection(self.client, ask)
        except REDIS_DOWN as exc:
            # Only a saving: the publish checks each request's cancellation atomically
            # anyway, and a batch dropped here would wait for a reclaim. (Unmarked, a
            # crash while it runs is charged to nobody: its entries are reclaimed as
            # waiting ones, and the delivery cap does not count it.)
            logger.warning("stage %s: cancellations unread (%s)", self.stage.name, exc)
            return set()

    def _admit(self, out: Outbox, req: Request, now: float) -> Item | None:
        """The item to run for ``req``, or None when it ends here (expired, invalid)."""
        if req.deadline <= now:
            if now <= req.deadline + LATE_S:  # later, its marker may be gone: say nothing
                self.router.fail(
                    out,
                    req,
                    Outcome.EXPIRED,
                    "deadline passed before the step ran",
                    status=504,
                    now=now,
                )
            return None
        try:
            pipeline, step = self.router.locate(req)
            payload = pipeline.input_of(step, req.state, None) if step.join else req.payload
            item: Item = self.stage.input_model.model_validate(payload).model_dump(mode="json")
        except ValidationError as exc:
            where = f"step {req.step!r} of {req.pipeline!r}"
            message = f"invalid input for {where}: {exc.error_count()} error(s)"
            self.router.fail(out, req, Outcome.ERROR, message, status=422, now=now)
            return None
        except BaseException as exc:  # unknown pipeline/step, or user code (a join's
            # input function, the input model's validators) raised, SystemExit included
            self.router.fail_with(out, req, exc, now)
            return None
        return item
