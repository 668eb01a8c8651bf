"""Recovery's decisions: when each duty is due, what a reclaimed entry becomes (run with
its batch-mates, run alone as a suspect, or dead-lettered past the delivery cap), and
every dead letter a worker writes (past the cap, undecodable, refused by a publish).

- A worker that dies leaves its entries pending; after ``min_idle_ms`` another worker
  (or the same one, restarted) takes them back (:mod:`workers.claims`), at once where
  its death is certain (it ran on this machine: :mod:`workers.places`). Those that were
  on the model when it died are charged the crash and run alone ("suspects"); those that
  were only waiting run in an ordinary batch, uncharged. A charged batch runs again
  whole; if it crashes again, each of its entries runs alone. Where the worker can fork,
  the re-run is in a child process, halved there down to the input that kills
  (:mod:`workers.suspects`): that crash is the child's, not the worker's.
- An entry delivered more than ``max_deliveries`` times (its first read, and each crash
  it was on the model for) is dead-lettered instead of running again; its client is told
  at once. So is an entry that does not decode, and one whose publish Redis refuses.
- The stream is trimmed below the oldest entry still pending or not yet delivered.
- A gone worker's consumer (no heartbeat, nothing delivered for ``prune_gone_s``) is
  removed from the stage's groups once it holds nothing pending (:mod:`workers.prune`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

from pipelines.envelope import decode_request, sender
from pipelines.errors import EnvelopeError
from pipelines.keys import GROUP
from pipelines.outcomes import Outcome
from pipelines.records import DeadLetter
from runtime.exits import progressed
from runtime.redisio import REDIS_DOWN, RedisClock, group_missing, text
from runtime.stats import CHARGED
from workers.claims import Lease, claim_idle, deliveries, own_pending, touch, trim
from workers.places import remember, take_from_dead
from workers.prune import prune_gone
from workers.route import Router
from workers.settings import WorkerSettings
from workers.values import Claimed, Due, Entry, Letter, Outbox, Settled, by_stream

logger = logging.getLogger(__name__)


def _order(eid: bytes) -> tuple[int, int]:
    ms, _, seq = eid.decode().partition("-")
    return int(ms) if ms.isdigit() else 0, int(seq) if seq.isdigit() else 0


def letter(
    entry_id: bytes, fields: dict[bytes, bytes], deliveries: int, error: str
) -> dict[FieldT, EncodableT]:
    """A dead-letter entry: the original fields (envelope untouched, so it can be
    replayed) plus where it came from, how often it was delivered, and why it stopped."""
    out: dict[FieldT, EncodableT] = {k: v for k, v in fields.items()}
    out.update(DeadLetter(entry_id, deliveries, error).fields())
    return out


class Every:
    """A duty due every ``interval_s`` seconds (monotonic clock), the first time at once.

    Args:
        interval_s: seconds between two turns (``math.inf``: once only).
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = 0.0

    def due(self, now: float) -> bool:
        """Whether the duty is due at ``now``; if so, it is next due an interval later."""
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def again(self) -> None:
        """Due again at the next look, whatever the interval."""
        self._next = 0.0


class Recovery:
    """One worker's recovery duties (see above), each on its own schedule.

    Args:
        client: Redis client.
        streams: the stage's stream of each lane, interactive first.
        consumer: this worker's consumer name.
        settings: the worker's settings (idle time, intervals, delivery cap).
        router: answers the callers of dead-lettered entries (and names the stage).
        clock: the server's clock.
        claim_count: the most idle entries taken back at once (the stage's batch size).

    Attributes:
        dead_lettered: entries this worker has dead-lettered past the delivery cap.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        streams: Sequence[str],
        consumer: str,
        settings: WorkerSettings,
        router: Router,
        clock: RedisClock,
        claim_count: int = 64,
    ) -> None:
        self.client, self.streams, self.consumer = client, tuple(streams), consumer
        self.settings = settings
        self.router = router
        self.clock = clock
        self.dead_lettered = 0
        # The schedule: when each duty is next due.
        self._trim = Every(settings.trim_interval_s)
        self._reclaim = Every(settings.reclaim_interval_ms / 1000)
        self._own = Every(math.inf)  # this consumer's own pending: at the first reclaim only
        self._touch = Every(settings.min_idle_ms / 3000)  # the queued suspects
        self._prune = Every(min(settings.prune_gone_s / 2, 60.0))  # gone workers' consumers
        self.keys = router.keys
        self.claim_count = claim_count
        self._suspects: deque[list[Entry]] = deque()  # batches to run again, in order
        self._suspect_running = False
        self._hung: set[bytes] = set()  # ids of suspects whose batch hung (not crashed)
        self._quarantine_until = -math.inf  # batches run in a child until then (a crash)
        self._held: Counter[bytes] = Counter()  # ids the leases of this process hold now

    async def next(self) -> Due:
        """Do the duties now due: trim; remove gone workers' consumers; when no suspect
        is queued, reclaim (the first time, take back this consumer's own pending first)
        and sort out what came back (:mod:`workers.claims`). Then the next suspects, to
        run as one batch (its end reported with :meth:`suspect_done`), unless suspects
        are running: read new entries; with the entries past the delivery cap,
        dead-lettered, for the worker to publish, and the entries taken back that were
        only waiting, to run as an ordinary batch."""
        now = time.monotonic()
        if self._trim.due(now):
            for stream in self.streams:
                await trim(self.client, stream)
        if self._prune.due(now):
            gone_s = self.settings.prune_gone_s
            stage, streams = self.router.stage, self.streams
            await prune_gone(self.client, self.keys, stage, streams, self.consumer, gone_s)
        settled: Settled | None = None
        waiting: list[Entry] = []
        if not self._suspects and self._reclaim.due(now):
            claimed = Claimed()
            stage, count = self.router.stage, self.claim_count
            if self._own.due(now):
                try:
                    await remember(self.client, self.keys, stage, self.consumer)
                    for stream in self.streams:
                        claimed += await own_pending(self.client, self.keys, stream, self.consumer)
                except BaseException:
                    self._own.again()  # not done: at the next look
                    raise
            # A dead worker's entries at once, where its death is certain (workers.places).
            dead = await take_from_dead(
                self.client, self.keys, stage, self.streams, self.consumer, count
            )
            if dead:
                self._reclaim.again()  # more may be waiting
                claimed += dead
            # Interactive first, as a read takes it.
            min_idle_ms = self.settings.min_idle_ms
            for stream in self.streams:
                got = await claim_idle(
                    self.client,
                    self.keys,
                    stream,
                    self.consumer,
                    min_idle_ms,
                    self.claim_count,
                    held=self._held,
                )
                if got:
                    self._reclaim.again()  # more may be waiting
                    claimed += got
                    break
            settled, waiting = await self._screen(claimed)
        if self._suspects and self._touch.due(now):  # they must not look idle to another
            for stream, ids in by_stream(e for group in self._suspects for e in group).items():
                await touch(self.client, stream, self.consumer, ids)
        if settled is not None or waiting or not self._suspects or self._suspect_running:
            # Suspects only once the dead letters are out (were their publish to fail,
            # suspects handed out with them would never run, nor report their end) and
            # the entries taken back beside them are handed out; one batch of suspects at
            # a time, while new entries are read beside it.
            return Due((), settled, tuple(waiting))
        self._suspect_running = True
        return Due(tuple(self._suspects.popleft()), settled)

    def published(self, settled: Settled) -> None:
        """What :meth:`next` dead-lettered is published: count it."""
        self.dead_lettered += len(settled.entries)

    def quarantined(self) -> bool:
        """Whether a crash was charged within ``quarantine_s``: every batch then runs in
        a child process where one can (:mod:`workers.suspects`), so further inputs that
        crash cost a child each, not a restart of the worker."""
        return time.monotonic() < self._quarantine_until

    def from_hang(self, entries: Sequence[Entry]) -> bool:
        """Whether ``entries`` (a suspects' batch) are of a batch whose model call hung:
        a hang, unlike a crash, costs its whole bound each run, so they run apart."""
        ids = {entry.id for entry in entries}
        hung = bool(ids & self._hung)
        self._hung -= ids
        return hung

    def suspect_done(self) -> None:
        """The suspects' batch has ended: the next may run."""
        self._suspect_running = False

    def lease(self, entries: Sequence[Entry]) -> Lease:
        """Keeps a running batch's entries from being reclaimed until stopped."""
        beat_s = self.settings.min_idle_ms / 3000  # well inside the idle time that reclaims
        # With the suspects queued to run alone after it: they are this worker's too.
        held = by_stream([*entries, *(e for group in self._suspects for e in group)])
        return Lease(self.client, held, self.consumer, beat_s, self._held)

    def unreadable(
        self, out: Outbox, eid: bytes, fields: dict[bytes, bytes], exc: EnvelopeError
    ) -> tuple[Letter, bool]:
        """The dead letter of an entry that does not decode, answered in ``out`` if it
        says who sent it; and whether it was answered."""
        stage = self.router.stage
        who = sender(fields)
        message = (
            f"stage {stage!r} could not decode this request ({exc}); it was "
            f"dead-lettered: `conveyor dlq list {stage}`"
        )
        request = who.id if who else "unknown"
        logger.error("stage %s: entry %r dead-lettered, request %s: %s", stage, eid, request, exc)
        answered = who is not None and self.router.fail_unreadable(out, who, message)
        return self._letter(eid, fields, 1, message), answered

    async def leave(self) -> None:
        """After a drain, leave each lane stream's group where this consumer holds
        nothing pending there."""
        for stream in self.streams:
            try:
                mine = await self.client.xpending_range(
                    stream, GROUP, min="-", max="+", count=1, consumername=self.consumer
                )
                if not mine:
                    await self.client.xgroup_delconsumer(stream, GROUP, self.consumer)
            except REDIS_DOWN as exc:
                logger.warning("stage %s: could not leave the group: %s", self.router.stage, exc)
                return
            except ResponseError as exc:
                if not group_missing(exc):  # no group: nothing to leave
                    raise

    async def _screen(self, claimed: Claimed) -> tuple[Settled | None, list[Entry]]:
        """Queue the charged and queued entries to run again (:meth:`_rerun`); those past
        the delivery cap, dead-lettered, are returned to publish, with the entries that
        were only waiting."""
        if not claimed:
            return None, []
        entries = claimed.suspects + claimed.waiting
        counts: dict[tuple[str, bytes], int] = {}
        for stream, ids in by_stream(entries).items():
            got = await deliveries(self.client, stream, self.consumer, ids)
            counts.update(((stream, eid), n) for eid, n in got.items())
        if claimed.charged:
            progressed()  # their crash is on its way to a dead letter: no loop
            self._quarantine_until = time.monotonic() + self.settings.quarantine_s
            stats = self.keys.stage_stats(self.router.stage)
            try:
                await self.client.hincrby(stats, CHARGED, len(claimed.charged))
            except ResponseError as exc:  # a stats key forged to another type: a count lost
                logger.error("stage %s: crash charges not counted: %s", self.router.stage, exc)
            logger.warning(
                "stage %s: %d entr(ies) were on the model when their worker died; they run "
                "again as their batch, and each alone if it crashes again (where a fork "
                "is safe, in child processes, as is every batch for the next %g s)",
                self.router.stage,
                len(claimed.charged),
                self.settings.quarantine_s,
            )
        late, groups = self._rerun(claimed, counts)
        self._suspects += groups
        cap = self.settings.max_deliveries
        late += [e for e in claimed.waiting if counts.get((e.stream, e.id), 1) > cap]
        settled = self._dead_letter(late, counts, claimed.hung) if late else None
        return settled, [e for e in claimed.waiting if e not in late]

    def _rerun(
        self, claimed: Claimed, counts: dict[tuple[str, bytes], int]
    ) -> tuple[list[Entry], list[list[Entry]]]:
        """The charged and queued entries past the delivery cap (to dead-letter), and the
        batches the others run again in: after a batch's first crash, the batch again,
        whole (unless one more crash would put it past the cap); after a second, each
        entry alone. A crash that was no input's doing (kill -9, the OOM killer, a
        drain) thus costs the batch one re-run at batch speed, and an input that kills
        is alone after one more crash.

        A batch whose model call hung (its worker said so as it ended) runs again in
        halves, whatever the cap: the input that hangs is found by bisection, and alone
        it is dead-lettered at once, never run again."""
        cap = self.settings.max_deliveries
        by_batch: dict[tuple[int, bytes], list[Entry]] = {}
        late: list[Entry] = []
        for entry in claimed.suspects:
            size, token = claimed.crashed_in.get(entry.id, (1, b""))
            hung = entry.id in claimed.hung
            if (size == 1 and hung) or (not hung and counts.get((entry.stream, entry.id), 1) > cap):
                late.append(entry)
            else:
                by_batch.setdefault((size, token or entry.id), []).append(entry)
        groups: list[list[Entry]] = []
        for (size, _), mates in by_batch.items():
            times = max(counts.get((e.stream, e.id), 1) for e in mates)
            if mates[0].id in claimed.hung:
                part = max(1, math.ceil(size / 2))
                self._hung.update(e.id for e in mates)
            else:  # whole once, if one more crash leaves them within the cap; then alone
                part = size if times <= 2 and times < cap else 1
            mates.sort(key=lambda e: _order(e.id))
            groups += [mates[i : i + part] for i in range(0, len(mates), part)]
        return late, groups

    def _dead_letter(
        self,
        entries: list[Entry],
        counts: dict[tuple[str, bytes], int],
        hung: set[bytes] | frozenset[bytes] = frozenset(),
    ) -> Settled:
        stage = self.router.stage
        out = Outbox()
        now = self.clock.now()
        letters: list[Letter] = []
        for eid, fields, stream in entries:
            times = counts.get((stream, eid), 0)
            if eid in hung:
                why = "its model call did not return within the stage's max_call_s"
            else:
                why = f"dead-lettered after {times} deliveries (it may crash the worker)"
            message = f"{why}; inspect with `conveyor dlq list {stage}`"
            letters.append(self._letter(eid, fields, times, message))
            try:
                self._answer(out, fields, message, now, 504 if eid in hung else 500)
            except Exception:
                # The letter is kept whatever its entry holds: an answer that cannot be
                # built (a bug past the envelope's checks) must not leave a poison entry
                # to kill every worker that reclaims it.
                logger.exception("stage %s: entry %r dead-lettered unanswered", stage, eid)
        return Settled(out, entries, {"dead_letters": len(entries)}, letters)

    def _answer(
        self, out: Outbox, fields: dict[bytes, bytes], message: str, now: float, status: int
    ) -> None:
        """Tell a dead letter's caller, where its entry names a reply address of ours."""
        try:
            req = decode_request(fields)
        except EnvelopeError:
            req = None
        if req is None or not self.router.keys.is_reply_target(req.reply_to):
            # Undecodable, or answering outside this partition (intake would not run
            # it either): its caller is told only where the entry's word is safe.
            who = sender(fields)
            if who is not None:
                self.router.fail_unreadable(out, who, message)
            return
        self.router.fail(out, req, Outcome.ERROR, message, status=status, now=now)
        logger.error("stage %s: request %s dead-lettered: %s", self.router.stage, req.id, message)

    def _letter(self, eid: bytes, fields: dict[bytes, bytes], times: int, error: str) -> Letter:
        return self.router.keys.dead_letters(self.router.stage), letter(eid, fields, times, error)

    def set_aside(
        self,
        out: Outbox,
        entries: Sequence[Entry],
        refused: Mapping[str, tuple[str, str]],
        letters: Sequence[Letter],
    ) -> tuple[list[Letter], list[str]]:
        """Requests a publish refused (a key of theirs holds another type: the call wrote
        nothing) are dead-lettered, so their batch-mates publish without them: their
        effects are taken out of ``out`` (in place), each caller answered instead where
        its reply address is a safe one (of this namespace, and not a refused key).

        Args:
                out: the batch's outbox.
            entries: the batch's entries (each refused request's entries are found by its
                "done" marker).
            refused: (key, its type) by "done" marker, as :class:`~workers.publish.Published`
                says.
            letters: the dead letters the batch already adds (an entry among them is not
                added twice).

        Returns:
            The dead letters to add, and the markers (``Keys.dropped``) of the refused
            requests left unanswered, each to count one error.
        """
        router = self.router
        keys, stage = router.keys, router.stage
        refused_keys = {key for key, _ in refused.values()}
        lettered = {text(fields.get(DeadLetter.ENTRY, b"")) for _, fields in letters}
        by_marker: dict[str, list[Entry]] = {}
        for entry in entries:
            who = sender(entry.fields)
            if who is not None:
                by_marker.setdefault(keys.done(who.id, who.step), []).append(entry)
        added: list[Letter] = []
        dropped: list[str] = []
        for marker, (key, kind) in refused.items():
            del out.effects[marker]
            message = (
                f"its result could not be published: Redis key {key!r} holds a {kind}, not "
                f"what stage {stage!r} writes there; dead-lettered: `conveyor dlq list {stage}`"
            )
            culprits = by_marker.get(marker, [])
            logger.error(
                "stage %s: %d entr%s dead-lettered (%s): %s",
                stage,
                len(culprits),
                "y" if len(culprits) == 1 else "ies",
                marker,
                message,
            )
            if not culprits:
                continue
            who = sender(culprits[0].fields)
            if (
                who is None
                or who.reply_to in refused_keys
                or not router.fail_unreadable(out, who, message)
            ):
                dropped.append(keys.dropped(stage, text(culprits[0].id)))
            for entry in culprits:
                if text(entry.id) not in lettered:
                    fields = letter(entry.id, entry.fields, 1, message)
                    added.append((keys.dead_letters(stage), fields))
        return added, dropped
