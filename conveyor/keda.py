"""``conveyor keda STAGE``: the KEDA triggers that scale a stage's workers, one set per
partition.

KEDA's Redis Streams scalers watch one stream each, and a stage has a stream per lane
in every partition (:mod:`pipelines.keys`). So a stage's ScaledObject needs a lag and a
pending trigger for each of them; this prints that list, for the deployment's
``CONVEYOR_NAMESPACE`` and ``CONVEYOR_PARTITIONS``, to paste under ``triggers:``. On a
cluster (``redis+cluster://``) they are ``redis-cluster-streams`` triggers.

The HPA follows the trigger asking for the most replicas, not the sum: with ``P``
partitions, each lag trigger's target is the stage's target divided by ``P`` (rounded up),
so ``P`` evenly loaded partitions ask for what one stream holding all of it would. The
pending triggers keep theirs whole: a worker holds entries of every partition at once (up
to its whole target in each, :func:`workers.loop.partition_workers`), so a divided target
would count each worker up to ``P`` times; they keep pods with work in flight alive, and
the lag triggers scale out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipelines.keys import GROUP, LANES, Keys


@dataclass(frozen=True)
class TriggerOptions:
    """What the triggers point at.

    Attributes:
        address: Redis's ``host:port`` as KEDA reaches it (on a cluster: a comma-separated
            list of nodes).
        target: entries per worker: what one worker holds at full speed (its
            ``max_batch_size`` times ``max_concurrent_batches``).
        auth: the ``TriggerAuthentication`` holding KEDA's Redis user.
        cluster: the Redis is a cluster (``redis-cluster-streams`` triggers).
    """

    address: str
    target: int
    auth: str = "conveyor-redis-keda"
    cluster: bool = False


def triggers(keys: Keys, stage: str, options: TriggerOptions, label: str = "") -> str:
    """The YAML list of ``stage``'s triggers (lag and pending, every lane, every
    partition), indented to sit under ``spec.triggers``.

    Args:
        keys: the deployment's key names (every partition is covered).
        stage: the stage whose workers scale.
        options: where Redis is, the target, the authentication.
        label: put into each trigger's name (``lag-<label>``), to tell apart the triggers
            of several stages in one ScaledObject.
    """
    kind = "redis-cluster-streams" if options.cluster else "redis-streams"
    where = "addresses" if options.cluster else "address"
    divided = max(1, math.ceil(options.target / keys.partitions))
    out: list[str] = []
    for metric, field, each, note in (
        ("lag", "lagCount", divided, "waiting, not yet delivered to any worker (XINFO GROUPS lag)"),
        ("pending", "pendingEntriesCount", options.target, "delivered, not yet acknowledged"),
    ):
        for part in keys.each():
            for lane in LANES:
                name = f"{metric}-{label}" if label else metric
                name += "" if lane == "interactive" else f"-{lane}"
                if keys.partitions > 1:
                    name += f"-p{part.partition}"
                out += [
                    f"  # {stage}, {lane} lane, partition {part.partition}: {note}",
                    f"  - type: {kind}",
                    f"    name: {name}",
                    "    metadata:",
                    f"      {where}: {options.address}",
                    f'      stream: "{part.stage_stream(stage, lane)}"',
                    f"      consumerGroup: {GROUP}",
                    f'      {field}: "{each}"',
                    '      activationLagCount: "0"',
                    "    authenticationRef:",
                    f"      name: {options.auth}",
                ]
    return "\n".join(out) + "\n"
