"""``python -m gateway``: serve the HTTP gateway with uvicorn.

With ``CONVEYOR_GATEWAYS`` above 1 this process is one of several on the same host and
port (``conveyor up --gateways N`` and ``conveyor gateway`` start them): it binds with
``SO_REUSEPORT``, so the kernel spreads new connections among them. Each reads its own
reply streams (its id is host-pid-random), so a reply reaches the process that waits.
"""

from __future__ import annotations

import gc
import logging
import socket
import sys

import uvicorn

from gateway.app import create_app
from gateway.protocol import header_deadline_protocol
from gateway.settings import GatewaySettings
from pipelines.errors import exit_on_config_error
from pipelines.settings import load_settings
from runtime import tracing

logger = logging.getLogger(__name__)


def main() -> None:
    """Entry point of one gateway process (settings from ``CONVEYOR_*``); a bad setting
    ends it with one line and exit status 2."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with exit_on_config_error():
        settings = load_settings(GatewaySettings)
        tracing.configure("conveyor-gateway")  # OTEL_* variables; off unless they say
        app = create_app(settings)
    # What start-up built (modules, routes, schemas) lives as long as the process: moved
    # out of the collector's sight, a full collection no longer walks it again and again
    # under load (it showed as a tenth of the gateway's CPU on small fast requests).
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=10,
        http=header_deadline_protocol(settings.client_timeout_s, settings.max_header_bytes),
    )
    server = uvicorn.Server(config)
    shared = settings.gateways > 1
    server.run(sockets=[shared_socket(settings.host, settings.port)] if shared else None)
    tracing.shutdown()  # the spans still batched go out
    if not server.started:  # as uvicorn.run: the port was taken, or start-up failed
        sys.exit(3)


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``: every gateway process of
    one host binds its own, and the kernel hands each new connection to one of them.
    Only processes of the same user can join (Linux), and only when all of them set it:
    a lone gateway (``CONVEYOR_GATEWAYS=1``) does not, so a second one started on its
    port by mistake fails as before.

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
        sys.exit(3)
    return sock


if __name__ == "__main__":
    main()
