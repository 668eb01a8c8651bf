"""Streaming: partial output from the model thread to the clients that asked for it."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from pipelines.envelope import Reply, Request, encode
from pipelines.redisio import REDIS_DOWN
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)


class Partials:
    """Forwards streamed output from the model thread to the clients that asked for it.

    Args:
        client: Redis client.
        requests: the batch's live requests, in model order.
        settings: the worker's settings (reply stream cap).
        loop: the worker's event loop.

    ``emit`` runs in the model thread and hands over to the event loop; a drain task
    writes only what each client has not seen yet (a retried batch re-emits from the
    start). Partials are best effort and outside the batch's transaction: the final
    reply, published with the ack, is what counts.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        requests: list[Request],
        settings: WorkerSettings,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.client = client
        self.requests = requests
        self.settings = settings
        self.loop = loop
        self.wanted = any(r.stream for r in requests)
        self.sent = [0] * len(requests)
        self.queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        self.task = loop.create_task(self._drain()) if self.wanted else None

    def emit(self, index: int, text: str) -> None:
        """Called from the model thread: row ``index`` now reads ``text``."""
        if self.requests[index].stream:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, text))

    async def close(self) -> None:
        """Wait until everything emitted so far is written."""
        if self.task is not None:
            self.queue.put_nowait(None)
            await self.task

    async def _drain(self) -> None:
        finished = False
        while not finished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            pipe = self.client.pipeline(transaction=False)
            for update in batch:
                if update is None:
                    finished = True
                    continue
                index, text = update
                delta = text[self.sent[index] :]
                if not delta:
                    continue
                self.sent[index] = len(text)
                req = self.requests[index]
                partial = Reply(
                    id=req.id,
                    stage=req.stage,
                    outcome="partial",
                    result={"text": delta},
                    trace_id=req.trace_id,
                )
                maxlen = self.settings.reply_maxlen
                pipe.xadd(req.reply_to, encode(partial), maxlen=maxlen, approximate=True)
            try:
                await pipe.execute()
            except REDIS_DOWN as exc:
                logger.warning("could not stream partial output: %s", exc)
