"""Continuous batching: the loop of a stage whose model decodes step by step, on the same
parts as the batch loop (:class:`~workers.parts.Parts`).

A static batch generates up to its longest request while every other row waits, and a
request that arrives meanwhile waits for the whole batch. Here the batch is the set of
generations in flight (at most the stage's max batch size), and it changes between
decoding steps (:class:`~workers.models.decoder.Decoder`):

- while the model runs a slice of steps (one call, until a generation ends or a request
  comes), the loop looks for what came (XREADGROUP, COUNT = the free slots, without
  blocking, every :data:`POLL_S`; blocking only when nothing runs), interactive lane
  first, and opens it (:class:`~workers.intake.Intake`: decoded, admitted, invalid ones
  answered);
- after the step, the new requests are prefilled and join, in arrival order, as long as
  the token budget holds; the rest wait for a slot;
- a generation that ends (its ``max_new_tokens``, an end-of-sequence token) is published
  with its ack at once (one publish call per step for all that ended); one cancelled or
  past its deadline leaves at the next check (every :data:`CHECK_S`) and frees its slot;
- each new token reaches a streaming client as it is made (:class:`~workers.partials.Partials`).

Delivery is as for batches: an entry is marked on the model when it joins
(:mod:`workers.claims`) and acknowledged when published; a running entry is touched so
it is not reclaimed (its lease); a worker that dies mid-way has its entries reclaimed
and generated again from the start (reclaimed suspects run by themselves); a streaming
client sees each piece of text once (partials carry their offset and the gateway skips
what it already sent). Prompt starts are reused (``decode_prefix_cache_tokens``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from pipelines.envelope import Request
from pipelines.errors import DeadlineExceeded
from runtime.jobs import cancelled_among
from runtime.redisio import REDIS_DOWN
from workers.claims import Lease
from workers.modelthread import Hung
from workers.partials import Partials
from workers.parts import Parts
from workers.values import Batch, Entry

if TYPE_CHECKING:  # torch is the model's import, not every worker's
    from workers.models.decoder import Decoder, Generation

logger = logging.getLogger(__name__)

CHECK_S = 0.1
"""How often the running generations are checked for cancellation (one MGET) and expiry."""
SLICE_S = 0.05
"""The most decoding steps one model-thread call runs, in seconds: it returns sooner when
a generation ends or a request comes to join (a hop to the model thread took 0.35-0.7 ms
on a loaded 2-core box, against a tiny-GPT-2 step of a few ms)."""
POLL_S = 0.002
"""How often the loop looks for new requests while the model decodes a slice, at most;
nor more often than a step takes or the stage's batch window (what a static batch waits
too): each look costs the event loop CPU the model could have."""


@dataclass(eq=False)
class Flight:
    """One request in the decoding loop, from its read to its publish.

    Attributes:
        batch: the batch of its one entry (what it publishes with its ack).
        request: the request.
        generation: its generation.
        lease: keeps its entry claimed while it runs.
        partials: streams its text (None: it did not ask).
        interactive: read from the interactive lane (joins before bulk).
    """

    batch: Batch
    request: Request
    generation: Generation
    lease: Lease
    partials: Partials | None
    interactive: bool


class Decoding:
    """The loop of a worker whose model decodes continuously.

    Args:
        parts: the worker's parts; this loop runs in place of its batch loop.
        decoder: the model's running batch.
    """

    def __init__(self, parts: Parts, decoder: Decoder) -> None:
        self.parts, self.decoder = parts, decoder
        decoder.share_prefixes(parts.settings.decode_prefix_cache_tokens)
        self.name = parts.stage.name
        self.slots = parts.window.max_batch
        self.waiting: deque[Flight] = deque()  # read, not yet joined (no room)
        self.running: dict[int, Flight] = {}  # by id() of its generation
        self.suspects: list[Flight] = []  # reclaimed from a crash: they run by themselves
        self._checked = 0.0
        self._device_s = 0.0  # model time since the last publish (charged to it)
        self._stop = threading.Event()  # set: the model thread ends its slice of steps
        self._step_s = 0.0  # the last slice's time a step
        self._arrived = -1.0  # time.monotonic() of the last read that got entries
        self._together = False  # it got several, or came within a window of the one before

    async def serve(self, stopping: asyncio.Event, max_batches: int | None, burst: bool) -> int:
        """Serve until ``stopping`` is set (or ``max_batches`` publishes, or, with
        ``burst``, nothing is left), with the worker's presence beating; returns the
        number of publishes. What it has read runs to its end before it returns; once
        stopped, it leaves its group."""
        parts = self.parts
        logger.info(
            "stage %s: continuous decoding, up to %d sequences and %d cache positions",
            self.name,
            self.slots,
            self.decoder.budget,
        )
        parts.presence.start()
        try:
            published = await self._serve(stopping, max_batches, burst)
        except Hung as hung:  # the model thread is lost: the process ends now
            hung.exit()
        finally:
            # Whatever ends the loop, no flight's lease or stream is left running.
            for flight in [*self.running.values(), *self.waiting]:
                await flight.lease.stop()
                if flight.partials is not None:
                    await flight.partials.close()
            await parts.flush(bounded=True)
            await parts.presence.stop(leave=stopping.is_set() or burst)
            parts.summary.tick(last=True)
        if stopping.is_set():
            await parts.recovery.leave()
        return published

    async def _serve(self, stopping: asyncio.Event, max_batches: int | None, burst: bool) -> int:
        parts, published = self.parts, 0
        while True:
            parts.alive.beat()
            parts.summary.tick()
            idle = not self.running and not self.waiting
            enough = max_batches is not None and published >= max_batches
            reading = not stopping.is_set() and not enough
            if not reading and idle:
                break
            # The step runs in the model thread while this one reads what came.
            stepping = asyncio.ensure_future(self._advance()) if self.running else None
            came, arriving = True, False
            try:
                if self._reading(reading):
                    block = parts.settings.block_ms if idle and not burst else None
                    came = arriving = await self._read(self._free(), block)
                    # While the slice runs: a look every poll_s; one that finds some ends it.
                    while stepping is not None and not arriving and self._reading(reading):
                        poll_s = max(POLL_S, parts.window.wait_s, self._step_s)
                        if (await asyncio.wait({stepping}, timeout=poll_s))[0]:
                            break
                        came = arriving = await self._read(self._free(), None)
                    if arriving:
                        self._stop.set()
            finally:
                ended = await stepping if stepping is not None else []
            if arriving and stepping is not None and self._together:
                await self._burst(reading)
            if idle and not came:
                await parts.flush()  # idle: what the batches counted goes out
            if idle and burst and not came and not self.waiting:
                break
            ended += await self._admit()
            ended += await self._check()
            if ended:
                await self._publish(ended)
                published += 1
        return published

    # -- reading -------------------------------------------------------------------

    def _free(self) -> int:
        """Slots neither running nor promised to a waiting request."""
        return self.slots - len(self.running) - len(self.waiting)

    def _reading(self, reading: bool) -> bool:
        """Whether to read now: still serving, no suspect running alone, a slot free."""
        return reading and not self.suspects and self._free() > 0

    async def _burst(self, reading: bool) -> None:
        """Requests came together while the step ran (several in one read, or within a
        window of the read before): clients that sent together may still be arriving.
        Read on while they come, for at most the stage's batch window in all (it does
        not restart with each arrival), so that they join in one prefill, one forward
        for all, instead of one prefill each step. The running generations wait that
        long at most, and only when a burst comes: a lone arrival (low load) joins at
        once, neither it nor the running ones waiting out a window for nobody."""
        close_at = time.monotonic() + self.parts.window.wait_s
        while self._reading(reading):
            left_ms = int((close_at - time.monotonic()) * 1000)
            # A BLOCK of 0 would wait for ever: a window closed is a non-blocking look.
            if not await self._read(self._free(), left_ms if left_ms > 0 else None):
                return
            if left_ms <= 0:
                return

    async def _read(self, free: int, block_ms: int | None) -> bool:
        """Read and open up to ``free`` entries (reclaimed ones first); whether any came."""
        parts = self.parts
        try:
            due = await parts.recovery.next()
            if due.settled is not None:  # dead letters: answered, acked, kept
                await parts.settle(due.settled)
            if due.suspects:
                # A crash of their last worker may be theirs: they run by themselves.
                await self._open(list(due.suspects), suspect=True)
                return True
            if due.waiting:  # taken back, not on the model when their worker died
                entries = list(due.waiting)
            else:
                held = [*self.running.values(), *self.waiting]
                interactive = sum(f.interactive for f in held)
                parts.lanes.seated(interactive, len(held) - interactive)
                entries = await parts.lanes.read(free, block_ms)
            # What a blocking read delivered past its count (one COUNT per lane) is
            # opened now too: it waits for a slot with its entry touched, not untouched.
            entries += parts.lanes.release()
        except (*REDIS_DOWN, ResponseError) as exc:
            await parts.source.failed(exc)  # waited out, or the group made again
            return False
        if entries:
            now = time.monotonic()
            self._together = len(entries) > 1 or now - self._arrived < parts.window.wait_s
            self._arrived = now
            await self._open(entries, suspect=False)
        return bool(entries)

    async def _open(self, entries: list[Entry], *, suspect: bool) -> None:
        """Each entry as its own batch: decoded and admitted; what ends here (invalid,
        expired, unreadable) is published now, the rest wait to join."""
        parts = self.parts
        now = parts.clock.now()
        ended: list[Batch] = []
        for entry in entries:
            batch = parts.intake.open([entry], now)
            if not batch.live:
                ended.append(batch)
                continue
            ((request, item),) = batch.live
            opened = self.decoder.open([item], [request.id])[0]
            if isinstance(opened, BaseException):  # refused: its answer goes now
                batch.live = []
                parts.router.route(batch.out, request, opened, now)
                ended.append(batch)
                continue
            loop = asyncio.get_running_loop()
            partials = None
            if request.stream:
                partials = Partials(parts.client, [request], parts.settings, loop, parts.keys)
            flight = Flight(
                batch,
                request,
                opened,
                parts.recovery.lease([entry]),
                partials,
                entry.stream == parts.lanes.interactive,
            )
            self.waiting.append(flight)
            if suspect:
                self.suspects.append(flight)
        for batch in ended:
            await self._send(batch)
        if suspect and not self.suspects:  # they ended here: recovery goes on
            parts.recovery.suspect_done()

    # -- the model -----------------------------------------------------------------

    async def _advance(self) -> list[Flight]:
        """Decoding steps of every running generation, in the model thread, until one
        ends, a request comes to join or :data:`SLICE_S` has passed; each step's text
        streamed from there."""
        started = time.monotonic()
        flights = list(self.running.values())
        self._stop.clear()
        try:
            ended = await self.parts.runner.in_model(
                "step",
                len(flights),
                self._deadline(flights),
                self.decoder.steps,
                self._stop,
                SLICE_S,
                lambda: self._stream(flights),
            )
        except Exception as exc:  # the model failed the step (OOM, a bad kernel)
            # One forward ran them all: they fail together, and the batch starts afresh.
            logger.exception("stage %s: a decoding step failed", self.name)
            await self._leave([f.generation for f in flights])
            return self._failed(flights, exc)
        finally:
            self._device_s += time.monotonic() - started
        self._step_s = (time.monotonic() - started) / max(1, self.decoder.stepped)
        return [self.running.pop(id(generation)) for generation in ended]

    async def _admit(self) -> list[Flight]:
        """Prefill the waiting requests that fit (interactive first, then in arrival
        order) and add them to the running batch; those that ended at once are returned."""
        if not self.waiting:
            return []
        if self.suspects:
            # Suspects join an empty batch, and nothing joins them.
            ordered = [] if self.running else list(self.suspects)
        else:
            ordered = sorted(self.waiting, key=lambda f: not f.interactive)  # stable
        joining: list[Flight] = []
        for flight in ordered:
            if len(self.running) + len(joining) >= self.slots:
                break
            if not self.decoder.fits(flight.generation, [f.generation for f in joining]):
                break  # in order: a long request is not overtaken for good
            joining.append(flight)
        if not joining:
            return []  # room comes as the running ones end (open() refused what never fits)
        for flight in joining:
            self.waiting.remove(flight)
        # Marked on the model, and asked whether they were cancelled while they waited, in
        # one round trip: one cancelled by now never runs (the static batch's promise);
        # the check every CHECK_S would catch it only after its prefill.
        parts, now = self.parts, self.parts.clock.now()
        cancelled = await parts.intake.cancelled(
            [flight.batch.entries[0] for flight in joining],
            [flight.request.id for flight in joining],
            mark=True,
        )
        withdrawn = [flight for flight in joining if flight.request.id in cancelled]
        for flight in withdrawn:
            parts.router.cancel(flight.batch.out, flight.request, now)
            flight.batch.live = []  # answered here, not from its result
        joining = [flight for flight in joining if flight.request.id not in cancelled]
        if not joining:
            return withdrawn
        for flight in joining:
            self.running[id(flight.generation)] = flight
        started = time.monotonic()
        generations = [flight.generation for flight in joining]
        deadline = self._deadline(joining)
        try:
            ended = await self.parts.runner.in_model(
                "prefill", len(joining), deadline, self.decoder.prefill, generations
            )
        except Exception as exc:  # the batch is as it was: only these fail
            logger.exception("stage %s: a prefill failed", self.name)
            return withdrawn + self._failed(joining, exc)
        finally:
            self._device_s += time.monotonic() - started
        self._stream(joining)
        return withdrawn + [self.running.pop(id(generation)) for generation in ended]

    def _failed(self, flights: list[Flight], exc: Exception) -> list[Flight]:
        """``flights`` end with ``exc`` (answered as a failed step), out of the batch."""
        for flight in flights:
            self.running.pop(id(flight.generation), None)
            flight.batch.live, flight.batch.results = [], [exc]
        return flights

    async def _leave(self, generations: list[Generation]) -> None:
        """Take ``generations`` out of the running batch, in the model thread."""
        if generations:
            size, deadline = len(generations), time.monotonic()
            await self.parts.runner.in_model(
                "leave", size, deadline, self.decoder.leave, generations
            )

    def _stream(self, flights: Iterable[Flight]) -> None:
        """Hand each streaming flight's text so far to its partials."""
        for flight in flights:
            if flight.partials is not None and flight.generation.ids:
                flight.partials.emit(0, self.decoder.text(flight.generation))

    async def _check(self) -> list[Flight]:
        """Take out the running and waiting requests that are cancelled or past their
        deadline (every :data:`CHECK_S`); they end as such."""
        started = time.monotonic()
        if started - self._checked < CHECK_S:
            return []
        self._checked = started
        flights = [*self.running.values(), *self.waiting]
        if not flights:
            return []
        parts = self.parts
        now = parts.clock.now()
        try:
            ids = [f.request.id for f in flights]
            cancelled = await cancelled_among(parts.client, parts.keys, ids)
        except REDIS_DOWN as exc:  # the publish checks each request's marker anyway
            logger.warning("stage %s: cancellations unread (%s)", parts.stage.name, exc)
            cancelled = set()
        leaving = []
        for flight in flights:
            if flight.request.id in cancelled:
                parts.router.cancel(flight.batch.out, flight.request, now)
            elif flight.request.deadline <= now:
                when = "while generating" if flight.generation.ids else "before it could start"
                flight.batch.results = [DeadlineExceeded(f"deadline passed {when}")]
            else:
                continue
            leaving.append(flight)
            flight.batch.live = []  # answered here, not from its result
        await self._leave([f.generation for f in leaving if id(f.generation) in self.running])
        for flight in leaving:
            self.running.pop(id(flight.generation), None)
            if flight in self.waiting:
                self.waiting.remove(flight)
        return leaving

    # -- publishing ----------------------------------------------------------------

    async def _publish(self, flights: list[Flight]) -> None:
        """Publish the flights that ended, each with its ack, in one call."""
        parts = self.parts
        now = parts.clock.now()
        for flight in flights:
            await flight.lease.stop()
            if flight.partials is not None:
                await flight.partials.close()  # every partial is out before the answer
            batch = flight.batch
            if batch.live:
                result = self.decoder.result(flight.generation)
                parts.router.route(batch.out, flight.request, result, now)
            elif batch.results:  # expired, or the model failed it
                parts.router.route(batch.out, flight.request, batch.results[0], now)
            batch.record.generated = len(flight.generation.ids)
            batch.record.run_s = self._device_s / len(flights)
            batch.record.ran_at = now
            if flight in self.suspects:
                self.suspects.remove(flight)
                if not self.suspects:
                    parts.recovery.suspect_done()
        self._device_s = 0.0
        await self._send(*[flight.batch for flight in flights])

    async def _send(self, *batches: Batch) -> None:
        """Publish ``batches`` and ack their entries in one call, count and log them."""
        await self.parts.send(batches)

    def _deadline(self, flights: Iterable[Flight]) -> float:
        """``time.monotonic()`` of the latest deadline among ``flights``' requests."""
        return self.parts.deadline(f.request for f in flights)
