"""The OpenAI-compatible routes' errors: OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, and which paths answer in it.

The app's error handlers call :func:`is_openai_path` and answer these paths with
:func:`openai_error` (or :func:`error_of`, for a :class:`~pipelines.errors.ConveyorError`):
the gateway's own statuses, except 422, which OpenAI answers as 400.
"""

from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from gateway.responses import WHY, declared
from gateway.routes import json_response
from pipelines.errors import ConveyorError, InvalidInput

PATHS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/models")
"""The OpenAI-compatible routes (and ``/v1/models/{name}`` under the last)."""
ERRORS = (400, 404, 500, 502, 503, 504)
"""What these routes answer in OpenAI's shape (the edge's 401, 408 and 413 are the gateway's)."""

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_KEPT = ("retry-after", "x-request-id")


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is one of these routes (its errors take OpenAI's shape)."""
    return path in PATHS or path.startswith("/v1/models/")


def without_422(doc: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document ``doc`` without the 422 FastAPI declares for every route with a
    body: these routes answer an invalid request 400 (:func:`openai_error`)."""
    for path in (*PATHS, "/v1/models/{name}"):
        for operation in doc.get("paths", {}).get(path, {}).values():
            operation.get("responses", {}).pop("422", None)
    return doc


def openai_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error in OpenAI's shape; a 422 is answered 400, as OpenAI does.

    Args:
        status: the gateway's status for it.
        message: what went wrong.
        param: the request field it concerns.
        code: a machine-readable code (``model_not_found``).
        headers: headers to send (``Retry-After``, ``X-Request-Id``).
    """
    status = 400 if status == 422 else status
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json_response({"error": error}, status, headers)


class Refused(ConveyorError):
    """A request these routes refuse, naming the field (``param``) and a ``code``.

    Args:
        message: what is wrong.
        status: the HTTP status (400 unless said).
        param: the request field.
        code: OpenAI's code for it.
    """

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_of(exc: ConveyorError, response: Response) -> Response:
    """``exc``, answered by the app as ``response``, in OpenAI's shape (same status and
    headers)."""
    message = str(exc)
    if isinstance(exc, InvalidInput) and exc.problems:
        first = exc.problems[0]
        message = f"{message}: {first.get('msg', '')}".rstrip(": ")
    headers = {k: v for k, v in response.headers.items() if k.lower() in _KEPT}
    return openai_error(
        exc.status,
        message,
        param=getattr(exc, "param", None),
        code=getattr(exc, "code", None),
        headers=headers,
    )


def http_error(exc: HTTPException) -> Response:
    """An HTTP exception raised on one of these routes, in OpenAI's shape."""
    return openai_error(exc.status_code, str(exc.detail))


class OpenAIErrorDetail(BaseModel):
    """What went wrong, as OpenAI says it."""

    message: str
    type: str = Field(examples=["invalid_request_error"])
    param: str | None = Field(default=None, description="The request field it concerns.")
    code: str | None = Field(default=None, examples=["model_not_found"])


class OpenAIErrorBody(BaseModel):
    """An error of the OpenAI-compatible routes."""

    error: OpenAIErrorDetail


_WHY = {
    400: "Invalid request (where conveyor's own routes answer 422), or an option this "
    "server does not support; `param` names the field.",
    404: "No such model (`code`: model_not_found).",
}


def openai_errors(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of ``statuses`` answered in OpenAI's shape."""
    return {
        s: {"model": OpenAIErrorBody, "description": _WHY.get(s, WHY.get(s, "Error."))}
        for s in statuses
    }


def post_errors(edge: list[int]) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a POST route here: the edge's (``edge``, and 408 for
    a slow body) in the gateway's shape, the rest (:data:`ERRORS`) in OpenAI's."""
    return {**declared([*edge, 408]), **openai_errors(ERRORS)}
