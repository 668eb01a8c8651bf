"""A stage's partitions in one process: one worker each, one model between them."""

from __future__ import annotations

import math

from pipelines.registry import Registry
from pipelines.stages import Stage
from workers.loop import Worker
from workers.settings import WorkerSettings


def partition_workers(
    stage: Stage, settings: WorkerSettings, registry: Registry | None = None
) -> list[Worker]:
    """One :class:`Worker` per partition of ``stage`` (``CONVEYOR_PARTITIONS``), sharing
    one model runner, one consumer name and one log summary: the model loads once, the partitions'
    batches take turns on it, and status views count one worker.

    ``max_concurrent_batches`` is shared out: each partition gets its share, rounded up
    (at least one), so a process does not hold ``P`` times the entries it can run while
    other workers could take them.

    A read cannot span partitions on a Redis Cluster (their streams are in different
    slots), so each partition has its own loop, window and recovery.

    Args:
        stage: the stage to serve.
        settings: the worker's settings.
        registry: the pipelines whose steps run on this stage.
    """
    if settings.partitions > 1:
        share = math.ceil(settings.max_concurrent_batches / settings.partitions)
        settings = settings.model_copy(update={"max_concurrent_batches": share})
    first = Worker(stage, settings, registry=registry)
    return [first] + [
        Worker(
            stage,
            settings,
            registry=registry,
            partition=k,
            runner=first.runner,
            consumer=first.consumer,
            summary=first.summary,
        )
        for k in range(1, settings.partitions)
    ]
