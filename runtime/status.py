"""A stage's state at one moment, summed over its partitions: :class:`StageStatus`, the
one type admission, the status page, the metrics and the autoscaler read. Its lanes'
queues (length, lag, pending), its workers (the consumer group's members and the
heartbeats), its learned cost and whether ``conveyor up`` parked it (:func:`stage_status`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from pipelines.keys import GROUP, LANES, Keys, Lane
from pipelines.records import Parked
from runtime.redisio import in_order, text
from runtime.stats import COST_A, COST_B

ALIVE_STALE_MS = 30_000
"""A worker's heartbeat counts this long by default (``CONVEYOR_ALIVE_STALE_S``): one
silent longer is gone (:class:`workers.alive.Presence`)."""
MAX_BEATS = 10_000
"""Read at most this many heartbeats of a stage (a forged hash may hold millions)."""


def beat_until(raw: object) -> int | None:
    """A heartbeat's field value (when it runs out, Redis time, ms) read from Redis, or
    None where it is not one (a forged or damaged field: no worker wrote it)."""
    try:
        value = int(text(raw))
    except (ValueError, UnicodeDecodeError):
        return None
    return value if 0 < value < 10**15 else None


async def live_workers(client: aioredis.Redis, keys: Keys, stage: str) -> set[str]:
    """The consumer names of ``stage`` whose heartbeat has not run out
    (:class:`workers.alive.Presence`), on the Redis clock.

    Whatever the hash holds is checked: a field that is not a time, a name over 256
    characters, a key of another type count as no worker.
    """
    return await live_beats(client, keys.alive(stage))


async def live_beats(client: aioredis.Redis, key: str) -> set[str]:
    """The consumer names of the hash of heartbeats ``key`` (:meth:`Keys.alive`,
    :meth:`Keys.cpu_models`) whose beat has not run out, checked as
    :func:`live_workers` says."""
    try:
        raw = await client.hgetall(key)
    except ResponseError:  # the key forged to another type
        return set()
    return _live(raw, await client.time())


def _live(raw: dict[Any, Any], now: tuple[Any, Any]) -> set[str]:
    """The consumer names among heartbeats ``raw`` (an HGETALL) whose beat runs out after
    ``now`` (a TIME: seconds, microseconds)."""
    seconds, micros = now
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    live: set[str] = set()
    for name, until in list(raw.items())[:MAX_BEATS]:
        value = beat_until(until)
        try:
            consumer = text(name)
        except UnicodeDecodeError:
            continue
        if value is not None and value > now_ms and len(consumer) <= 256:
            live.add(consumer)
    return live


@dataclass(frozen=True)
class Consumer:
    """One worker of a stage: in its consumer group, or beating (or both).

    Attributes:
        name: the consumer name (host-pid-random).
        pending: entries delivered to it and not yet acknowledged.
        idle_ms: what Redis reports as its idle time, milliseconds (on Redis 7.0, since
            the last entry delivered to it: not whether it is alive).
        alive: its heartbeat has not run out (:func:`live_workers`).
    """

    name: str
    pending: int
    idle_ms: int
    alive: bool = False


@dataclass(frozen=True)
class LaneStatus:
    """One lane's stream of a stage (see :attr:`StageStatus.lanes`).

    Attributes:
        length: entries in the stream (trimmed ones excluded).
        lag: entries not yet delivered to any worker.
        pending: delivered but not yet acknowledged (in flight).
    """

    length: int = 0
    lag: int = 0
    pending: int = 0

    @property
    def backlog(self) -> int:
        """``lag + pending``, as :attr:`StageStatus.backlog` for the lane alone."""
        return self.lag + self.pending


@dataclass
class StageStatus:
    """The state of one stage: its queue, its workers and their learned cost.

    The one description of a stage's state: admission, ``/status.json``, ``/metrics``,
    ``conveyor status`` and the autoscaler all read it (see :func:`stage_status`).

    A stage has a stream per lane (:data:`~pipelines.keys.LANES`); ``length``, ``lag``
    and ``pending`` are their sums, ``lanes`` has each lane's own.

    Attributes:
        stage: the stage name.
        length: entries in the streams (trimmed ones excluded).
        lag: entries not yet delivered to any worker.
        pending: delivered but not yet acknowledged (in flight).
        consumers: the workers in the lanes' consumer groups, live or not (one per name:
            a worker reads both lanes; its pending entries are summed, its idle time is
            the shortest).
        a: the workers' learned fixed seconds per batch (0: not learned yet).
        b: their learned seconds per item (0: not learned yet).
        lanes: each lane's part (:func:`stage_status` fills in every lane).
        parked: why and until when ``conveyor up`` parked the stage's workers after a
            crash loop (None: not parked; a record past its time is dropped).
    """

    stage: str
    length: int = 0
    lag: int = 0
    pending: int = 0
    consumers: list[Consumer] = field(default_factory=list)
    a: float = 0.0
    b: float = 0.0
    lanes: dict[Lane, LaneStatus] = field(default_factory=dict)
    parked: Parked | None = None

    def lane(self, lane: Lane) -> LaneStatus:
        """``lane``'s part (empty where it was not measured)."""
        return self.lanes.get(lane, LaneStatus())

    def count(self, lane: Lane, part: LaneStatus) -> None:
        """Add ``part`` (a measure of ``lane``) to the lane's and to the stage's sums."""
        have = self.lane(lane)
        self.lanes[lane] = LaneStatus(
            have.length + part.length, have.lag + part.lag, have.pending + part.pending
        )
        self.length += part.length
        self.lag += part.lag
        self.pending += part.pending

    @property
    def backlog(self) -> int:
        """Entries the stage holds and has not finished: ``lag + pending``, the undelivered
        plus the delivered and not yet acknowledged.

        What ``max_backlog`` bounds (admission's 503) and ``--target-backlog`` divides
        (the autoscaler). Not what the gauge ``conveyor_stage_backlog`` reports: that
        metric, named before this property and read so by dashboards, is the ``lag``
        alone (KEDA's ``lagCount``); ``conveyor_stage_pending`` is the rest.
        """
        return self.lag + self.pending

    @property
    def workers(self) -> int:
        """Live workers: those whose heartbeat has not run out."""
        return sum(1 for c in self.consumers if c.alive)


async def _group_counts(
    client: aioredis.Redis, stream: str, lag_cap: int, length: int, groups: list[Any]
) -> tuple[int, int] | None:
    """(lag, pending) of the workers' group; None when it is absent.

    The lag XINFO GROUPS reports is a counter (entries added less entries read), and Redis
    7.0 can leave it stale: replaying an AOF restores the group's cursor but not its
    entries-read, so after a restart the lag may count everything ever delivered, and
    trusted it would make admission refuse a drained stage forever. So it is believed only
    when it can be true: no more than the stream holds beyond its pending entries (which
    the stream still holds; trimming never deletes them). A lag past that, or none (Redis
    < 7, or unknown after deletions), is counted instead: the entries past the group's
    last-delivered-id, at most ``lag_cap``. A stale lag within that room is not detected;
    it is bounded by the done-but-untrimmed entries, which trimming keeps few.

    Args:
        client: Redis client.
        stream: the stage stream.
        lag_cap: the most entries a count reads.
        length: the stream's XLEN, read in the same transaction as ``groups``.
        groups: XINFO GROUPS's answer.
    """
    group = next((g for g in groups if text(g["name"]) == GROUP), None)
    if group is None:
        return None
    pending = int(group["pending"])
    reported = group.get("lag")
    if reported is not None and 0 <= int(reported) <= max(0, length - pending):
        return int(reported), pending
    last = text(group["last-delivered-id"])
    past = await client.xrange(stream, min=f"({last}", max="+", count=max(1, min(lag_cap, length)))
    return min(len(past or []), length), pending


def _queue_answers(answers: list[Any]) -> tuple[int, list[Any] | None, list[Any]]:
    """XLEN, XINFO GROUPS (None: no stream yet) and XINFO CONSUMERS ([]: no group yet)
    from three answers of a pipeline run with ``raise_on_error=False``."""
    length, groups, consumers = answers
    if isinstance(length, Exception):  # XINFO's errors mean "not created yet"; this, failure
        raise length
    if isinstance(groups, ResponseError):
        groups = None
    if isinstance(consumers, ResponseError):
        consumers = []
    return int(length), groups, consumers


def _add(consumers: dict[str, Consumer], name: str, pending: int, idle: int) -> None:
    """Add a consumer to ``consumers``: one already there by that name (the same worker
    in another lane or partition) gets its pending summed and the shorter idle time."""
    seen = consumers.get(name)
    if seen is not None:
        pending, idle = seen.pending + pending, min(seen.idle_ms, idle)
    consumers[name] = Consumer(name, pending, idle)


def _merge(consumers: dict[str, Consumer], answer: list[Any]) -> None:
    """Add one lane group's XINFO CONSUMERS to ``consumers`` (by name)."""
    for c in answer:
        _add(consumers, text(c["name"]), int(c["pending"]), int(c["idle"]))


async def known_stages(client: aioredis.Redis, keys: Keys, configured: Iterable[str]) -> list[str]:
    """The stages of a namespace, sorted: those that ever had a worker, and ``configured``.

    Args:
        client: Redis client.
        keys: key names.
        configured: the stages the configured pipelines run.
    """
    ever = {text(m) for m in await client.smembers(keys.stages_set())}
    return sorted(ever | set(configured))


async def stage_status(
    client: aioredis.Redis, keys: Keys, stage: str, *, costs: bool = False, lag_cap: int = 100_000
) -> StageStatus:
    """A stage's state, summed over its partitions: each partition's lanes read in one
    round trip (more when a lag must be counted); a consumer serving several partitions
    (the same name in each) counts once; which consumers are alive, from the workers'
    heartbeats (:func:`live_workers`).

    Args:
        client: Redis client.
        keys: key names (the namespace's: every partition is read).
        stage: the stage.
        costs: also read the learned batch cost (``a``, ``b``; else 0), averaged over
            the partitions that learned it.
        lag_cap: as :func:`partition_status`.
    """
    # Partition 0 holds the parked hash and the heartbeats: read in its round trip, with
    # Redis's clock (a cluster's pipeline refuses TIME: there, a call of its own).
    cluster = isinstance(client, RedisCluster)
    head = [("hget", keys.parked(), stage), ("hgetall", keys.alive(stage))]
    head += [] if cluster else [("time",)]
    parts: list[StageStatus] = []
    found: list[Any] = []  # partition 0's answers to head
    for each in keys.each():
        part, answers = await partition_status(
            client, each, stage, costs=costs, lag_cap=lag_cap, extra=head if not parts else ()
        )
        parts.append(part)
        found = found or answers
    hget, beats, now = found if not cluster else [*found, await client.time()]
    if isinstance(now, Exception):
        raise now
    # A key forged to another type: nobody parked the stage, no worker beats.
    parked = None if isinstance(hget, ResponseError) else Parked.parse(_answer(hget))
    if parked is not None and not parked.left_s(time.time()):
        parked = None
    live = set() if isinstance(beats, ResponseError) else _live(_answer(beats), now)
    if len(parts) == 1:
        parts[0].parked = parked
        parts[0].consumers = _with_beats(parts[0].consumers, live)
        return parts[0]
    total = StageStatus(stage, parked=parked)
    consumers: dict[str, Consumer] = {}
    learned = [(p.a, p.b) for p in parts if p.a or p.b]
    if learned:
        total.a = sum(a for a, _ in learned) / len(learned)
        total.b = sum(b for _, b in learned) / len(learned)
    for part in parts:
        for lane, got in part.lanes.items():
            total.count(lane, got)
        for c in part.consumers:
            _add(consumers, c.name, c.pending, c.idle_ms)
    total.consumers = _with_beats(list(consumers.values()), live)
    return total


def _with_beats(consumers: list[Consumer], live: set[str]) -> list[Consumer]:
    """``consumers`` each marked alive or not, and the live ones not (yet) in the group
    added (a worker beats from its start; it joins the group with its first read)."""
    named = {c.name for c in consumers}
    marked = [Consumer(c.name, c.pending, c.idle_ms, c.name in live) for c in consumers]
    return marked + [Consumer(name, 0, 0, True) for name in sorted(live - named)]


async def partition_status(
    client: aioredis.Redis,
    keys: Keys,
    stage: str,
    *,
    costs: bool = False,
    lag_cap: int = 100_000,
    extra: Sequence[tuple[Any, ...]] = (),
) -> tuple[StageStatus, list[Any]]:
    """A stage's state in one partition, both lanes read in one round trip (more when a
    lag must be counted), with the ``extra`` commands in that round trip.

    Args:
        client: Redis client.
        keys: the partition's key names.
        stage: the stage.
        costs: also read the learned batch cost (``a``, ``b``; else 0): admission needs
            it, and it takes a read of the stats hash (HMGET), which not every ACL user has.
        lag_cap: where a lag must be counted (see :func:`_group_counts`), a range read
            of at most this many entries.
        extra: commands of keys in the partition's slot, each a client method's name then
            its arguments.

    Returns:
        The state, and the ``extra`` commands' answers as Redis gave them (an error as
        its exception).
    """
    streams = {lane: keys.stage_stream(stage, lane) for lane in LANES}
    # One transaction: each lag is checked against its length, so all describe one moment.
    pipe = in_order(client)
    for stream in streams.values():
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        pipe.xinfo_consumers(stream, GROUP)
    if costs:
        pipe.hmget(keys.stage_stats(stage), [COST_A, COST_B])
    for name, *args in extra:
        getattr(pipe, name)(*args)
    answers = await pipe.execute(raise_on_error=False)
    answers, found = answers[: len(answers) - len(extra)], answers[len(answers) - len(extra) :]
    a, b = None, None
    if costs:
        if isinstance(answers[-1], Exception):
            raise answers[-1]
        a, b = answers[-1]
    status = StageStatus(stage, a=float(text(a)) if a else 0.0, b=float(text(b)) if b else 0.0)
    consumers: dict[str, Consumer] = {}
    for i, (lane, stream) in enumerate(streams.items()):
        length, groups, members = _queue_answers(answers[3 * i : 3 * i + 3])
        counts = (
            None if groups is None else await _group_counts(client, stream, lag_cap, length, groups)
        )
        lag, pending = (length, 0) if counts is None else counts
        if counts is not None:
            _merge(consumers, members)
        status.count(lane, LaneStatus(length, lag, pending))
    status.consumers = list(consumers.values())
    return status, found


def _answer(value: Any) -> Any:
    """An extra command's answer; an error Redis answered it with raised (the callers
    read a ``ResponseError``, such as a key of another type, as nothing there first)."""
    if isinstance(value, Exception):
        raise value
    return value
