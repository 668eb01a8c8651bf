"""The gateway's routes, one module per concern: :mod:`~gateway.routes.ops` (health,
readiness, metrics, the status page), :mod:`~gateway.routes.pipelines` (each pipeline's
sync and streaming routes), :mod:`~gateway.routes.jobs` (async jobs).

What they share lives here: the JSON answer, the three request headers a client may send,
and the statuses a route that reads a body can answer.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import Header
from fastapi.responses import Response
from pydantic import WithJsonSchema

from pipelines.envelope import LANES, Lane

TIMEOUT_HEADER = "X-Conveyor-Timeout"
TRACE_HEADER = "X-Trace-Id"
PRIORITY_HEADER = "X-Conveyor-Priority"

# Absent, or a finite number > 0: the schema says exactly that (a header is never null).
Timeout = Annotated[
    float | None,
    Header(
        alias=TIMEOUT_HEADER,
        gt=0,
        allow_inf_nan=False,
        description="Deadline in seconds (capped at CONVEYOR_MAX_TIMEOUT_S).",
    ),
    WithJsonSchema({"type": "number", "exclusiveMinimum": 0}),
]
Trace = Annotated[
    str | None,
    Header(alias=TRACE_HEADER, max_length=128),
    WithJsonSchema({"type": "string", "maxLength": 128}),
]
# Absent (the route's default lane), or one of the lanes; anything else is a 422 naming it.
Priority = Annotated[
    Lane | None,
    Header(
        alias=PRIORITY_HEADER,
        description="The request's lane: `interactive` (taken first; the default of sync and "
        "streaming calls) or `bulk` (fills the batches; the default of jobs).",
    ),
    WithJsonSchema({"type": "string", "enum": list(LANES)}),
]
BODY_ERRORS = (408, 422)  # too slow, invalid (an undecodable body is a 422: gateway/body.py)


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``content`` as JSON (encoded by orjson, the envelope's own codec)."""
    return Response(orjson.dumps(content), status, headers, media_type="application/json")
