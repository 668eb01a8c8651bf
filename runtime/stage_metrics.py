"""The stage metrics of ``/metrics``: their families, and their Prometheus text rendered
from each stage's stats hash (:mod:`runtime.stats`) and its state
(:mod:`runtime.status`), with the primitives of :mod:`runtime.metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from pipelines.keys import LANES, Keys
from pipelines.outcomes import Outcome
from runtime.metrics import BUCKETS, Exposition, Family, histogram_lines, le_label
from runtime.stats import CHARGED, CONTRACT, RESTARTS, read_stats
from runtime.status import stage_status

ITEMS = Family(
    "conveyor_stage_items_total",
    "counter",
    "Requests a stage ended, by outcome (ok, error, expired, cancelled), each once.",
)
TOKENS = Family(
    "conveyor_stage_tokens_total",
    "counter",
    "Estimated tokens the model ran: kind=real, and kind=padded (what they were padded to).",
)
COUNTERS = {
    "batches": Family("conveyor_stage_batches_total", "counter", "Batches a stage's workers ran."),
    "model_items": Family(
        "conveyor_stage_model_items_total",
        "counter",
        "Items handed to the model (a batch run twice after a reclaim counts twice).",
    ),
    "dead_letters": Family(
        "conveyor_stage_dead_letters_total",
        "counter",
        "Requests a stage moved to its dead letters.",
    ),
    CHARGED: Family(
        "conveyor_stage_crash_charges_total",
        "counter",
        "Entries that were on the model when their worker died, each charged the crash.",
    ),
    CONTRACT: Family(
        "conveyor_stage_contract_errors_total",
        "counter",
        "Batch-contract breaches of a stage's model: a batch answered with the wrong number of "
        "results, or an item with a result that is not a JSON object.",
    ),
    RESTARTS: Family(
        "conveyor_stage_worker_restarts_total",
        "counter",
        "Crashed worker processes of a stage that conveyor up restarted.",
    ),
}
"""The counters that each expose one field of the stats hash, by that field."""
HISTOGRAMS = {
    "batch_size": Family("conveyor_stage_batch_size", "histogram", "Items per batch."),
    "queue_wait_seconds": Family(
        "conveyor_stage_queue_wait_seconds",
        "histogram",
        "Seconds a request waited in its stage's stream before its batch ran.",
    ),
    "run_seconds": Family(
        "conveyor_stage_run_seconds", "histogram", "Seconds the model took per batch."
    ),
}
BACKLOG = Family(
    "conveyor_stage_backlog",
    "gauge",
    "Entries of a stage's lane no worker has read yet (the lag; pending is apart).",
)
PENDING = Family(
    "conveyor_stage_pending", "gauge", "Entries of a stage's lane read by a worker, not acked."
)
CONSUMERS = Family("conveyor_stage_consumers", "gauge", "Live workers of a stage.")
PARKED = Family(
    "conveyor_stage_parked",
    "gauge",
    "Seconds until conveyor up starts a stage's workers again after a crash loop (0: not parked).",
)
STAGE_FAMILIES = (
    ITEMS,
    COUNTERS["batches"],
    COUNTERS["model_items"],
    BACKLOG,
    PENDING,
    CONSUMERS,
    PARKED,
    COUNTERS["dead_letters"],
    COUNTERS[CHARGED],
    COUNTERS[CONTRACT],
    TOKENS,
    COUNTERS[RESTARTS],
    *(HISTOGRAMS[name] for name in BUCKETS),
)
"""Every family of the stage metrics (``/metrics``), in the order they are written."""


async def render_stage_metrics(client: aioredis.Redis, keys: Keys, stages: Iterable[str]) -> str:
    """Prometheus text for the counters, histograms and queue gauges of ``stages``.

    ``conveyor_stage_tokens_total`` counts the estimated tokens (:mod:`pipelines.tokens`)
    of the items the model ran, ``kind="real"``, and what they were padded to (each
    batch's items times its longest), ``kind="padded"``: real over padded is the stage's
    padding efficiency. The queue gauges: ``conveyor_stage_backlog`` is a lane's
    :attr:`~runtime.status.LaneStatus.lag` (entries no worker has read yet; not the
    backlog, which adds the pending ones), ``conveyor_stage_pending`` its
    :attr:`~runtime.status.LaneStatus.pending`, one series per lane (label ``lane``;
    ``sum by (stage)`` is the stage's); ``conveyor_stage_consumers`` is
    :attr:`~runtime.status.StageStatus.workers`; ``conveyor_stage_worker_restarts_total``
    counts the crashed worker processes of the stage ``conveyor up`` restarted
    (:data:`~runtime.stats.RESTARTS`); ``conveyor_stage_parked`` is the seconds until
    ``up`` starts a parked stage's workers again
    (:attr:`~runtime.status.StageStatus.parked`).
    """
    out = Exposition(STAGE_FAMILIES)
    for stage in stages:
        stats = await read_stats(client, keys, stage)
        for outcome in Outcome:
            count = stats.get(outcome.stats_field, 0)
            out.sample(ITEMS, count, stage=stage, outcome=outcome.value)
        for name, counter in COUNTERS.items():
            out.sample(counter, stats.get(name, 0), stage=stage)
        for kind, name in (("real", "tokens"), ("padded", "padded_tokens")):
            out.sample(TOKENS, stats.get(name, 0), stage=stage, kind=kind)
        for name, bounds in BUCKETS.items():
            per = [stats.get(f"h:{name}:{le_label(b)}", 0.0) for b in (*bounds, float("inf"))]
            total = stats.get(f"h:{name}:sum", 0.0)
            family = HISTOGRAMS[name]
            out.add(family, histogram_lines(family.name, bounds, per, total, stage=stage))
        st = await stage_status(client, keys, stage)
        for lane in LANES:
            part = st.lane(lane)
            # The lag, not the backlog: the gauge's name predates the property (see above).
            out.sample(BACKLOG, part.lag, stage=stage, lane=lane)
            out.sample(PENDING, part.pending, stage=stage, lane=lane)
        out.sample(CONSUMERS, st.workers, stage=stage)
        parked = st.parked.left_s(time.time()) if st.parked is not None else 0.0
        out.sample(PARKED, round(parked, 1), stage=stage)
    return out.text()
