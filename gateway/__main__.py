"""``python -m gateway``: serve the HTTP gateway with uvicorn."""

from __future__ import annotations

import gc
import logging

import uvicorn

from gateway.app import create_app
from gateway.protocol import header_deadline_protocol
from gateway.settings import GatewaySettings
from pipelines import tracing
from pipelines.errors import exit_on_config_error
from pipelines.settings import load_settings


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
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=10,
        http=header_deadline_protocol(settings.client_timeout_s, settings.max_header_bytes),
    )
    tracing.shutdown()  # the spans still batched go out


if __name__ == "__main__":
    main()
