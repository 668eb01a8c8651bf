"""One loop per gateway process reads its reply stream and resolves waiting futures.

No connection is held per waiting request and nothing polls: the loop blocks on
XREAD of this process's own reply streams (one per partition) and wakes each waiter by
request id. On a Redis Cluster one XREAD cannot span slots, so each partition's stream
has a reading loop of its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import redis.asyncio as aioredis

from pipelines import tracing
from pipelines.envelope import Reply, decode_reply
from pipelines.errors import EnvelopeError
from pipelines.redisio import REDIS_DOWN, Backoff, entry_ms

logger = logging.getLogger(__name__)


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
        self.written: dict[str, float] = {}

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
            if response:
                # Let the woken handlers answer their clients before the next read is
                # sent: the read can wait, a client is waiting.
                await asyncio.sleep(0)

    def _dispatch(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            reply = decode_reply(fields)
        except EnvelopeError as exc:
            logger.warning("ignoring reply entry %r: %s", entry_id, exc)
            return
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
