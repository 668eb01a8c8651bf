"""A stage's stats hash (``Keys.stage_stats``): the names of its fields, what one batch
adds to it (:func:`batch_fields`), and reading it back summed over the partitions
(:func:`read_stats`).

Workers add to a stage's stats hash inside the same atomic script call that publishes a batch's
results and acks it, so the counts can never disagree with what was acknowledged. Any
process (gateway ``/metrics``, ``conveyor status``) reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis

from pipelines.keys import Keys
from runtime.metrics import BUCKETS, Histogram
from runtime.redisio import text

COST_A = "cost:a"
"""Stats-hash field: a stage's learned fixed seconds per batch (set by its workers)."""
COST_B = "cost:b"
"""Stats-hash field: a stage's learned seconds per item."""
RESTARTS = "worker_restarts"
"""Stats-hash field: times ``conveyor up`` restarted a crashed worker process of the stage
(:mod:`conveyor.restarts`)."""

CHARGED = "crash_charges"
"""Stats-hash field: entries a worker found on the model of a worker that died, and charged
the crash (:mod:`workers.claims`): each such crash moves its inputs toward a dead letter,
so ``conveyor up`` counts it as progress, not as a crash loop."""

CONTRACT = "contract_errors"
"""Stats-hash field: batch-contract breaches of a stage's model (a batch answered with the
wrong number of results, an item with a result that is not a JSON object;
:class:`workers.contract.Breaches`)."""


def batch_fields(
    batch_size: int, model_items: int, waits: Iterable[float], run_s: float
) -> dict[str, float]:
    """The increments one batch adds to its stage's stats hash, outside any done marker.

    They describe work a worker actually did, so a batch run twice (a stalled worker and
    the one that reclaimed its entries) is counted twice here, and ``model_items`` shows
    the duplicated model work. The per-request outcome counters (``items:<outcome>``) are
    not here: :func:`workers.publish.publish` adds them under each request's done marker,
    so they count each answered request once.

    Args:
        batch_size: entries in the batch.
        model_items: of those, how many were handed to the model.
        waits: each entry's queue wait, seconds.
        run_s: model time, seconds.
    """
    fields: dict[str, float] = {"batches": 1}
    if model_items:
        fields["model_items"] = model_items
    size = Histogram(BUCKETS["batch_size"])
    size.observe(batch_size)
    wait = Histogram(BUCKETS["queue_wait_seconds"])
    for w in waits:
        wait.observe(w)
    run = Histogram(BUCKETS["run_seconds"])
    run.observe(run_s)
    fields.update(size.fields("batch_size"))
    fields.update(wait.fields("queue_wait_seconds"))
    fields.update(run.fields("run_seconds"))
    return fields


def merge_stats(hashes: Iterable[Mapping[Any, Any]]) -> dict[str, float]:
    """One stage's stats from its partitions' hashes (HGETALL answers): counters and
    buckets summed; the learned costs (:data:`COST_A`, :data:`COST_B`) averaged over the
    partitions that have learned them (each partition's workers learn the same model)."""
    total: dict[str, float] = {}
    costs: dict[str, list[float]] = {COST_A: [], COST_B: []}
    for raw in hashes:
        for k, v in raw.items():
            name, value = text(k), float(v)
            if name in costs:
                costs[name].append(value)
            else:
                total[name] = total.get(name, 0.0) + value
    for name, learned in costs.items():
        if learned:
            total[name] = sum(learned) / len(learned)
    return total


async def read_stats(client: aioredis.Redis, keys: Keys, stage: str) -> dict[str, float]:
    """A stage's stats, summed over its partitions (:func:`merge_stats`; empty when the
    stage never ran)."""
    return (await read_all_stats(client, keys, [stage]))[stage]


async def read_all_stats(
    client: aioredis.Redis, keys: Keys, stages: Iterable[str]
) -> dict[str, dict[str, float]]:
    """Each of ``stages``' stats, as :func:`read_stats`, in one round trip (a cluster
    client splits it by shard)."""
    stages, parts = list(stages), keys.each()
    pipe = client.pipeline(transaction=False)
    for stage in stages:
        for part in parts:
            pipe.hgetall(part.stage_stats(stage))
    answers = await pipe.execute()
    n = len(parts)
    return {stage: merge_stats(answers[i * n : (i + 1) * n]) for i, stage in enumerate(stages)}
