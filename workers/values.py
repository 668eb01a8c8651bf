"""What flows through a worker: entries, a batch and its record, the outbox of effects a
batch publishes, dead letters, what recovery hands out, what a run and a publish returned,
and the hooks a run calls at its turn. Values only: nothing here imports ``workers``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from redis.typing import EncodableT, FieldT

from pipelines.envelope import Reply, Request
from pipelines.model import Item, Result
from pipelines.outcomes import Outcome


class Entry(NamedTuple):
    """A stream entry as redis-py reads it (its id and its fields), and the stream (the
    stage's stream of one lane) it was read from: where it is acked, touched, counted."""

    id: bytes
    fields: dict[bytes, bytes]
    stream: str


def by_stream(entries: Iterable[Entry]) -> dict[str, list[bytes]]:
    """The ids of ``entries``, grouped by the stream each came from (in entry order)."""
    out: dict[str, list[bytes]] = {}
    for entry in entries:
        out.setdefault(entry.stream, []).append(entry.id)
    return out


Letter = tuple[str, dict[FieldT, EncodableT]]
"""A dead letter to add: the stage's dead-letter stream and the entry's fields."""

Results = list[Result | BaseException]


@dataclass
class JoinArrival:
    """A branch output arriving at a join (the script's ``JOIN`` command)."""

    key: str
    stream: str
    branch: str
    output: bytes
    expected: int
    envelope: bytes
    ttl_s: int


@dataclass
class Effects:
    """What finishing one request's step publishes.

    Attributes:
        marker_ttl_s: how long the "done" marker guarding these effects lives.
        replies: (reply stream or job key, reply).
        forwards: (next stage stream, request).
        joins: branch outputs arriving at joins.
        failed_joins: (join key, ttl) of joins a failed branch cancels.
        answer_marker: when set (a failed branch: its join's "done" marker), the replies
            and failed joins run only if this marker is absent too, and set it, so the
            branches of one join answer a request once between them.
        cancel_marker: the request's cancellation marker (``Keys.cancelled``): if it
            exists when the batch publishes, none of these effects are (the request was
            cancelled while its step ran) and the request counts as ``cancelled``.
        batched: its first reply may share an entry with the batch's other replies to
            its stream (its gateway reads several an entry: ``Request.reply_batches``).
    """

    marker_ttl_s: int
    replies: list[tuple[str, Reply]] = field(default_factory=list)
    forwards: list[tuple[str, Request]] = field(default_factory=list)
    joins: list[JoinArrival] = field(default_factory=list)
    failed_joins: list[tuple[str, int]] = field(default_factory=list)
    answer_marker: str | None = None
    cancel_marker: str | None = None
    batched: bool = False

    def outcome(self) -> Outcome:
        """The request's outcome at this step: its failure reply's, else ``ok`` (answered,
        or handed on to the next step)."""
        for _, reply in self.replies:
            if reply.outcome != Outcome.OK and reply.outcome != "partial":
                return reply.outcome
        return Outcome.OK


@dataclass
class Outbox:
    """Everything one batch publishes, by "done" marker key, in one call with its ack."""

    effects: dict[str, Effects] = field(default_factory=dict)

    def replies(self) -> list[Reply]:
        """Every reply of the batch."""
        return [reply for e in self.effects.values() for _, reply in e.replies]


@dataclass
class BatchRecord:
    """What one batch did (kept in memory for tests and introspection).

    Attributes:
        size: entries in the batch.
        oldest_ms: arrival time of its oldest entry (server ms).
        closed_at: when assembly ended (server clock, seconds).
        run_s: model time.
        outcomes: items per outcome.
        request_ids: ids of the requests, in batch order.
        trace_ids: their trace ids (logged with the batch).
        arrivals: when each request arrived (server clock, seconds), as ``request_ids``.
        ran_at: when the model finished the batch (server clock; 0: it did not run).
        tokens: the estimated tokens of the items the model ran.
        padded_tokens: those items times the longest of them: what the model padded to.
        cold: the model met a shape it had not run before (its time is no cost sample).
        generated: the new tokens its sequence had when it left the running batch
            (continuous decoding; 0 otherwise).
    """

    size: int
    oldest_ms: int
    closed_at: float
    run_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    request_ids: list[str] = field(default_factory=list)
    trace_ids: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    ran_at: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0
    cold: bool = False
    generated: int = 0


@dataclass
class Batch:
    """One batch on its way through the worker: its entries and what they became."""

    entries: list[Entry]
    record: BatchRecord
    waits: list[float]  # each entry's time in the queue, in seconds
    out: Outbox  # what the batch publishes
    live: list[tuple[Request, Item]] = field(default_factory=list)  # what the model runs
    results: Results = field(default_factory=list)  # the model's
    letters: list[Letter] = field(default_factory=list)  # of the entries that did not decode
    dropped: list[str] = field(default_factory=list)  # markers of those left unanswered

    def took(self, ran: Ran, now: float) -> None:
        """``ran`` is what this batch ran, the model having finished at ``now`` (server
        clock): its results and their cost, in its record."""
        self.results = ran.results
        self.record.run_s, self.record.cold, self.record.ran_at = ran.run_s, ran.cold, now

    @staticmethod
    def merged(batches: Iterable[Batch]) -> tuple[Outbox, list[Entry], list[Letter], list[str]]:
        """The outbox, entries, letters and dropped markers of ``batches`` published as
        one call."""
        batches = list(batches)
        out = Outbox({m: e for b in batches for m, e in b.out.effects.items()})
        entries = [entry for b in batches for entry in b.entries]
        letters = [letter for b in batches for letter in b.letters]
        dropped = [marker for b in batches for marker in b.dropped]
        return out, entries, letters, dropped


@dataclass
class Ran:
    """A batch's run: the items that ran, their results, the model time, whether it met a
    cold shape (then its time is not the model's cost) and whether its time is a cost
    sample at all (not when it was cut short or run again to isolate a failure)."""

    items: list[Item]
    results: Results
    run_s: float
    cold: bool
    costed: bool = True

    @property
    def sample(self) -> bool:
        """Whether the batch's time is what the model costs (what the window learns)."""
        return self.costed and not self.cold


@dataclass(frozen=True)
class Published:
    """What one publish call did.

    Attributes:
        skipped: how many requests were skipped as already published.
        cancelled: the "done" markers of the requests found cancelled (nothing of them
            was published; each counted ``cancelled``).
        refused: the requests whose effects would have written a key holding another
            type: (key, its type) by "done" marker. When a call answers any, it wrote
            nothing at all (the publisher publishes the rest again without them).
        broken: keys the call writes whatever its requests (stats hash, dead-letter
            stream, acked streams) that hold another type: what it would write there was
            skipped.
    """

    skipped: int = 0
    cancelled: frozenset[str] = frozenset()
    refused: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    broken: frozenset[str] = frozenset()


@dataclass
class Claimed:
    """Entries taken back from a worker that stopped reading, sorted by their marks."""

    charged: list[Entry] = field(default_factory=list)  # on the model at its crash
    queued: list[Entry] = field(default_factory=list)  # waiting for their re-run
    waiting: list[Entry] = field(default_factory=list)  # not on the model
    # By entry id, of the charged and queued: the size of the batch each crashed in and
    # that batch's first entry id (its batch-mates share it).
    crashed_in: dict[bytes, tuple[int, bytes]] = field(default_factory=dict)
    hung: set[bytes] = field(default_factory=set)  # of those, ids whose model call hung

    def __iadd__(self, other: Claimed) -> Claimed:
        self.charged += other.charged
        self.queued += other.queued
        self.waiting += other.waiting
        self.crashed_in |= other.crashed_in
        self.hung |= other.hung
        return self

    @property
    def suspects(self) -> list[Entry]:
        """What runs again as a suspect: the charged and the queued."""
        return self.charged + self.queued

    def __bool__(self) -> bool:
        return bool(self.charged or self.queued or self.waiting)


class Settled(NamedTuple):
    """Entries recovery ended without running: what the worker publishes for them (their
    callers' answers, their acks, the stats and their dead letters), in one call."""

    out: Outbox
    entries: list[Entry]
    counts: dict[str, float]
    letters: list[Letter]


class Due(NamedTuple):
    """What recovery hands the worker before a read: suspects to run as one batch, on a
    model nothing else of the worker is on (none: read new entries), dead letters to
    publish (None: none), and entries taken back that were not on the model when their
    worker died, to run as an ordinary batch."""

    suspects: tuple[Entry, ...] = ()
    settled: Settled | None = None
    waiting: tuple[Entry, ...] = ()


class Emitter(Protocol):
    """Where a run streams its partial output (the batch's partials)."""

    wanted: bool

    def emit(self, index: int, text: str) -> None:
        """Row ``index`` of the batch now reads ``text``."""

    async def close(self) -> None:
        """Every partial is out (before the final reply)."""


class Turn(Protocol):
    """What a run asks of its worker around the model: the step passes it in."""

    async def before_host(self, batch: Batch) -> None:
        """A staged model's host phase (user code) is about to run, before its turn."""

    async def at_turn(self, batch: Batch, *, mark: bool) -> Emitter | None:
        """The model is the batch's: withdraw what was cancelled meanwhile (and, with
        ``mark``, mark its entries on the model); where to stream its output."""

    async def cancelled(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` (requests whose calls run) are cancelled by now: one
        round trip; none when Redis cannot say."""
