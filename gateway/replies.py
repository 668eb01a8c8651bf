"""One loop per gateway process reads its reply stream and resolves waiting futures.

No connection is held per waiting request and nothing polls: the loop blocks on
XREAD of this process's own reply streams (one per partition) and wakes each waiter by
request id. On a Redis Cluster one XREAD cannot span slots, so each partition's stream
has a reading loop of its own.

A reply stream holds only what its gateway has not read yet, and fewer than
:data:`TRIM_EVERY` entries (each one or more replies) it has read: once they are
dispatched, the stream is trimmed behind them (``XTRIM MINID``, one command per
stream, so one slot each). XTRIM rather than XDEL of the ids read: the reader is the
stream's only one and reads in id order, so all below the last id read is read; one
short command frees any number of whole nodes (XDEL seeks each id: about 3x slower for
1,024 ids of 7.4 KB, 10x for small ones), it removes unreadable entries too, and a trim
that fails is made good by the next one, with nothing to remember. What outlives a dead
gateway is bounded by its stream's TTL (``CONVEYOR_REPLY_TTL_S``, renewed by each reply
written) and by the count cap workers write with (``CONVEYOR_REPLY_MAXLEN``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import redis.asyncio as aioredis

from pipelines.envelope import Reply, decode_reply, replier, reply_values
from pipelines.errors import BadReply, EnvelopeError
from pipelines.outcomes import Outcome
from runtime import tracing
from runtime.redisio import REDIS_DOWN, entry_ms
from runtime.waiting import Backoff

logger = logging.getLogger(__name__)

TRIM_EVERY = 64
"""Under load, a reply stream is trimmed once this many entries (each holding one reply or
a batch's) have been read since its last trim, and whenever a read finds nothing new: read
entries it still holds are fewer."""


class Abandoned(Exception):
    """The gateway stopped waiting for this reply: it is stopping
    (:meth:`ReplyDispatcher.abandon`)."""


class ReplyDispatcher:
    """Routes replies to the requests waiting for them.

    Args:
        client: a client whose socket timeout exceeds ``block_ms``.
        streams: this gateway's reply streams, one per partition.
        block_ms: how long one XREAD blocks.
        per_slot: read each stream on its own (a cluster client), not all in one XREAD.

    Attributes:
        written: with tracing on, when each reply handed to a waiter was written (Redis
            clock, seconds), until the waiter takes it (:meth:`Gateway.call`).
    """

    def __init__(
        self, client: aioredis.Redis, streams: list[str], block_ms: int, *, per_slot: bool = False
    ) -> None:
        self.client = client
        self.streams = streams
        self.block_ms = block_ms
        self.per_slot = per_slot
        self._waiters: dict[str, asyncio.Future[Reply]] = {}
        self._streams: dict[str, asyncio.Queue[Reply]] = {}
        self._last_ids = dict.fromkeys(streams, "0-0")
        self._stopping = False
        self._trim_failing = False
        self._untrimmed = dict.fromkeys(streams, 0)  # entries read since the last trim
        self.written: dict[str, float] = {}
        self._emptied: asyncio.Event | None = None  # set once none waits (settled())

    def expect(self, request_id: str) -> asyncio.Future[Reply]:
        """A future the reply for ``request_id`` will resolve; register before sending."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        return future

    def expect_stream(self, request_id: str) -> asyncio.Queue[Reply]:
        """A queue that receives every reply for ``request_id``: partials, then the last."""
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def forget(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` (answered, timed out or abandoned)."""
        self._waiters.pop(request_id, None)
        self._streams.pop(request_id, None)
        if self.written:
            self.written.pop(request_id, None)
        if self._emptied is not None and not self.waiting:
            self._emptied.set()

    @property
    def waiting(self) -> int:
        """Requests waiting for a reply now (sync calls and streams)."""
        return len(self._waiters) + len(self._streams)

    async def settled(self) -> None:
        """Return once no request waits for a reply (at once if none does now)."""
        if self.waiting:
            self._emptied = asyncio.Event()
            await self._emptied.wait()

    def abandon(self, reason: str) -> int:
        """Stop waiting for every reply awaited now: a sync call's future fails with
        :class:`Abandoned` (``reason``), a stream gets a last ``expired`` reply (504,
        ``reason``). The gateway's drain ran out; the requests' own deadlines may be later.

        Args:
            reason: the client-safe message they are answered with.

        Returns:
            How many were waiting.
        """
        waiting = [f for f in self._waiters.values() if not f.done()]
        for future in waiting:
            future.set_exception(Abandoned(reason))
        for request_id, queue in self._streams.items():
            expired = Outcome.EXPIRED
            reply = Reply(
                id=request_id, stage="", outcome=expired, error=reason, status=expired.http_status
            )
            queue.put_nowait(reply)
        return len(waiting) + len(self._streams)

    def stop(self) -> None:
        """Ask :meth:`run` to return after its current read (at most ``block_ms``).

        Cancelling a blocked XREAD instead can leave redis-py's connection handling
        waiting forever, so the loop is asked, not cancelled.
        """
        self._stopping = True

    async def run(self) -> None:
        """Read and dispatch until stopped; Redis outages are waited out."""
        if not self.per_slot:
            await self._read(self.streams)
            return
        readers = [asyncio.create_task(self._read([s])) for s in self.streams]
        try:
            await asyncio.gather(*readers)
        finally:  # one failing stops the rest (the gateway logs it)
            self._stopping = True
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read(self, streams: list[str]) -> None:
        backoff = Backoff()
        while not self._stopping:
            try:
                response = await self.client.xread(
                    {s: self._last_ids[s] for s in streams}, count=1024, block=self.block_ms
                )
                backoff.reset()
            except REDIS_DOWN as exc:
                logger.warning("reply stream unreachable (%s); retry in %.1fs", exc, backoff.next_s)
                await backoff.wait()
                continue
            except Exception:
                # Not an outage the client library names: still no reason to stop reading
                # (every call waiting on this gateway would time out); said loudly.
                logger.exception("reply read failed; retry in %.1fs", backoff.next_s)
                await backoff.wait()
                continue
            for stream, entries in cast(list[Any], response or []):
                name = stream.decode() if isinstance(stream, bytes) else stream
                for entry_id, fields in entries:
                    self._last_ids[name] = entry_id.decode()
                    self._dispatch(entry_id, fields)
                self._untrimmed[name] += len(entries)
            if response:
                # Let the woken handlers answer their clients before the next read is
                # sent: the read can wait, a client is waiting.
                await asyncio.sleep(0)
            # Under load, a trim per TRIM_EVERY entries, not per read (a read often
            # brings one or two: a command each would cost the gateway ~20% of its
            # calls/s); when a read comes back empty, whatever is left.
            due = [s for s in streams if self._untrimmed[s] >= (TRIM_EVERY if response else 1)]
            if due:
                await self._trim(due)

    async def _trim(self, streams: list[str]) -> None:
        """Remove every reply of ``streams`` up to the last one read (all dispatched).

        A failure (Redis down or refusing, an ACL without XTRIM) costs only memory until
        the next trim, which covers this one's entries too: it is logged once.
        """
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xtrim(stream, minid=_after(self._last_ids[stream]), approximate=False)
        try:
            await pipe.execute()
        except Exception as exc:  # never a reason to stop reading (RedisError, mostly)
            if not self._trim_failing:  # once per spell: every read would say it again
                logger.warning("could not trim read replies (%r); they stay until it can", exc)
            self._trim_failing = True
            return
        for stream in streams:
            self._untrimmed[stream] = 0
        if self._trim_failing:
            logger.info("trimming read replies again")
        self._trim_failing = False

    def _dispatch(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        values = reply_values(fields)
        if not values:
            logger.warning("ignoring reply entry %r: it holds no reply", entry_id)
        for raw in values:
            try:
                reply = decode_reply(raw)
            except EnvelopeError as exc:
                answer = _unreadable(entry_id, raw, exc)
                if answer is None:
                    continue
                reply = answer
            self._deliver(entry_id, reply)

    def _deliver(self, entry_id: bytes, reply: Reply) -> None:
        queue = self._streams.get(reply.id)
        if queue is not None:
            queue.put_nowait(reply)
            return
        if reply.outcome == "partial":
            return  # streamed output for a request that is not streaming (or gone)
        future = self._waiters.pop(reply.id, None)
        if future is not None and not future.done():
            if tracing.STATE.enabled:  # when it was written: the trace's "reply" span
                self.written[reply.id] = entry_ms(entry_id) / 1000.0
            future.set_result(reply)


def _unreadable(entry_id: bytes, raw: bytes, exc: EnvelopeError) -> Reply | None:
    """The 502 that answers the request a reply that does not validate was for (forged,
    or from an incompatible worker), when its id can still be read; else None (nobody to
    answer: its request, if any, ends at its deadline)."""
    who = replier(raw)
    if who is None:
        logger.warning("ignoring a reply in entry %r, no request id in it: %s", entry_id, exc)
        return None
    rid, stage = who
    logger.warning(
        "a reply in entry %r for request %s is invalid, answered 502: %s", entry_id, rid, exc
    )
    return Reply(
        id=rid,
        stage=stage,
        outcome=Outcome.ERROR,
        error="its reply could not be read",
        status=BadReply.status,
    )


def _after(entry_id: str) -> str:
    """The least stream id above ``entry_id`` (XTRIM MINID keeps ids >= its argument)."""
    ms, seq = entry_id.split("-")
    if int(seq) == 2**64 - 1:
        return f"{int(ms) + 1}-0"
    return f"{ms}-{int(seq) + 1}"
