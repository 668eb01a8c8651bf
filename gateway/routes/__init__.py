"""The gateway's routes, one module per concern: :mod:`~gateway.routes.ops` (health,
readiness, metrics, the status page), :mod:`~gateway.routes.pipelines` (each pipeline's
sync and streaming routes), :mod:`~gateway.routes.jobs` (async jobs).

What they share lives here: the JSON answer and the statuses a route that reads a body
can answer (the request headers are declared in :mod:`gateway.headers`).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

BODY_ERRORS = (408, 422)  # too slow, invalid (an undecodable body is a 422: gateway/body.py)


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``content`` as JSON (encoded by orjson, the envelope's own codec)."""
    return Response(orjson.dumps(content), status, headers, media_type="application/json")
