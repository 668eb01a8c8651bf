"""Streaming: partial output from the model thread to the clients that asked for it."""

from __future__ import annotations

import asyncio
import logging
import operator
import time

import redis.asyncio as aioredis

from pipelines.envelope import Reply, Request, encode
from pipelines.keys import Keys
from runtime.jobs import cancelled_among
from runtime.redisio import REDIS_DOWN
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.25
"""While partials flow, a batch asks this often (one MGET) which of its streaming requests
are cancelled; a cancelled one gets no more partials. Per batch, never per token."""


class Partials:
    """Forwards streamed output from the model thread to the clients that asked for it.

    Args:
        client: Redis client.
        requests: the batch's live requests, in model order.
        settings: the worker's settings (reply stream cap).
        loop: the worker's event loop.
        keys: the partition's key names (where its cancellation markers are).

    ``emit`` runs in the model thread and hands over to the event loop; a drain task
    writes only what each client has not seen yet (a retried batch re-emits from the
    start; each partial says where its text starts, so the gateway drops what another
    worker's attempt already streamed). Partials are best effort and outside the batch's
    transaction: the final reply, published with the ack, is what counts. A request
    cancelled while the batch runs stops getting partials once the drain has seen its
    marker (:data:`CANCEL_CHECK_S`; the batch's intake had just looked).

    Attributes:
        cancelled: per row, whether its request was found cancelled.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        requests: list[Request],
        settings: WorkerSettings,
        loop: asyncio.AbstractEventLoop,
        keys: Keys,
    ) -> None:
        self.client = client
        self.keys = keys
        self.requests = requests
        self.settings = settings
        self.loop = loop
        self.wanted = any(r.stream for r in requests)
        self.sent = [0] * len(requests)
        self.latest = [""] * len(requests)  # each row's text, as last emitted
        self.cancelled = [False] * len(requests)
        self._checked_at = time.monotonic()
        self.queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        self.task = loop.create_task(self._drain()) if self.wanted else None

    def emit(self, index: int, text: str) -> None:
        """Called from the model thread: row ``index`` now reads ``text``.

        Raises:
            TypeError, IndexError: the model passed something else; raised in its own
                call (whose failure the worker isolates), not later in the drain.
        """
        if not isinstance(text, str):
            raise TypeError(f"emit(index, text): text is {type(text).__name__}, not str")
        index = operator.index(index)  # an int, or what stands for one (numpy's)
        if not 0 <= index < len(self.requests):
            raise IndexError(f"emit: row {index} of a batch of {len(self.requests)}")
        if self.requests[index].stream and not self.cancelled[index]:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, text))

    async def close(self) -> None:
        """Wait until everything emitted so far is written (what a Redis outage kept
        back is tried once more here)."""
        if self.task is not None:
            self.queue.put_nowait(None)
            await self.task
            behind = [(i, t) for i, t in enumerate(self.latest) if len(t) > self.sent[i]]
            if behind:
                await self._write(behind)

    async def _drain(self) -> None:
        finished = False
        while not finished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            await self._check_cancelled()
            updates = []
            for update in batch:
                if update is None:
                    finished = True
                else:
                    self.latest[update[0]] = update[1]
                    updates.append(update)
            await self._write(updates)

    async def _write(self, updates: list[tuple[int, str]]) -> None:
        """Write each row's text past what its client has: one pipeline. Should Redis be
        unreachable, nothing counts as sent, so the next write carries it too."""
        pipe = self.client.pipeline(transaction=False)
        before = list(self.sent)
        for index, text in updates:
            if self.cancelled[index]:
                continue
            at = self.sent[index]
            delta = text[at:]
            if not delta:
                continue
            self.sent[index] = len(text)
            req = self.requests[index]
            partial = Reply(
                id=req.id,
                stage=req.stage,
                outcome="partial",
                # Where it starts in the text: a worker that takes over a request
                # re-emits from the start, and the gateway skips what it has sent.
                result={"text": delta, "at": at},
                trace_id=req.trace_id,
            )
            maxlen = self.settings.reply_maxlen
            pipe.xadd(req.reply_to, encode(partial), maxlen=maxlen, approximate=True)
        try:
            written = await pipe.execute(raise_on_error=False)
        except REDIS_DOWN as exc:
            self.sent = before
            logger.warning("could not stream partial output: %s", exc)
            return
        # One reply key refusing its XADD (it holds another type: something else SET
        # it) loses that request's partials only; its final reply is the publish's.
        for failure in {str(w) for w in written if isinstance(w, Exception)}:
            logger.warning("could not stream partial output: %s", failure)

    async def _check_cancelled(self) -> None:
        """Mark the streaming rows whose requests are cancelled, if it is time to ask."""
        now = time.monotonic()
        if now - self._checked_at < CANCEL_CHECK_S:
            return
        self._checked_at = now
        rows = [i for i, r in enumerate(self.requests) if r.stream and not self.cancelled[i]]
        ids = [self.requests[i].id for i in rows]
        try:
            found = await cancelled_among(self.client, self.keys, ids)
        except REDIS_DOWN as exc:
            logger.warning("could not check for cancelled requests: %s", exc)
            return
        for i in rows:
            self.cancelled[i] = self.requests[i].id in found
