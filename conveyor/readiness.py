"""When ``conveyor up`` is ready: every stage has a worker of its own that reads, and the
gateway answers on its port.

The gateway answers ``/readyz`` as soon as it reaches Redis, while the workers may still be
loading their models (seconds, on a busy machine tens of them): a first request sent then
waits, and may run out its deadline. ``up`` therefore says when it is really ready. A
worker joins its stage's consumer group with its first read, which it makes only once its
model has loaded, so a stage is ready when a consumer of one of ``up``'s own worker
processes is in its group (consumer names hold the process id; a consumer left by an
earlier run, in a Redis that outlived it, does not count). The gateway is ready when its
``/readyz`` answers 200 at :func:`gateway_url`: it has bound its port and reaches Redis
(``up`` checks the port is free before it starts anything, :func:`check_port`, so what
answers there is its own gateway).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from collections.abc import Callable, Collection

import httpx

from pipelines.errors import ConfigError
from pipelines.settings import CommonSettings
from runtime.redisio import REDIS_DOWN, connect
from runtime.status import stage_status

POLL_S = 0.25
"""How often the stages are looked at until they are ready."""


def gateway_url(host: str, port: int) -> str:
    """The base URL of a gateway listening on ``host:port``, as a browser on this machine
    opens it (a wildcard address, ``0.0.0.0`` or ``::``, as loopback)."""
    shown = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"


def check_port(host: str, port: int) -> None:
    """Raise :class:`ConfigError` unless ``host:port`` can be listened on now, bound as
    the gateway binds it (``SO_REUSEADDR``): a port taken by another server stops ``up``
    with one line before anything starts, instead of a gateway that exits after the
    workers loaded their models.

    Args:
        host: the gateway's address.
        port: its port.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "something else listens there" if exc.errno == errno.EADDRINUSE else exc
            raise ConfigError(
                f"the gateway cannot listen on {host}:{port}: {why}; stop it, or pick "
                "another port (--port, CONVEYOR_PORT)"
            ) from None


async def answers(base: str) -> bool:
    """Whether the gateway at ``base`` answers ``/readyz`` with 200."""
    try:
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:  # no proxy
            return (await client.get(f"{base}/readyz")).status_code == 200
    except httpx.HTTPError:
        return False


def ours(consumer: str, pids: Collection[int]) -> bool:
    """Whether ``consumer`` (named host-pid-random) belongs to one of ``pids``."""
    parts = consumer.rsplit("-", 2)
    return len(parts) == 3 and parts[1].isdigit() and int(parts[1]) in pids


async def waiting(
    settings: CommonSettings, stages: Collection[str], pids: Collection[int]
) -> list[str]:
    """The ``stages`` that no consumer of ``pids`` reads yet."""
    client = connect(settings)
    try:
        left = []
        for stage in stages:
            status = await stage_status(client, settings.keys, stage)
            if not any(c.alive and ours(c.name, pids) for c in status.consumers):
                left.append(stage)
        return left
    finally:
        await client.aclose()


class Readiness(threading.Thread):
    """Prints one line once every stage is read by one of ``up``'s workers and the gateway
    answers.

    Args:
        settings: where Redis is.
        stages: the stages served.
        pids: the process ids of ``up``'s workers now (asked at every look: the
            autoscaler starts its own).
        say: prints a line.
        gateway: the gateway's base URL (:func:`gateway_url`); None: not looked at.
    """

    def __init__(
        self,
        settings: CommonSettings,
        stages: Collection[str],
        pids: Callable[[], Collection[int]],
        say: Callable[[str], None],
        gateway: str | None = None,
    ) -> None:
        super().__init__(name="conveyor-readiness", daemon=True)
        self.settings, self.stages, self.pids, self.say = settings, stages, pids, say
        self.gateway = gateway
        self.started_at = time.monotonic()
        self.ready = threading.Event()
        self.stopped = threading.Event()

    async def _left(self) -> list[str]:
        """What is not ready yet: stages, and ``gateway``."""
        try:
            left = await waiting(self.settings, self.stages, self.pids())
        except REDIS_DOWN:
            left = list(self.stages)  # Redis is starting, or gone (``up`` says so)
        if self.gateway is not None and not await answers(self.gateway):
            left.append("gateway")
        return left

    def run(self) -> None:
        while not self.stopped.is_set():
            if not asyncio.run(self._left()):
                took = time.monotonic() - self.started_at
                answering = f" and the gateway answers at {self.gateway}" if self.gateway else ""
                self.say(
                    f"ready: every stage's workers have loaded their models{answering} "
                    f"({took:.1f}s)"
                )
                self.ready.set()
                return
            self.stopped.wait(POLL_S)

    def stop(self) -> None:
        """Stop looking (``up`` is stopping)."""
        self.stopped.set()
