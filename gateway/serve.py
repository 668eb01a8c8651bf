"""One gateway process: the HTTP gateway served with uvicorn (``python -m gateway``,
:mod:`gateway.__main__`, runs :func:`main`).

With ``CONVEYOR_GATEWAYS`` above 1 this process is one of several on the same host and
port (``conveyor up --gateways N`` and ``conveyor gateway`` start them): it binds with
``SO_REUSEPORT``, so the kernel spreads new connections among them. Each reads its own
reply streams (its id is host-pid-random), so a reply reaches the process that waits.

On SIGTERM or Ctrl-C it drains (:class:`DrainingServer`): new requests get 503, those in
flight have ``CONVEYOR_DRAIN_S`` to be answered, then its port closes and it exits.
"""

from __future__ import annotations

import gc
import logging
import math
import socket

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import create_app
from gateway.protocol import header_deadline_protocol
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from pipelines.settings import load_settings
from runtime import tracing
from runtime.exits import exit_for, exit_on_config_error
from runtime.logs import configure_logging

logger = logging.getLogger(__name__)

DRAIN_MARGIN_S = 5
"""After the drain, how long uvicorn waits for the last answers to be written before it
cancels what is left (``conveyor up`` waits this long too, and more)."""

YOUNG_EVERY = 20_000
"""Allocations (less frees) of container objects between two collections of the youngest
generation once the gateway serves, against Python's 700 (and each older generation every
20 collections of the one below, against 10): a request's short-lived objects (its
futures, models, dicts) filled the young generation so often that the collector showed
in the gateway's profile under load, and this took ~9% off its CPU per request at 64
connections on echo (the A/B is in bench/RESULTS.md). Garbage in reference cycles waits
longer to be freed, and only containers count towards the threshold: a cycle that holds
large bytes (a traceback holding a request body) is freed after as many allocations as
one that holds none. (Python 3.14's incremental collector reads the older thresholds
differently.)"""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first drains the gateway (:meth:`Gateway.drain
    <gateway.service.Gateway.drain>`).

    uvicorn's own shutdown closes the port and the idle connections, then waits for the
    requests in flight, then cancels those still running (each answered with a
    plain-text 500 and logged with a traceback). Draining first, the port still open,
    means every request is answered in JSON and none is left to cancel: a new one gets
    503 + Retry-After at once (a load balancer or client tries another gateway, or
    again later), one in flight its answer, or 504 if it still waits when the drain
    ends. The port closes only then, with nothing in flight.

    With ``close_first`` (``CONVEYOR_REUSE_PORT``: a replacement listens beside it, as
    ``up --reload`` starts one) the port is closed before the drain instead: the kernel
    then hands new connections to the replacement, not to a gateway that would answer
    them 503.

    Args:
        config: uvicorn's configuration.
        gateway: the gateway the app serves.
        drain_s: how long requests in flight may take (``CONVEYOR_DRAIN_S``).
        close_first: stop listening before the drain.
    """

    def __init__(
        self, config: uvicorn.Config, gateway: Gateway, drain_s: float, close_first: bool = False
    ) -> None:
        super().__init__(config)
        self.gateway, self.drain_s, self.close_first = gateway, drain_s, close_first

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain, then shut down as uvicorn does."""
        if self.close_first:
            for server in getattr(self, "servers", []):
                server.close()
        await self.gateway.drain(self.drain_s)
        await super().shutdown(sockets)


def main() -> None:
    """Entry point of one gateway process (settings from ``CONVEYOR_*``); a bad setting
    ends it with one line and exit status 2."""
    with exit_on_config_error():
        configure_logging()
        settings = load_settings(GatewaySettings)
        tracing.configure("conveyor-gateway")  # OTEL_* variables; off unless they say
        app = create_app(settings)
    # What start-up built (modules, routes, schemas) lives as long as the process: moved
    # out of the collector's sight, a full collection no longer walks it again and again
    # under load (it showed as a tenth of the gateway's CPU on small fast requests); the
    # young generation is collected less often (YOUNG_EVERY).
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_EVERY, 20, 20)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # uvicorn's lines go through the root's handler, at its level and in its format
        # (CONVEYOR_LOG_*), not through a dictConfig of its own.
        log_config=None,
        access_log=False,
        # Never reached by a request (the drain answers each by then): this bounds only
        # the writing of the last answers.
        timeout_graceful_shutdown=math.ceil(settings.drain_s) + DRAIN_MARGIN_S,
        http=http_protocol(app, settings),
    )
    server = DrainingServer(config, app.state.gateway, settings.drain_s, settings.reuse_port)
    shared = settings.gateways > 1 or settings.reuse_port
    server.run(sockets=[shared_socket(settings.host, settings.port)] if shared else None)
    tracing.shutdown()  # the spans still batched go out
    if not server.started:  # as uvicorn.run: the port was taken, or start-up failed
        exit_for(3, f"the gateway could not start on {settings.host}:{settings.port}")


def http_protocol(app: FastAPI, settings: GatewaySettings) -> type[HttpToolsProtocol]:
    """conveyor's uvicorn protocol for ``app`` (:func:`~gateway.protocol.header_deadline_protocol`):
    the deadline and bound on a request's headers, and the plain calls it answers on the
    connection once the app has settled (:mod:`gateway.direct`)."""
    return header_deadline_protocol(
        settings.client_timeout_s,
        settings.max_header_bytes,
        lambda: getattr(app, "on_connection", None),
    )


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``: every gateway process of
    one host binds its own, and the kernel hands each new connection to one of them.
    Only processes of the same user can join (Linux), and only when all of them set it:
    a lone gateway (``CONVEYOR_GATEWAYS=1``) does not, unless ``CONVEYOR_REUSE_PORT`` says
    so (``up --reload``: a new gateway starts beside the old), so a second one started on
    its port by mistake fails as before.

    Args:
        host: the address (IPv6 when it holds a colon).
        port: the port.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        logger.error("cannot bind %s:%d: %s", host, port, exc)
        exit_for(3, f"cannot bind {host}:{port}: {exc}")
    return sock
