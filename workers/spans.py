"""A batch's OpenTelemetry spans (only when tracing is on: :mod:`runtime.tracing`).

One span for the batch itself (its own trace: a batch serves many requests, each in its
own trace), and for each request it ran, under that request's root span (its envelope's
``traceparent``), three spans that tile the request's time at this stage:

- ``<stage> queue``: from its arrival in the stream to the batch closing;
- ``<stage> batch``: from there until the model finished the batch (waiting for the model,
  then running it), linked to the batch's span and with its size; its child ``<stage>
  run`` is the model's own time;
- ``<stage> publish``: routing the result and publishing it (the next step's enqueue, a
  join, or the reply).
"""

from __future__ import annotations

from runtime import tracing
from workers.values import Batch


def record_batch(stage: str, batch: Batch, published_s: float, consumer: str) -> None:
    """Record ``batch``'s spans, the batch published at ``published_s`` (server clock)."""
    record = batch.record
    if not batch.live or not record.ran_at:
        return
    size = len(batch.live)
    batch_span = tracing.span(
        f"{stage} batch",
        None,
        record.closed_at,
        published_s,
        {
            "conveyor.stage": stage,
            "conveyor.batch.size": size,
            "conveyor.batch.run_ms": record.run_s * 1000,
            "conveyor.consumer": consumer,
        },
    )
    arrivals = dict(zip(record.request_ids, record.arrivals, strict=True))
    run_start = record.ran_at - record.run_s
    for req, _ in batch.live:
        under = tracing.parent(req.traceparent)
        if under is None:
            continue
        attributes = {
            "conveyor.stage": stage,
            "conveyor.step": req.step,
            "conveyor.lane": req.lane,
            "conveyor.request_id": req.id,
        }
        arrived = arrivals.get(req.id, record.closed_at)
        tracing.span(f"{stage} queue", under, arrived, record.closed_at, attributes)
        joined = tracing.span(
            f"{stage} batch",
            under,
            record.closed_at,
            record.ran_at,
            {**attributes, "conveyor.batch.size": size},
            [tracing.link(batch_span, **{"conveyor.batch.size": size})],
        )
        run_under = tracing.under_span(joined)
        tracing.span(f"{stage} run", run_under, run_start, record.ran_at, attributes)
        tracing.span(f"{stage} publish", under, record.ran_at, published_s, attributes)
