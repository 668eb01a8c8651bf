"""redis-py's asyncio cluster client, adapted where conveyor meets its limits (8.1).

:class:`Cluster` is what :func:`pipelines.redisio.connect` returns for a
``redis+cluster://`` URL: the same client, but a connection lost under a command raises
``ConnectionError`` (as the plain client's do), and a stream read finds its own slot.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

_CLIENT_INTERNALS = ("/redis/", "/asyncio/", "uvloop/")
"""Where in a traceback an error is redis-py's connection handling, not conveyor's."""


def _connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py's cluster client tripping over a connection closed
    under it. While a shard is down, redis-py 8.1's asyncio cluster client drops the
    node's connections while other commands are using them, and those fail with
    ``AttributeError`` (a writer already ``None``) or ``RuntimeError`` (uvloop: "the
    handler is closed") from inside its connection code (redis/redis-py#3835 is one of
    that family). And when no node answers its (re)initialisation, it raises a plain
    ``RedisClusterException``. For conveyor they are what they mean: unreachable."""
    if isinstance(exc, RedisClusterException):
        # No node answered the client's (re)initialisation: the cluster is unreachable.
        return "cannot be connected" in str(exc)
    if not isinstance(exc, AttributeError | RuntimeError | TypeError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and any(p in tb.tb_frame.f_code.co_filename for p in _CLIENT_INTERNALS)


class _ClusterPipeline(ClusterPipeline):
    """A cluster pipeline whose connection-lost slips (:func:`_connection_lost`) raise
    ``ConnectionError``."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except Exception as exc:
            if _connection_lost(exc):
                raise RedisConnectionError(f"cluster connection lost: {exc!r}") from exc
            raise


_STREAM_READS = ("XREAD", "XREADGROUP")


class Cluster(RedisCluster):
    """redis-py's cluster client, whose connection-lost slips (:func:`_connection_lost`)
    raise ``ConnectionError``, as the plain client's do, and which finds the slot of a
    stream read itself.

    redis-py 8.1 asks a server (``COMMAND GETKEYS``, a round trip, always to the same
    node) where the keys of a command with movable keys are before sending it; for
    ``XREAD`` and ``XREADGROUP``, every read of every worker and gateway, that doubled the
    round trips and loaded one node with them (``python -m bench.capacity --shards``).
    Their keys are simply the first half of what follows ``STREAMS``.
    """

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() not in _STREAM_READS:
            return int(await super()._determine_slot(command, *args))
        words = [a.upper() if isinstance(a, str) else a for a in args]
        at = next((i for i, w in enumerate(words) if w in ("STREAMS", b"STREAMS")), None)
        if at is None:
            raise RedisClusterException(f"{command} without STREAMS: {args}")
        rest = args[at + 1 :]
        slots = {self.keyslot(key) for key in rest[: len(rest) // 2]}
        if len(slots) != 1:
            raise RedisClusterException(f"{command}'s streams are not in one slot: {args}")
        return slots.pop()

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        # Called from more places than execute_command (DEL and the other commands redis-py
        # splits across slots itself), so its failure is converted here too.
        try:
            await super().initialize(*args, **kwargs)
        except Exception as exc:
            if _connection_lost(exc):
                raise RedisConnectionError(f"cluster unreachable: {exc}") from exc
            raise
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except Exception as exc:
            if _connection_lost(exc):
                raise RedisConnectionError(f"cluster connection lost: {exc!r}") from exc
            raise

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is not supported by a cluster")
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]
