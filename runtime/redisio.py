"""Redis connections and the failures they classify, waiting Redis out, consumer-group
setup, enqueueing a request and the shared clock."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import DefaultParser
from redis.exceptions import (
    BusyLoadingError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from pipelines.envelope import Request, encode
from pipelines.errors import ConfigError
from pipelines.keys import GROUP, Keys
from pipelines.settings import CommonSettings
from runtime.cluster import Cluster
from runtime.packing import packing, pipelined, transaction
from runtime.pool import SATURATED, Pool
from runtime.waiting import Backoff

logger = logging.getLogger(__name__)


class RedisRefused(ResponseError):
    """Redis answered, but refuses commands for now; retrying later can succeed.

    Raised for the error replies redis-py has no class of its own for: ``BUSY`` (a script
    or function has run past ``busy-reply-threshold``), ``MISCONF`` (writes stopped
    because a snapshot failed), ``NOREPLICAS`` (too few replicas acknowledge writes). It
    names them once, where a reply is parsed (:class:`_Parser`), so no caller matches
    error text.
    """


REFUSALS: dict[str, type[ResponseError]] = {
    "BUSY": RedisRefused,
    "MISCONF": RedisRefused,
    "NOREPLICAS": RedisRefused,
}
"""The error codes (a reply's first word) that :class:`RedisRefused` stands for."""


class _Parser(DefaultParser):  # type: ignore[misc,valid-type]
    """redis-py's reply parser, raising :class:`RedisRefused` for :data:`REFUSALS`."""

    EXCEPTION_CLASSES: ClassVar[dict[str, Any]] = {**DefaultParser.EXCEPTION_CLASSES, **REFUSALS}


REFUSED = (RedisRefused, OutOfMemoryError, ReadOnlyError, BusyLoadingError)
"""The refusals among :data:`REDIS_DOWN`: Redis answered and did not run the command, so
a write refused this way certainly took no effect (unlike one whose answer was lost)."""

REDIS_DOWN = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterError,
    TryAgainError,
    SlotNotCoveredError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisRefused,
)
"""The one classification of Redis failures worth retrying: Redis cannot be reached, or
answered that it refuses commands for now. Every caller handles these alike (the gateway
answers 503 + Retry-After, a worker backs off and keeps its pending entries); any other
error reply is a bug or a misconfiguration and is raised. Reachability: a connection
refused, reset or timed out, ``LOADING`` (a restarted server reading its data). A Redis
Cluster adds its own: a shard down (CLUSTERDOWN, MASTERDOWN), slots moving (TRYAGAIN), a
slot no node serves. Refusals: ``OOM`` (``maxmemory`` reached under ``noeviction``),
``READONLY`` (a replica after a failover), and :data:`REFUSALS` (``BUSY`` among them). It
includes :data:`SATURATED`, which a caller that answers clients tells apart."""


T = TypeVar("T")


async def on_live_connection(client: aioredis.Redis, call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, run once more if a pooled connection turned out dead.

    A restart of Redis leaves every pooled connection made before it dead, and the first
    command on each fails though the server is back. On such a failure the pool's idle
    connections are dropped (they are as old as the dead one) and ``call`` runs again on
    a fresh one; a second failure is Redis being down, and raises.

    Only for commands whose repeat is harmless: the first try may have run before its
    answer was lost. conveyor's writes are: a request enqueued twice runs twice but
    publishes once (its step's done marker), a publish carries a token that makes its
    repeat a no-op. A wait for a pooled connection
    (:class:`~runtime.pool.PoolExhausted`) and a timeout are not retried: no connection
    was found dead.
    """
    try:
        return await call()
    except SATURATED:
        raise
    except RedisConnectionError as exc:
        logger.warning("redis command failed on a dead connection (%s); retrying once", exc)
        # The cluster client drops a failed node's connections itself.
        if not isinstance(client, RedisCluster):
            await client.connection_pool.disconnect(inuse_connections=False)
        try:
            return await call()
        except SATURATED as again:
            # The first try may have run: this is no longer "nothing was sent".
            raise RedisConnectionError(f"{exc}; then {again}") from again


async def until_reachable(
    call: Callable[[], Awaitable[object]], what: str, stop: asyncio.Event
) -> bool:
    """Run ``call`` until Redis lets it finish, logging each failure to reach Redis and
    waiting as :class:`Backoff` does between tries; False when ``stop`` was set first.
    Any other error raises.

    Args:
        call: what needs Redis (it is run again from the start: it must be repeatable).
        what: who waits, for the log line.
        stop: ends the waiting (SIGTERM, Ctrl-C).
    """
    backoff = Backoff()
    while not stop.is_set():
        try:
            await call()
            return True
        except REDIS_DOWN as exc:
            logger.warning("%s: redis unreachable (%s); retry in %.1fs", what, exc, backoff.next_s)
            await backoff.wait(stop)
    return False


def connect(
    settings: CommonSettings, *, block_ms: int = 0, connections: int | None = None
) -> aioredis.Redis:
    """An asyncio client for ``settings.redis_url``: redis-py's cluster client for a
    ``redis+cluster://`` URL, else a plain one.

    Args:
        settings: the process's settings (URL and timeouts).
        block_ms: the longest BLOCK this client will issue; its socket timeout is set
            above it so a blocking read is not cut short, yet a dead server is noticed.
        connections: its connection bound (per node on a cluster), when more than
            ``redis_max_connections`` (a gateway's blocking reads, one per partition).
    """
    most = max(connections or 0, settings.redis_max_connections)
    timeout = settings.redis_timeout_s + block_ms / 1000.0
    if settings.cluster:
        url = settings.redis_url.replace("+cluster", "", 1)
        cluster = Cluster.from_url(
            url,
            max_connections=most,  # per node
            socket_timeout=timeout,
            socket_connect_timeout=settings.redis_timeout_s,
            health_check_interval=30,
            parser_class=_Parser,
        )
        # The cluster client takes the same commands, routing each by its keys' slot;
        # conveyor's multi-key commands keep to one partition, hence one slot.
        return cast(aioredis.Redis, cluster)
    # A blocking pool: past max_connections, a command waits (up to the timeout) for a
    # free connection instead of failing at once as the default pool does.
    pool = Pool.from_url(
        settings.redis_url,
        max_connections=most,
        timeout=settings.redis_timeout_s,
        socket_timeout=timeout,
        socket_connect_timeout=settings.redis_timeout_s,
        health_check_interval=30,
        parser_class=_Parser,
    )
    pool.connection_class = packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def in_order(client: aioredis.Redis) -> Any:
    """A pipeline for a few commands on one partition's keys that must apply in order, in
    one round trip: MULTI/EXEC on a plain client; on a cluster client, a plain pipeline,
    in order but not isolated from other clients' commands.

    redis-py's asyncio cluster transactions (8.1) run every queued command through
    ``asyncio.run`` in a thread of its own, on another event loop than the client's
    connections: slow, and broken outright when that command is the client's first
    (it connects on the wrong loop). Every caller's writes stay safe in order alone: a
    job's record and its request (a failure between the two is answered 503 and
    withdrawn), a cancellation marker then the status it was set against (a worker's
    publish checks the marker atomically in its script), a withdrawal's marker and
    deletion; and the status read (a lag is checked against a length read a moment
    apart, and counted when it cannot be true).
    """
    return client.pipeline(transaction=not isinstance(client, RedisCluster))


async def ensure_group(client: aioredis.Redis, stream: str) -> None:
    """Create the stage's consumer group (and stream) unless it exists.

    Only BUSYGROUP (the group is already there) is swallowed; anything else raises.
    """
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def agree_on_partitions(client: aioredis.Redis, keys: Keys) -> None:
    """Record the namespace's partition count if none is recorded, else check this
    process's against it.

    A process with another count would read or write other streams than the rest (a
    worker of one partition would leave two of three unread): it refuses to start.

    Raises:
        ConfigError: the namespace's recorded count differs; the message says how to
            change it.
    """
    key = keys.partition_count()
    try:
        await client.set(key, keys.partitions, nx=True)
        recorded = text(await client.get(key) or keys.partitions)
    except NoPermissionError as exc:
        # A user made from older ACL rules (no GET for the gateway): run, unchecked.
        logger.warning("partition count not checked (%s); grant SET and GET on %s", exc, key)
        return
    if recorded != str(keys.partitions):
        raise ConfigError(
            f"CONVEYOR_PARTITIONS={keys.partitions}, but namespace {keys.namespace!r} runs "
            f"with {recorded} (key {key}): set the same in every process; to change it, "
            f"drain the queues, stop every process, delete {key} and start them all anew"
        )


def group_missing(exc: ResponseError) -> bool:
    """Whether Redis refused a group command because the stream or its group is gone
    (deleted, evicted, or lost in a restart without persistence): re-create and go on."""
    message = str(exc)
    # XINFO of a stream that is gone says "no such key" (Redis 7), not NOGROUP.
    return (
        message.startswith("NOGROUP")
        or "no longer exists" in message
        or message.endswith("no such key")
    )


def enqueue(redis: aioredis.Redis, keys: Keys, request: Request) -> Awaitable[bytes | str]:
    """XADD ``request`` to its stage's stream of its lane (``Keys.stage_stream``), in the
    partition of its id (:meth:`Keys.of`).

    The one way a request is put on a stream from outside a worker (the gateway, a
    replayed dead letter, the tests); a worker's hand-overs go through its publish script.

    Args:
        redis: a client, whose command is returned to be awaited; or a pipeline or
            transaction, on which the command is queued with the rest.
        keys: the namespace's key names (any partition's).
        request: what to enqueue.
    """
    return redis.xadd(request_stream(keys, request), encode(request))


def enqueue_burst(
    redis: aioredis.Redis, keys: Keys, requests: Sequence[Request]
) -> Awaitable[list[Any]]:
    """XADD each of ``requests`` as :func:`enqueue` would, on a plain client, their replies
    read as :mod:`runtime.packing` reads them: several in one MULTI/EXEC
    (:func:`~runtime.packing.transaction`), so Redis serves a worker blocked on the stream
    once every entry is in; one alone as one XADD (:func:`~runtime.packing.pipelined`).

    Returns (awaited):
        Per request, its entry id or the error Redis refused its XADD with.
    """
    commands = []
    for request in requests:
        fields = encode(request)
        xadd: list[EncodableT] = ["XADD", request_stream(keys, request), "*"]
        for name, value in fields.items():
            xadd += (name, value)
        commands.append(xadd)
    if len(commands) == 1:
        return pipelined(redis, commands, raise_on_error=False)
    return transaction(redis, commands)


def request_stream(keys: Keys, request: Request) -> str:
    """The stage stream ``request`` is enqueued on (its partition's, its lane's)."""
    return keys.of(request.id).stage_stream(request.stage, request.lane)


class RedisClock:
    """Wall time on the Redis server's clock.

    Stream ids carry the server's arrival time in milliseconds; deadlines are set on
    the same clock, so gateway and workers on hosts with skewed clocks still agree.
    """

    def __init__(self) -> None:
        self.offset = 0.0
        self.error = math.inf  # the offset is right to within this many seconds

    async def calibrate(self, client: aioredis.Redis, samples: int = 5) -> None:
        """Measure the offset of the local clock from the server's (once at start).

        The first command on a new client also connects, which would put the server's
        reading well off the middle of the round trip; so the connection is made first,
        and of several readings the one with the shortest round trip is kept.
        """
        await client.ping()
        best = math.inf
        for _ in range(samples):
            before = time.time()
            seconds, micros = await client.time()
            after = time.time()
            if after - before < best:
                best = after - before
                self.offset = seconds + micros / 1e6 - (before + after) / 2
        self.error = best / 2

    def now(self) -> float:
        """Seconds since the epoch on the server's clock."""
        return time.time() + self.offset

    def monotonic(self, at: float) -> float:
        """The ``time.monotonic()`` at which the server's clock reads ``at`` (a deadline,
        in this process's own timers)."""
        return time.monotonic() + at - self.now()


def text(value: object) -> str:
    """A Redis reply value as ``str`` (redis-py returns bytes unless told otherwise)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_ms(entry_id: bytes | str) -> int:
    """The time (server milliseconds) that a stream id carries: its arrival time, unless
    the stream's ids ran ahead of the clock (see :func:`written_at`)."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


# Ids are not trusted for time. Redis gives an entry added with ``*`` the server's time,
# or, when the stream's last id is later (an entry added with an explicit future id, or a
# stream restored onto a host whose clock lags), that last id's time: from then on every
# id of the stream is ahead of the clock, until the clock passes it.


def written_at(entry_id: bytes | str, now: float) -> float | None:
    """When the entry was written (server clock, seconds), as its id says; None when
    the id is ahead of ``now`` (server clock): then it is no write time at all."""
    at = entry_ms(entry_id) / 1000.0
    return at if at <= now else None


def arrival(entry_id: bytes | str, now: float) -> float:
    """When the entry arrived (server clock, seconds), at the latest ``now``: what the
    id says, unless it is ahead of ``now`` (then ``now``: waits and ages stay >= 0)."""
    return min(entry_ms(entry_id) / 1000.0, now)


AHEAD_S = 1.0
"""How far ahead of the measured server clock a stream's ids must run to be reported:
past what the clock's measurement may be off by."""


class IdsAhead:
    """Notices streams whose ids run ahead of the server's clock (see :func:`written_at`)
    and says so once per stream: such a stream still serves, but its ids tell no time.

    Args:
        who: who reads the ids, for the log line (a stage, the gateway).
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.reported: set[str] = set()  # streams named once (a stage's few)

    def check(self, stream: str, entry_id: bytes | str, now: float) -> None:
        """Report ``stream`` if ``entry_id`` (one of its ids) runs ahead of ``now``."""
        ahead_s = entry_ms(entry_id) / 1000.0 - now
        if ahead_s <= AHEAD_S or stream in self.reported:
            return
        self.reported.add(stream)
        logger.warning(
            "%s: stream %s has ids %.0fs ahead of the Redis clock (an entry added with a "
            "future id, or a restore onto a host whose clock lags); its ids are not taken "
            "as times, and requests go on",
            self.who,
            stream,
            ahead_s,
        )
