"""Every Redis key and stream name conveyor uses, built in one place.

All names live under one namespace, split into partitions. Each partition's keys share
one Redis Cluster hash tag, so they map to one cluster slot, and the script that
publishes a batch's results and acks it never crosses slots. One partition (the
default) is the tag ``{namespace}``: every key of the deployment in one slot, on one
shard. With ``P`` partitions, partition ``k`` is ``{namespace.p<k>}`` (plus a suffix
that places its slot in the ``k``-th ``P``-th of the slot space, so partitions spread
evenly over shards that split the slots evenly, as ``redis-cli --cluster create``
does). A request belongs to the partition its id hashes to (:meth:`Keys.of`), and
everything it touches (every stage stream of its pipeline, its join state and markers,
its job record, its reply stream) is its partition's.
"""

from __future__ import annotations

import re
import zlib
from typing import Literal

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

Lane = Literal["interactive", "bulk"]
"""A request's priority lane. Each stage has a stream per lane; its workers take
``interactive`` work first and give ``bulk`` a guaranteed share of batches."""
LANES: tuple[Lane, ...] = ("interactive", "bulk")
DEFAULT_LANE: Lane = "interactive"
"""The lane of a request that names none (a job's default is the gateway's:
:mod:`gateway.headers`)."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

GROUP = "workers"
"""The consumer group every stage stream is read by."""

MAX_PARTITIONS = 1024
"""The most partitions a namespace may have."""


def partition_tag(namespace: str, partition: int, partitions: int) -> str:
    """The hash tag (without braces) of ``partition`` of ``partitions``.

    One partition is the namespace itself (the names conveyor had before partitions).
    Otherwise ``<namespace>.p<k>``, or the first ``<namespace>.p<k>.<n>`` whose slot
    lies in the ``k``-th ``partitions``-th of the slot space: a cluster whose shards
    hold equal runs of slots then holds equal numbers of partitions (a plain hash would
    put three partitions on one shard of three a ninth of the time).
    """
    if partitions == 1:
        return namespace
    low = partition * REDIS_CLUSTER_HASH_SLOTS // partitions
    high = (partition + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions
    tag, n = f"{namespace}.p{partition}", 0
    while not low <= key_slot(tag.encode()) < high:
        n += 1
        tag = f"{namespace}.p{partition}.{n}"
    return tag


class Keys:
    """Builds the key names of one partition of a namespace.

    Args:
        namespace: letters, digits, ``_ . -``; with one partition, the hash tag
            ``{namespace}``.
        partitions: how many partitions the namespace has (every process of a
            deployment must agree: it decides which partition a request id is in).
        partition: which of them these keys are (0 to ``partitions - 1``).
    """

    def __init__(self, namespace: str, partitions: int = 1, partition: int = 0) -> None:
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if not 1 <= partitions <= MAX_PARTITIONS or not 0 <= partition < partitions:
            raise ValueError(
                f"partition {partition} of {partitions}: partitions must be 1-{MAX_PARTITIONS}"
            )
        self.namespace = namespace
        self.partitions = partitions
        self.partition = partition
        self.prefix = "{" + partition_tag(namespace, partition, partitions) + "}"
        self._all: list[Keys] | None = None  # every partition's, built once, shared

    def at(self, partition: int) -> Keys:
        """The keys of ``partition`` of this namespace."""
        return self.each()[partition]

    def each(self) -> list[Keys]:
        """The keys of every partition, in order (built once: :meth:`of` runs per request,
        and finding a partition's tag takes a search)."""
        if self._all is not None:
            return self._all
        made = [
            self if k == self.partition else Keys(self.namespace, self.partitions, k)
            for k in range(self.partitions)
        ]
        for keys in made:
            keys._all = made
        return made

    def of(self, request_id: str) -> Keys:
        """The keys of the partition ``request_id`` belongs to (a hash of the id: ids
        conveyor makes are random, so requests spread evenly)."""
        if self.partitions == 1:
            return self
        return self.at(zlib.crc32(request_id.encode("utf-8", "surrogatepass")) % self.partitions)

    def stage_stream(self, stage: str, lane: str = DEFAULT_LANE) -> str:
        """The stream a stage's workers read the requests of ``lane`` from (the default
        lane's is the stage's own name; another lane's adds ``:<lane>``)."""
        base = f"{self.prefix}:stage:{stage}"
        return base if lane == DEFAULT_LANE else f"{base}:{lane}"

    def stage_stats(self, stage: str) -> str:
        """The hash of a stage's counters and histogram buckets."""
        return f"{self.prefix}:stats:{stage}"

    def reply_stream(self, gateway_id: str) -> str:
        """The stream one gateway process reads its replies from."""
        return f"{self.prefix}:reply:{gateway_id}"

    def join(self, request_id: str, step: str) -> str:
        """The hash where a join step's branch outputs meet for one request."""
        return f"{self.prefix}:join:{request_id}:{step}"

    def job(self, job_id: str) -> str:
        """The hash holding an async job's status and, when done, its result."""
        return f"{self.job_prefix}{job_id}"

    @property
    def job_prefix(self) -> str:
        """What every job key starts with (a reply addressed there is stored, not streamed)."""
        return f"{self.prefix}:job:"

    def done(self, request_id: str, step: str) -> str:
        """Marks that a request's step has published its effects (set once, expires)."""
        return f"{self.prefix}:done:{request_id}:{step}"

    def cancelled(self, request_id: str) -> str:
        """Marks that a request is cancelled: no step starts it any more (expires)."""
        return f"{self.prefix}:cancelled:{request_id}"

    def dropped(self, stage: str, entry_id: str) -> str:
        """Marks that an undecodable entry of ``stage`` has been counted (set once, expires)."""
        return f"{self.prefix}:dropped:{stage}:{entry_id}"

    def publish_token(self, token: str) -> str:
        """Marks that one publish call has run, so repeating it does nothing (short TTL)."""
        return f"{self.prefix}:published:{token}"

    def dead_letters(self, stage: str) -> str:
        """The stream of a stage's dead letters: entries delivered too often."""
        return f"{self.prefix}:dlq:{stage}"

    def on_model(self, stream: str) -> str:
        """The hash of the entries of ``stream`` (one of this partition's stage streams)
        in their model's hands, or queued to run again after a crash, by entry id: what a
        crash of their worker is charged to (:mod:`workers.claims`; a field is deleted
        when its batch publishes)."""
        return f"{self.prefix}:on-model:{stream.removeprefix(self.prefix + ':')}"

    def parked(self) -> str:
        """The hash of the worker groups ``conveyor up`` has parked after a crash loop:
        stage name -> why and until when (kept in partition 0, read by the gateway)."""
        return f"{self.at(0).prefix}:parked"

    def partition_count(self) -> str:
        """Holds the partition count of the namespace, which every process must share
        (under the namespace's own tag, whatever the count)."""
        return "{" + self.namespace + "}:partitions"

    def alive(self, stage: str) -> str:
        """The hash of a stage's workers' heartbeats: consumer name -> when its last beat
        runs out (Redis time, ms; :mod:`workers.alive`; kept in partition 0)."""
        return f"{self.at(0).prefix}:alive:{stage}"

    def places(self, stage: str) -> str:
        """The hash of where a stage's worker processes run: consumer name -> boot id,
        pid namespace, pid and start time (:mod:`workers.places`; kept in partition 0)."""
        return f"{self.at(0).prefix}:places:{stage}"

    def stage_definition(self, stage: str) -> str:
        """The definition a stage's workers agree on (its wire contract: a digest and a
        JSON summary; :mod:`runtime.definitions`), set by its first worker (partition 0)."""
        return f"{self.at(0).prefix}:definition:{stage}"

    def definition_holders(self, stage: str) -> str:
        """The hash of which definition each of a stage's workers started with: consumer
        name -> digest (:mod:`runtime.definitions`; partition 0, beside the record)."""
        return f"{self.at(0).prefix}:definition-holders:{stage}"

    def cpu_models(self) -> str:
        """The hash of the worker processes that run a model with torch on the CPU:
        consumer name -> when its last beat runs out (as :meth:`alive`). A worker started
        by hand divides its host's cores among these (:mod:`workers.threads`), not among
        every worker (a toy or a function step runs no torch thread; kept in partition 0)."""
        return f"{self.at(0).prefix}:cpu-models"

    def stages_set(self) -> str:
        """The set of stage names that have ever had a worker (for status views; kept in
        partition 0)."""
        return f"{self.at(0).prefix}:stages"

    def is_reply_target(self, key: str) -> bool:
        """Whether ``key`` is a reply stream or a job record of this namespace (what a
        worker may answer to when all it has is an entry's word for it)."""
        return key.startswith((f"{self.prefix}:reply:", self.job_prefix))
