"""What a batch reports once published: its stats increments, its outcomes, its log line."""

from __future__ import annotations

import logging

from pipelines.outcomes import Outcome
from runtime import stats
from workers.intake import Batch
from workers.publish import Published

logger = logging.getLogger(__name__)


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
    """The one log line of a batch."""
    record = batch.record
    logger.info(
        "stage %s batch=%d ok=%d error=%d expired=%d cancelled=%d wait_max=%.1fms "
        "run=%.1fms tokens=%d/%d traces=%s",
        stage,
        record.size,
        *(record.outcomes[outcome] for outcome in Outcome),
        max(batch.waits) * 1000,
        record.run_s * 1000,
        record.tokens,
        record.padded_tokens,
        ",".join(record.trace_ids),
    )
