"""What a batch reports once published: its stats increments, its outcomes, its DEBUG log
line, its spans, its record in the worker's history and its share of its stage's
periodic INFO summary. After the publish, one observer does it all (:class:`Reporter`)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from pipelines.outcomes import Outcome
from runtime import stats, tracing
from runtime.redisio import RedisClock
from runtime.stats import CONTRACT
from workers.contract import Breaches
from workers.spans import record_batch
from workers.values import Batch, BatchRecord, Published

logger = logging.getLogger(__name__)


SENT_AT_ONCE = frozenset({"dead_letters", CONTRACT})
"""The stats fields a batch's publish carries at once, events an operator is alerted on
(the work's counts may be held back)."""


def batch_counts(batch: Batch) -> dict[str, float]:
    """The increments ``batch`` adds to its stage's stats hash with its publish
    (:func:`runtime.stats.batch_fields`, its tokens and its dead letters)."""
    record = batch.record
    counts = stats.batch_fields(record.size, len(batch.live), batch.waits, record.run_s)
    if record.padded_tokens:
        counts["tokens"], counts["padded_tokens"] = record.tokens, record.padded_tokens
    if batch.letters:
        counts["dead_letters"] = len(batch.letters)
    return counts


def tally(batch: Batch, published: Published) -> None:
    """Count ``batch``'s outcomes in its record as the publish counted them: one per
    request (see ``Effects.outcome``), cancelled for those it found cancelled, an error
    for each entry dropped unanswered."""
    record = batch.record
    record.outcomes.update(
        Outcome.CANCELLED if marker in published.cancelled else effects.outcome()
        for marker, effects in batch.out.effects.items()
    )
    record.outcomes[Outcome.ERROR] += len(batch.dropped)


def log_batch(stage: str, batch: Batch) -> None:
    """The one DEBUG line of a batch, with its trace ids; its fields also structured
    (``CONVEYOR_LOG_FORMAT=json``). At INFO, :class:`Summary` says what batches did."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    record = batch.record
    outcomes = {outcome.value: record.outcomes[outcome] for outcome in Outcome}
    wait_ms, run_ms = max(batch.waits) * 1000, record.run_s * 1000
    fields = {
        "stage": stage,
        "batch": record.size,
        **outcomes,
        "wait_max_ms": round(wait_ms, 1),
        "run_ms": round(run_ms, 1),
        "tokens": record.tokens,
        "padded_tokens": record.padded_tokens,
        "trace_ids": record.trace_ids,
    }
    logger.debug(
        "stage %s batch=%d ok=%d error=%d expired=%d cancelled=%d wait_max=%.1fms "
        "run=%.1fms tokens=%d/%d traces=%s",
        stage,
        record.size,
        *outcomes.values(),
        wait_ms,
        run_ms,
        record.tokens,
        record.padded_tokens,
        ",".join(record.trace_ids),
        extra=fields,
    )


class Summary:
    """One INFO line per stage every ``every_s`` seconds while it works: batches, items,
    outcome counts, mean batch size and items/s over the time it covers; nothing while
    idle. Shared by the stage's partition loops in a process (one event loop: no lock).

    The time a line covers starts at the previous line, or at the first batch after an
    idle interval (so a burst after an hour's quiet is not averaged over the hour).

    Args:
        stage: the stage's name.
        every_s: the interval (``CONVEYOR_LOG_SUMMARY_S``); 0: no summaries.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self, stage: str, every_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stage, self.every_s, self.clock = stage, every_s, clock
        # Before the first batch the stage has been idle (its model loading, say): the
        # first line covers the time since that batch.
        self.since = -math.inf
        self._clear()

    def _clear(self) -> None:
        self.batches = self.items = 0
        self.run_s = 0.0
        self.outcomes: Counter[str] = Counter()

    def add(self, record: BatchRecord) -> None:
        """Count a published batch, then :meth:`tick`."""
        if not self.every_s:
            return
        now = self.clock()
        if not self.batches and now - self.since >= self.every_s:
            self.since = now  # the first batch after an idle interval
        self.batches += 1
        self.items += record.size
        self.run_s += record.run_s
        self.outcomes.update(record.outcomes)
        self.tick()

    def tick(self, *, last: bool = False) -> None:
        """Write the summary if one is due and there is something to say (the loop calls
        this each time it comes round, idle or not).

        Args:
            last: the worker is stopping: what is counted is said now, however short
                its span.
        """
        if not self.batches:
            return
        now = self.clock()
        span = now - self.since
        if span < self.every_s and not last:
            return
        span = max(span, 0.001)
        outcomes = {outcome.value: self.outcomes[outcome] for outcome in Outcome}
        fields = {
            "stage": self.stage,
            "summary": True,
            "batches": self.batches,
            "items": self.items,
            **outcomes,
            "mean_batch": round(self.items / self.batches, 2),
            "items_per_s": round(self.items / span, 2),
            "run_ms_mean": round(self.run_s / self.batches * 1000, 1),
            "span_s": round(span, 1),
        }
        logger.info(
            "stage %s summary: %d batches, %d items (ok=%d error=%d expired=%d "
            "cancelled=%d), mean batch %.1f, %.1f items/s, run mean %.1f ms, over %.0f s",
            self.stage,
            self.batches,
            self.items,
            *outcomes.values(),
            self.items / self.batches,
            self.items / span,
            self.run_s / self.batches * 1000,
            span,
            extra=fields,
        )
        self.since = now
        self._clear()


class Reporter:
    """What a batch reports: its stats increments, with its publish (:meth:`counts`);
    then, the one observer of the published batch, its outcomes counted in its record as the
    publish counted them (:func:`tally`), the record kept in :attr:`history`, its spans
    (when tracing is on: :mod:`workers.spans`), its DEBUG line (:func:`log_batch`) and
    its share of the stage's summary (:class:`Summary`), in that order.

    Args:
        stage: the stage's name.
        consumer: the worker's consumer name (on the batch's span).
        clock: the server's clock (when the batch was published).
        summary: the stage's periodic INFO summary.
        breaches: the stage's model's contract breaches (counted with a publish).
        gauges: the learned cost model, published with each batch (None: none learned).
        flush_s: how long the work's counts may be held back (:meth:`counts`).

    Attributes:
        history: what the recent batches did (tests, introspection).
    """

    def __init__(
        self,
        stage: str,
        consumer: str,
        clock: RedisClock,
        summary: Summary,
        breaches: Breaches,
        gauges: Callable[[], dict[str, float] | None],
        flush_s: float = 0.0,
    ) -> None:
        self.stage, self.consumer, self.clock, self.summary = stage, consumer, clock, summary
        self.breaches, self.gauges = breaches, gauges
        self.flush_s = flush_s
        self._held: dict[str, float] = {}
        self._sent_at = -math.inf
        self.history: deque[BatchRecord] = deque(maxlen=10_000)

    def counts(self, batch: Batch) -> tuple[dict[str, float], dict[str, float] | None]:
        """What ``batch``'s publish adds to its stage's stats (:func:`batch_counts` and
        the contract breaches noted since the last publish), and the gauges it sets.

        What describes the work (batches, model items, tokens, sizes, waits, model
        time, learned costs) is held and sent with the first publish ``flush_s`` after
        the last it went with (:meth:`held`: or when the worker is idle): a stage's
        views lag by at most that, and a batch costs Redis no write per histogram.
        Dead letters and contract breaches go with every publish, as the outcome
        counters (under each request's done marker) do."""
        counts = batch_counts(batch)
        breaches = self.breaches.take()  # logged here, at most one line a minute
        if breaches:
            counts[CONTRACT] = breaches
        now = {k: v for k, v in counts.items() if k in SENT_AT_ONCE}
        for name, value in counts.items():
            if name not in SENT_AT_ONCE:
                self._held[name] = self._held.get(name, 0) + value
        if time.monotonic() - self._sent_at < self.flush_s:
            return now, None
        held, gauges = self.held()
        return now | held, gauges

    def held(self) -> tuple[dict[str, float], dict[str, float] | None]:
        """The counts held back and the gauges, taken to be sent now (nothing when nothing
        was held back)."""
        held, self._held = self._held, {}
        self._sent_at = time.monotonic()
        return held, self.gauges() if held else None

    def unsent(self, counts: dict[str, float]) -> None:
        """A publish of ``counts`` failed: what was held back is held again (a batch's own
        counts go with it when it runs again)."""
        for name, value in counts.items():
            if name not in SENT_AT_ONCE:
                self._held[name] = self._held.get(name, 0) + value

    def published(self, batch: Batch, published: Published) -> None:
        """``batch`` is published (``published`` says what the publish counted)."""
        tally(batch, published)
        self.history.append(batch.record)
        if tracing.STATE.enabled:
            record_batch(self.stage, batch, self.clock.now(), self.consumer)
        log_batch(self.stage, batch)
        self.summary.add(batch.record)
