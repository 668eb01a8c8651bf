"""redis-py's asyncio cluster client, adapted where conveyor meets its limits (8.1).

:class:`Cluster` is what :func:`runtime.redisio.connect` returns for a
``redis+cluster://`` URL: the same client, but a connection lost under a command raises
``ConnectionError`` (as the plain client's do), a stream read finds its own slot, and one
node down leaves the others served (:meth:`Cluster.initialize`, :meth:`Cluster.aclose`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime.packing import packing

logger = logging.getLogger(__name__)

_IN_COMMAND: ContextVar[bool] = ContextVar("conveyor_cluster_in_command", default=False)
"""Whether this task is inside a command or pipeline of a :class:`Cluster` (where a close
of the client is redis-py asking for a refresh, :meth:`Cluster.aclose`)."""

RETRIES = 1
"""How often the client itself retries a command a node failed, each time after a refresh
of its slot map: once follows a failover or a slot move the cluster has already made.
redis-py's default is 10, each with a refresh (a ``CLUSTER SLOTS`` reply of every slot,
parsed in Python, and every node's connections recycled): a node that is down turned each
command to its slots into eleven refreshes, which every other command waited behind.
conveyor's callers retry on their own terms (``on_live_connection``, a worker's backoff)."""

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


@contextmanager
def _in_command() -> Iterator[None]:
    """Inside a command (what :meth:`Cluster.aclose` asks) for its duration, and a
    connection-lost slip (:func:`_connection_lost`) raised as ``ConnectionError``."""
    running = _IN_COMMAND.set(True)
    try:
        yield
    except Exception as exc:
        if _connection_lost(exc):
            raise RedisConnectionError(f"cluster connection lost: {exc!r}") from exc
        raise
    finally:
        _IN_COMMAND.reset(running)


class _ClusterPipeline(ClusterPipeline):
    """A cluster pipeline whose failure on one node leaves the others' connections alone
    (:meth:`Cluster.aclose`), and whose connection-lost slips (:func:`_connection_lost`)
    raise ``ConnectionError``."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        with _in_command():
            return await super().execute(raise_on_error, allow_redirections)


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only the count matters: the client retries at once, after its refresh (the backoff
        # serves its transactions, which conveyor does not use on a cluster).
        kwargs.setdefault("retry", Retry(ExponentialWithJitterBackoff(), RETRIES))
        # The cluster client takes no parser_class of its own; each node's connections
        # are built from connection_kwargs, which the startup nodes copied already.
        parser = kwargs.pop("parser_class", None)
        super().__init__(*args, **kwargs)
        if parser is not None:
            self.connection_kwargs["parser_class"] = parser
            for node in self.nodes_manager.startup_nodes.values():
                node.connection_kwargs["parser_class"] = parser
        # Every node's connections pack with hiredis (runtime/packing.py): the nodes found
        # later are made from connection_kwargs, the startup nodes were made already.
        made = self.connection_kwargs
        made["connection_class"] = packing(made.get("connection_class", Connection))
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = packing(node.connection_class)

    async def initialize(
        self,
        additional_startup_nodes_info: list[tuple[str, int]] | None = None,
        last_failed_node_name: str | None = None,
    ) -> RedisCluster:
        """Fetch the slot map, when none is held or a failure called for a refresh; and
        the command table, once.

        redis-py 8.1 also fetched the command table (``COMMAND``) at every refresh, from
        the default node, the first master of the map: the very node that had just
        failed whenever a pipeline's failure (which does not move that node to the end
        of the map) brought the refresh about. Every refresh then failed, so every
        command on every node did, until that node came back; and a failed refresh
        closed every node's connections, those in use included. The table is the same on
        every node and no failover changes it: it is fetched once, from whichever master
        answers; a failed refresh closes nothing, and the next command tries again.

        Args:
            additional_startup_nodes_info: more nodes to ask for the map.
            last_failed_node_name: the node whose failure called for this refresh (it is
                asked for the map last).
        """
        if not self._initialize:
            return self
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._initialize:
                # Also called from outside execute_command (DEL and the other commands
                # redis-py splits across slots itself), so its failure is converted here.
                try:
                    await self.nodes_manager.initialize(
                        additional_startup_nodes_info=additional_startup_nodes_info,
                        last_failed_node_name=last_failed_node_name,
                    )
                    await self._command_table()
                except Exception as exc:
                    if _connection_lost(exc):
                        raise RedisConnectionError(f"cluster unreachable: {exc}") from exc
                    raise
                self._initialize = False
        return self

    async def _command_table(self) -> None:
        """Fetch the command table unless held, from the default node or, should it not
        answer, another master; and point ``COMMAND GETKEYS`` at the default node."""
        parser = self.commands_parser
        default = self.nodes_manager.default_node
        if not parser.commands:
            masters: list[ClusterNode] = [
                default,
                *(n for n in self.get_primaries() if n != default),
            ]
            for i, node in enumerate(masters):
                try:
                    await parser.initialize(node)
                    break
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    if i == len(masters) - 1:
                        raise
                    logger.debug("command table not fetched from %s (%s)", node.name, exc)
        parser.node = default

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _in_command():
            return await super().execute_command(*args, **kwargs)

    async def aclose(self) -> None:
        """Close every connection, unless called by redis-py from inside a command: then
        only have the slot map refreshed before the next command.

        redis-py 8.1 closes the whole client to force a refresh when a pipeline meets a
        connection error or a timeout on one node, and when a node answers CLUSTERDOWN:
        every node's connections, those in use included, so each command in flight on a
        healthy node failed with it (the slips of :func:`_connection_lost`). With a node
        down, every pipeline sent to it did that again: no command on any node was safe.
        A refresh alone is what that failure calls for; the connections of the node that
        failed are dropped by the command that met the failure.
        """
        if _IN_COMMAND.get():
            self._initialize = True
            return
        await super().aclose()

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is not supported by a cluster")
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]
