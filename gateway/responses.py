"""What the gateway answers besides results: error bodies, and the statuses each route
declares in the OpenAPI document (every status it can return, with its body's schema)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from http import HTTPStatus
from typing import Any, Literal

import orjson
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from pipelines.outcomes import JobStatus

SCHEMAS = "#/components/schemas/"


def _optional(schema: dict[str, Any]) -> None:
    # Absent when unset (never null): the schema shows no ``default: null`` either.
    schema.pop("default", None)


class ErrorBody(BaseModel):
    """Every error but 422: what went wrong, and the request it concerns when there is one."""

    detail: str = Field(description="What happened and what to do about it.")
    request_id: str | SkipJsonSchema[None] = Field(
        default=None,
        description="The request's id (also the X-Request-Id header).",
        json_schema_extra=_optional,
    )


class ValidationIssue(BaseModel):
    """One reason a request was refused; the input itself is never echoed back."""

    loc: list[str | int] = Field(description='Where: ["body", "text"], ["header", ...].')
    msg: str
    type: str
    ctx: dict[str, Any] | SkipJsonSchema[None] = Field(
        default=None,
        description="Small details of the constraint (e.g. its limit).",
        json_schema_extra=_optional,
    )


class ValidationErrorBody(BaseModel):
    """422: the request does not fit the route's schema (FastAPI's shape, without input)."""

    detail: list[ValidationIssue]
    request_id: str | SkipJsonSchema[None] = Field(default=None, json_schema_extra=_optional)


class PipelineResult(BaseModel):
    """A pipeline's answer: its last step's output, a JSON object (the pipeline declares
    no ``output_model`` to say more)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": True})


class UnknownPipeline(ErrorBody):
    """404 to a ``/v1/`` path that names no pipeline: the ones there are."""

    pipelines: list[str] = Field(description="The pipelines this gateway routes.")


class Readiness(BaseModel):
    """``/readyz``: ``ready``, or (503) why not: ``redis unreachable: <what Redis or
    the connection said>``, ``draining``, ``misconfigured``."""

    status: str


class JobAccepted(BaseModel):
    """202: the job is queued; poll ``url``."""

    id: str
    status: Literal["queued"]
    url: str


class JobView(BaseModel):
    """An async job: ``queued``; ``done`` with the result the sync call returns;
    ``failed`` / ``expired`` with the error and the status the sync call would have had;
    ``cancelled`` (``DELETE``) with the error and 499."""

    id: str
    pipeline: str
    status: JobStatus
    result: Any = None
    error: str | SkipJsonSchema[None] = Field(default=None, json_schema_extra=_optional)
    http_status: int | SkipJsonSchema[None] = Field(default=None, json_schema_extra=_optional)


class JobFinished(ErrorBody):
    """409 to ``DELETE /v1/jobs/{id}``: the job had already finished; ``job`` is it now."""

    job: JobView


MODELS: tuple[type[BaseModel], ...] = (ErrorBody, ValidationErrorBody, ValidationIssue, JobFinished)
BODIES: dict[int, type[BaseModel]] = {422: ValidationErrorBody, 409: JobFinished}
"""The statuses whose body is not an :class:`ErrorBody`."""

WHY = {
    401: "A valid API key is required (checked before the body's size).",
    404: "No such job (or not yours), or a step found nothing (e.g. no article).",
    408: "The body did not arrive within CONVEYOR_CLIENT_TIMEOUT_S.",
    409: "The job had already finished (done, failed, expired or cancelled): nothing to "
    "cancel; `job` is its view.",
    413: "The body is over CONVEYOR_MAX_BODY_BYTES; nothing is enqueued.",
    422: "The request does not fit the schema, or holds what the wire cannot carry (NaN, "
    "a lone surrogate, nesting past 64); `loc` names the field.",
    500: "A step failed on this item (never a stack trace).",
    503: "Over capacity, or Redis or an upstream unreachable; retry after Retry-After.",
    504: "The deadline passed before the result.",
}


def answer(model: type[BaseModel] | None) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entry of a pipeline route's 200: ``model``'s schema (the
    pipeline's ``output_model``), else :class:`PipelineResult`."""
    return {200: {"model": model or PipelineResult, "description": "The result."}}


def declared(statuses: Iterable[int]) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route for these error statuses (JSON, whatever the route's
    own media type)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted(set(statuses)):
        model = BODIES.get(status, ErrorBody)
        schema = {"$ref": f"{SCHEMAS}{model.__name__}"}
        out[status] = {
            "description": WHY.get(status, HTTPStatus(status).phrase),
            "content": {"application/json": {"schema": schema}},
        }
    return out


def validation_issues(errors: Sequence[Any], limit: int = 32) -> list[dict[str, Any]]:
    """pydantic / FastAPI errors as a 422's ``detail``: at most ``limit`` of them, each with
    ``loc``, ``msg``, ``type`` and a small ``ctx``, never the input (which can be a MiB)."""
    out = []
    for error in errors[:limit]:
        issue: dict[str, Any] = {
            "loc": [p if isinstance(p, int) else _clip(str(p)) for p in error["loc"]],
            "msg": _clip(str(error["msg"]), 300),
            "type": str(error["type"]),
        }
        ctx = {
            k: v if isinstance(v, int | float | bool) else _clip(str(v))
            for k, v in (error.get("ctx") or {}).items()
        }
        if ctx and len(orjson.dumps(ctx)) <= 200:
            issue["ctx"] = ctx
        out.append(issue)
    return out


def _clip(text: str, limit: int = 64) -> str:
    # A loc part can be a key the client chose (an unexpected field's name): any length.
    return text if len(text) <= limit else text[: limit - 1] + "…"


def openapi_document(app: Any, api_keys: bool, open_paths: frozenset[str]) -> dict[str, Any]:
    """The app's OpenAPI document with the error schemas, and with API keys on, the two
    ways to present one, required on every path but ``open_paths``."""
    if app.openapi_schema is None:
        doc = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in MODELS:
            schema = model.model_json_schema(ref_template=SCHEMAS + "{model}")
            schema.pop("$defs", None)
            schemas.setdefault(model.__name__, schema)
        if api_keys:
            doc["components"]["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            }
            for path, operations in doc["paths"].items():
                if path not in open_paths:
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}, {"apiKey": []}]
        app.openapi_schema = doc
    return dict(app.openapi_schema)
