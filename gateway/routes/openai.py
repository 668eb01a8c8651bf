"""OpenAI-compatible routes: ``POST /v1/embeddings``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` (and ``GET /v1/models/{model}``).

``model`` names a pipeline: a one-step pipeline whose stage declares
``openai="embeddings"`` or ``openai="completions"`` (:data:`pipelines.stages.OpenAIKind`).
Each input becomes one request through :meth:`Gateway.call <gateway.service.Gateway.call>`
(or a streamed one, :func:`~gateway.routes.pipelines.open_stream`): the same admission,
lanes, deadlines, cancellation, API keys and limits as ``POST /v1/{name}``. Errors are
answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, by
:func:`openai_error` (the app's error handlers call it for these paths), with the
gateway's own statuses except 422, which OpenAI answers as 400.
"""

import asyncio
import base64
import math
import struct
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, Literal

import orjson
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from gateway.headers import Sent, sent_on
from gateway.responses import WHY, declared
from gateway.routes import json_response
from gateway.routes.pipelines import EventStream, Relay, open_stream, reply_response
from gateway.service import Gateway
from pipelines.envelope import Reply, new_request_id
from pipelines.errors import ConfigError, ConveyorError, InvalidInput, ItemFailed
from pipelines.graph import Pipeline
from pipelines.outcomes import Outcome
from pipelines.registry import Registry
from pipelines.stages import OpenAIKind
from pipelines.tokens import CHARS_PER_TOKEN, estimate

RESERVED = ("embeddings", "completions", "chat", "models")
"""Pipeline names these routes take: ``/v1/{name}`` of a pipeline so named would be theirs."""
PATHS = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/models")
MAX_INPUTS = 2048
"""The most texts one embeddings (or prompts one completions) request may hold, as OpenAI."""
DEFAULT_MAX_TOKENS = 16
"""A completion's ``max_tokens`` when the request gives none (OpenAI's default)."""
_ERRORS = (400, 404, 500, 502, 503, 504)
"""What these routes answer in OpenAI's shape (the edge's 401, 408 and 413 are the gateway's)."""
_FIELDS: dict[OpenAIKind, set[str]] = {
    "embeddings": {"text"},
    "completions": {"text", "max_new_tokens", "messages", "usage"},
}


def check_names(registry: Registry) -> None:
    """Refuse, at start, what these routes cannot serve as declared.

    Raises:
        ConfigError: a pipeline is named as one of these routes (:data:`RESERVED`), or a
            stage marked ``openai=...`` takes an input without the fields its route sends.
    """
    for name in RESERVED:
        if name in registry.pipelines:
            raise ConfigError(
                f"pipeline name {name!r} is taken by the OpenAI-compatible routes "
                f"(/v1/{name}...); rename the pipeline"
            )
    for pipeline in registry.pipelines.values():
        kind = openai_kind(pipeline)
        missing = sorted(_FIELDS[kind] - set(pipeline.input_model.model_fields)) if kind else []
        if missing:
            raise ConfigError(
                f"pipeline {pipeline.name!r}: its stage is marked openai={kind!r} but its "
                f"input has no {', '.join(missing)} (subclass pipelines.stages.GenerateIn)"
            )


def without_422(doc: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document ``doc`` without the 422 FastAPI declares for every route with a
    body: these routes answer an invalid request 400 (:func:`openai_error`)."""
    for path in (*PATHS, "/v1/models/{name}"):
        for operation in doc.get("paths", {}).get(path, {}).values():
            operation.get("responses", {}).pop("422", None)
    return doc


def openai_kind(pipeline: Pipeline) -> OpenAIKind | None:
    """The OpenAI route that serves ``pipeline``: its stage's marker, for a one-step one."""
    return pipeline.entry.stage.openai if len(pipeline.steps) == 1 else None


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is one of these routes (its errors take OpenAI's shape)."""
    return path in PATHS or path.startswith("/v1/models/")


_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


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


_KEPT = ("retry-after", "x-request-id")


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


def _openai_errors(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {
        s: {"model": OpenAIErrorBody, "description": _WHY.get(s, WHY.get(s, "Error."))}
        for s in statuses
    }


class _In(BaseModel):
    # Fields OpenAI defines that do not change what is answered (user, seed, penalties)
    # are ignored, so clients that send them by default still work.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200, description="A pipeline's name.")


_TEXTS = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2048},
        ],
        "description": "A text, or a list of texts (token arrays are refused, 400).",
    }
)
Texts = Annotated[Any, _TEXTS]
"""A text or a list of texts; read by :func:`_texts`, which refuses anything else with a
400 that says so (a token array included), rather than pydantic's union errors."""


class EmbeddingsIn(_In):
    """``POST /v1/embeddings``."""

    input: Texts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=1_000_000)


class CompletionsIn(_In):
    """``POST /v1/completions``."""

    prompt: Texts
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None
    stop: str | list[str] | None = None


class ChatContent(BaseModel):
    """One part of a message's content (only text parts are taken)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1, max_length=40)
    content: str | list[ChatContent] | None = None


class ChatIn(_In):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    stop: str | list[str] | None = None
    tools: list[Any] | None = None


def _served(gw: Gateway, model: str, kind: OpenAIKind) -> Pipeline:
    pipeline = gw.registry.pipelines.get(model)
    if pipeline is None:
        served = ", ".join(p.name for p in gw.registry.pipelines.values() if openai_kind(p))
        raise Refused(
            f"the model {model!r} does not exist here; served: {served or 'none'}",
            404,
            "model",
            "model_not_found",
        )
    if openai_kind(pipeline) != kind:
        raise Refused(f"the model {model!r} does not serve /v1/{kind}", 400, "model")
    return pipeline


def _texts(value: Any, param: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not items or not all(isinstance(v, str) for v in items):
        raise Refused(
            f"{param} must be a string or a non-empty list of strings "
            "(token arrays are not supported)",
            400,
            param,
        )
    if len(items) > MAX_INPUTS:
        raise Refused(f"{param} holds {len(items)} items; at most {MAX_INPUTS}", 400, param)
    return [str(v) for v in items]


def _checked(pipeline: Pipeline, payload: dict[str, Any], param: str) -> dict[str, Any]:
    """``payload`` validated by the pipeline's input model, as ``POST /v1/{name}``
    validates its body: refused here (400), not by a worker."""
    try:
        valid = pipeline.input_model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise Refused(f"{param}: {field}: {first['msg']}", 400, param) from None
    return valid.model_dump(mode="json", exclude_unset=True)


def _unsupported(**fields: bool) -> None:
    for name, given in fields.items():
        if given:
            raise Refused(f"{name} is not supported by this server", 400, name)


async def _all(calls: list[Awaitable[tuple[str, Reply]]]) -> list[dict[str, Any]]:
    """Each call's result, in order; the first failure raised once every call ended (as
    ``/v1/{name}`` would answer it)."""
    done = await asyncio.gather(*calls, return_exceptions=True)
    results = []
    for item in done:
        if isinstance(item, BaseException):
            raise item
        request_id, reply = item
        results.append(_result(reply, request_id))
    return results


def _result(reply: Reply, request_id: str) -> dict[str, Any]:
    if reply.outcome is Outcome.OK and isinstance(reply.result, dict):
        return reply.result
    reply_response(reply, request_id)  # raises the error this reply is
    raise ItemFailed("no result", status=502, request_id=request_id)


def _usage(prompt_tokens: int, completion_tokens: int | None = None) -> dict[str, int]:
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if completion_tokens is not None:
        usage |= {"completion_tokens": completion_tokens}
        usage["total_tokens"] += completion_tokens
    return usage


def _count(result: dict[str, Any], name: str, fallback: int) -> int:
    """A token count the stage's result carries (its tokenizer's), else ``fallback`` (the
    estimate of :mod:`pipelines.tokens`)."""
    value = result.get(name)
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else fallback
    )


def _vector(result: dict[str, Any], base64_: bool) -> list[float] | str:
    vector = result.get("embedding")
    if not isinstance(vector, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in vector
    ):
        raise ItemFailed("the stage answered no embedding (a list of numbers)", status=502)
    if base64_:  # OpenAI's: little-endian float32, base64
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return [float(v) for v in vector]


def add_openai_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> None:
    """Add the OpenAI-compatible routes.

    Args:
        app: the application.
        gw: the gateway that runs their requests.
        edge: the statuses the edge can answer first.
    """

    async def embeddings(
        http: Request,
        body: Annotated[EmbeddingsIn, Body()],
        sent: Annotated[Sent, sent_on("call")],
    ) -> Response:
        pipeline = _served(gw, body.model, "embeddings")
        texts = _texts(body.input, "input")
        _unsupported(dimensions=body.dimensions is not None)
        budget = gw.timeout_for(sent.timeout_s)
        results = await _all(
            [
                gw.call(pipeline, p, budget, sent.trace, http.receive, sent.lane)
                for p in [_checked(pipeline, {"text": t}, "input") for t in texts]
            ]
        )
        as_base64 = body.encoding_format == "base64"
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(r, as_base64)}
            for i, r in enumerate(results)
        ]
        tokens = sum(
            _count(r, "prompt_tokens", estimate({"text": t}))
            for r, t in zip(results, texts, strict=True)
        )
        answer = {"object": "list", "data": data, "model": body.model, "usage": _usage(tokens)}
        return json_response(answer)

    async def completions(
        http: Request,
        body: Annotated[CompletionsIn, Body()],
        sent: Annotated[Sent, sent_on("call")],
    ) -> Response:
        pipeline = _served(gw, body.model, "completions")
        prompts = _texts(body.prompt, "prompt")
        _unsupported(
            echo=body.echo,
            logprobs=body.logprobs is not None,
            suffix=body.suffix is not None,
            stop=body.stop is not None,
        )
        limit = body.max_tokens or DEFAULT_MAX_TOKENS
        payloads = [
            _checked(pipeline, {"text": p, "max_new_tokens": limit, "usage": True}, "prompt")
            for p in prompts
        ]
        shape = _Shape("text_completion", body.model, chat=False)
        if body.stream:
            if len(payloads) > 1:
                raise Refused("stream takes one prompt", 400, "prompt")
            return await _streamed(
                gw, pipeline, payloads[0], sent, shape, _wants_usage(body.stream_options)
            )
        budget = gw.timeout_for(sent.timeout_s)
        results = await _all(
            [gw.call(pipeline, p, budget, sent.trace, http.receive, sent.lane) for p in payloads]
        )
        return json_response(shape.whole(results, payloads))

    async def chat(
        http: Request,
        body: Annotated[ChatIn, Body()],
        sent: Annotated[Sent, sent_on("call")],
    ) -> Response:
        pipeline = _served(gw, body.model, "completions")
        _unsupported(
            logprobs=bool(body.logprobs), stop=body.stop is not None, tools=bool(body.tools)
        )
        messages = [
            {"role": m.role, "content": _content(m, i)} for i, m in enumerate(body.messages)
        ]
        limit = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        payload = _checked(
            pipeline,
            {"text": text or " ", "messages": messages, "max_new_tokens": limit, "usage": True},
            "messages",
        )
        shape = _Shape("chat.completion", body.model, chat=True)
        if body.stream:
            return await _streamed(
                gw, pipeline, payload, sent, shape, _wants_usage(body.stream_options)
            )
        budget = gw.timeout_for(sent.timeout_s)
        result = await _all(
            [gw.call(pipeline, payload, budget, sent.trace, http.receive, sent.lane)]
        )
        return json_response(shape.whole(result, [payload]))

    async def models() -> Response:
        data = [_model(p) for p in gw.registry.pipelines.values() if openai_kind(p)]
        return json_response({"object": "list", "data": data})

    async def model(name: str) -> Response:
        pipeline = gw.registry.pipelines.get(name)
        if pipeline is None or not openai_kind(pipeline):
            raise Refused(
                f"the model {name!r} does not exist here", 404, "model", "model_not_found"
            )
        return json_response(_model(pipeline))

    errors = {**declared([*edge, 408]), **_openai_errors(_ERRORS)}
    for path, endpoint, summary in (
        ("/v1/embeddings", embeddings, "Embeddings (OpenAI-compatible)"),
        ("/v1/completions", completions, "Completions (OpenAI-compatible)"),
        ("/v1/chat/completions", chat, "Chat completions (OpenAI-compatible)"),
    ):
        app.add_api_route(
            path, endpoint, methods=["POST"], summary=summary, tags=["openai"], responses=errors
        )
    app.add_api_route(
        "/v1/models",
        models,
        methods=["GET"],
        summary="Models (OpenAI-compatible)",
        tags=["openai"],
        responses=declared(edge),
    )
    app.add_api_route(
        "/v1/models/{name}",
        model,
        methods=["GET"],
        summary="A model (OpenAI-compatible)",
        tags=["openai"],
        responses={**declared(edge), **_openai_errors((404,))},
    )


def _model(pipeline: Pipeline) -> dict[str, Any]:
    return {"id": pipeline.name, "object": "model", "created": 0, "owned_by": "conveyor"}


def _content(message: ChatMessageIn, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise Refused(f"messages[{index}]: only text content is supported", 400, "messages")
        parts.append(part.text)
    return "".join(parts)


def _wants_usage(options: dict[str, Any] | None) -> bool:
    return bool(options and options.get("include_usage") is True)


class _Shape:
    """How a completions or chat completions answer is written."""

    def __init__(self, kind: str, model: str, *, chat: bool) -> None:
        self.kind, self.model, self.chat = kind, model, chat
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + new_request_id()

    def _choice(
        self, index: int, text: str, finish: str | None, delta: bool = False
    ) -> dict[str, Any]:
        if not self.chat:
            return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        key = "delta" if delta else "message"
        return {"index": index, key: message, "logprobs": None, "finish_reason": finish}

    def whole(
        self, results: list[dict[str, Any]], payloads: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The answer to a request that did not stream."""
        choices, prompt, completion = [], 0, 0
        for index, (result, payload) in enumerate(zip(results, payloads, strict=True)):
            text = result.get("generated_text")
            if not isinstance(text, str):
                raise ItemFailed("the stage answered no generated_text", status=502)
            choices.append(self._choice(index, text, _finish(result)))
            prompt += _count(result, "prompt_tokens", estimate(payload))
            completion += _count(result, "completion_tokens", -(-len(text) // CHARS_PER_TOKEN))
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(prompt, completion),
        }

    def chunk(self, text: str, finish: str | None, usage: dict[str, int] | None = None) -> bytes:
        """One streamed chunk as a Server-Sent Event (``usage`` alone: no choices)."""
        kind = "chat.completion.chunk" if self.chat else self.kind
        choices = [] if usage is not None else [self._choice(0, text, finish, delta=True)]
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _finish(result: dict[str, Any]) -> str:
    return "length" if result.get("finish_reason") == "length" else "stop"


DONE = b"data: [DONE]\n\n"


async def _streamed(
    gw: Gateway,
    pipeline: Pipeline,
    payload: dict[str, Any],
    sent: Sent,
    shape: _Shape,
    include_usage: bool,
) -> Response:
    if not pipeline.entry.stage.streaming:
        raise Refused(f"the model {pipeline.name!r} does not stream", 400, "stream")
    request_id, relay, ended = await open_stream(gw, pipeline, payload, sent)
    headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache"}
    return EventStream(_chunks(relay, shape, payload, include_usage), headers=headers, ended=ended)


async def _chunks(
    relay: Relay, shape: _Shape, payload: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    """OpenAI's chunks: the text as it arrives, a last one with the finish reason (and
    one with the usage where asked), then ``[DONE]``; an error is a ``data: {"error"}``."""
    async for reply in relay.replies():
        if reply is None:
            body = {"message": f"no result within {relay.budget:g}s", "type": "server_error"}
            yield (
                b"data: "
                + orjson.dumps({"error": {**body, "param": None, "code": "timeout"}})
                + b"\n\n"
            )
            return
        if reply.outcome == "partial":
            text = reply.result.get("text") if isinstance(reply.result, dict) else None
            if isinstance(text, str) and text:
                yield shape.chunk(text, None)
            continue
        if reply.outcome is not Outcome.OK or not isinstance(reply.result, dict):
            status = reply.http_status
            error = {
                "message": reply.error or "failed",
                "type": "server_error" if status >= 500 else "invalid_request_error",
                "param": None,
                "code": None,
            }
            yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
            return
        result = reply.result
        yield shape.chunk("", _finish(result))
        if include_usage:
            text = result.get("generated_text")
            written = -(-len(text) // CHARS_PER_TOKEN) if isinstance(text, str) else 0
            usage = _usage(
                _count(result, "prompt_tokens", estimate(payload)),
                _count(result, "completion_tokens", written),
            )
            yield shape.chunk("", None, usage)
        yield DONE
