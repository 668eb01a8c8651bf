"""Which pipeline serves a ``model``, and how a request's items run through it.

``model`` names a pipeline: a one-step pipeline whose stage declares
``openai="embeddings"`` or ``openai="completions"`` (:data:`pipelines.stages.OpenAIKind`).
A POST route's endpoint (:func:`posted`) finds it; each item is validated by its input
model (a 400, as ``POST /v1/{name}`` would answer 422) and becomes one request through
:meth:`Gateway.call <gateway.service.Gateway.call>`; :meth:`Asked.run_all` waits for
them all.
"""

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Body, Request
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.types import Receive

from gateway.headers import Sent, sent_on
from gateway.protocol import DISCONNECT, Disconnect
from gateway.routes.openai.errors import Refused
from gateway.routes.openai.wire import ModelIn
from gateway.routes.pipelines import reply_response
from gateway.service import Gateway
from gateway.share import Shares, in_parts
from pipelines.envelope import Reply
from pipelines.errors import ConfigError, DeadlineExceeded, ItemFailed, PastDeadline
from pipelines.graph import Pipeline
from pipelines.outcomes import Outcome
from pipelines.registry import Registry
from pipelines.stages import OpenAIKind

RESERVED = ("embeddings", "completions", "chat", "models")
"""Pipeline names these routes take: ``/v1/{name}`` of a pipeline so named would be theirs."""
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


def openai_kind(pipeline: Pipeline) -> OpenAIKind | None:
    """The OpenAI route that serves ``pipeline``: its stage's marker, for a one-step one."""
    return pipeline.entry.stage.openai if len(pipeline.steps) == 1 else None


def served(gw: Gateway, model: str, kind: OpenAIKind) -> Pipeline:
    """The pipeline named ``model``, which must serve the route ``kind``.

    Raises:
        Refused: there is none (404, naming what is served), or it serves another route.
    """
    pipeline = gw.registry.pipelines.get(model)
    if pipeline is None:
        names = ", ".join(p.name for p in gw.registry.pipelines.values() if openai_kind(p))
        raise Refused(
            f"the model {model!r} does not exist here; served: {names or 'none'}",
            404,
            "model",
            "model_not_found",
        )
    if openai_kind(pipeline) != kind:
        raise Refused(f"the model {model!r} does not serve /v1/{kind}", 400, "model")
    return pipeline


def checked(
    pipeline: Pipeline,
    payload: dict[str, Any],
    param: str,
    text_is: str = "",
    params: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``payload`` validated by the pipeline's input model, as ``POST /v1/{name}``
    validates its body: refused here (400, naming the request field), not by a worker.

    Args:
        pipeline: the pipeline the request runs.
        payload: its input, as the route built it from the request.
        param: the request field it was built from.
        text_is: what the payload's ``text`` is, said after ``param`` where it is wrong
            (none: it is ``param`` itself): the route made it, the client never saw it.
        params: the request field each other payload field was taken from
            (``max_new_tokens`` from ``max_tokens``): a wrong one is refused naming that
            field, as the client spelled it, not ``param``.
    """
    try:
        valid = pipeline.input_model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        if loc and params and loc[0] in params:
            named = params[loc[0]]
            where = named + "".join(f"[{p}]" for p in loc[1:])  # stop[0]
            raise Refused(f"{where}: {first['msg']}", 400, named) from None
        field = ".".join(loc)
        if field == "text":  # built by the route from `param`: no field of the request
            field = text_is
        where = f"{param}: {field}" if field else param
        raise Refused(f"{where}: {first['msg']}", 400, param) from None
    return valid.model_dump(mode="json", exclude_unset=True)


@dataclass(frozen=True)
class Asked:
    """A request to an OpenAI-compatible POST route, its ``model`` found.

    Attributes:
        gw: the gateway that runs its items.
        pipeline: the pipeline its ``model`` names.
        sent: its headers.
        receive: its ASGI receive, the body read: the client gone cancels its items.
        shares: the windows its items take their turns in, when it has many.
        disconnect: its scope's :class:`~gateway.protocol.Disconnect`, where the server
            gives one (see :func:`~gateway.cancel.watch`).
    """

    gw: Gateway
    pipeline: Pipeline
    sent: Sent
    receive: Receive
    shares: Shares
    disconnect: Disconnect | None = None

    async def run_all(self, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each of ``payloads`` one request through the pipeline; their results in order,
        the first failure raised once those in flight ended (as ``/v1/{name}`` would
        answer it). Many are sent in parts, a share of the stage's backlog bound at a time
        (:mod:`gateway.share`), within the request's one deadline; one is one call."""
        if len(payloads) == 1:  # the common case: nothing added to the path
            request_id, reply = await self._call(payloads[0], self.sent)
            return [_result(reply, request_id)]
        gw, stage = self.gw, self.pipeline.entry.stage
        bound = gw.settings.max_backlog or stage.max_backlog  # as admission bounds it
        slots = self.shares.slots(stage.name, bound)

        budget_s = gw.timeout_for(self.sent.timeout_s)
        answered: list[int] = []  # the parts answered so far
        # A part refused with this little of the request's time left, after others were
        # answered, is the request running out of time (504), not the stage too busy.
        short_s = max(1.0, budget_s / 10)

        async def part(i: int, left_s: float) -> dict[str, Any]:
            try:
                request_id, reply = await self._call(
                    payloads[i], replace(self.sent, timeout_s=left_s)
                )
            except (DeadlineExceeded, PastDeadline) as exc:
                if isinstance(exc, PastDeadline) and (not answered or left_s > short_s):
                    raise  # time enough left: the stage is busy (a later part tries again)
                # Its own share of the time ran out, or what is left of it would, its
                # earlier parts having taken the rest: the request's deadline is spent
                # (504), said for the whole of it.
                raise DeadlineExceeded(
                    f"no result for all {len(payloads)} inputs within {budget_s:g}s "
                    "(X-Conveyor-Timeout sets the request's time)",
                    request_id=getattr(exc, "request_id", None),
                ) from None
            answered.append(i)
            return _result(reply, request_id)

        return await in_parts(part, len(payloads), slots, budget_s)

    async def _call(self, payload: dict[str, Any], sent: Sent) -> tuple[str, Reply]:
        return await self.gw.call(self.pipeline, payload, sent, self.receive, self.disconnect)


Endpoint = Callable[..., Awaitable[Response]]
"""A FastAPI endpoint."""


In = TypeVar("In", bound=ModelIn)


@dataclass(frozen=True)
class Direct(Generic[In]):
    """An OpenAI-compatible POST route as the hot path (:mod:`gateway.fastpath`) answers
    it: the same answer as :func:`posted`'s endpoint, without FastAPI's per-request
    machinery.

    Attributes:
        gw: the gateway that runs the requests.
        shares: the windows of requests of many items (the routes' own).
        wire: the route's request body.
        answer: what answers it.
    """

    gw: Gateway
    shares: Shares
    wire: type[In]
    answer: Callable[[Asked, In], Awaitable[Response]]

    def read(self, value: Any) -> tuple[In, Pipeline] | None:
        """The body (parsed JSON) read as the route reads it, with the pipeline its
        ``model`` names; None where the route would refuse it (it answers that itself)."""
        try:
            body = self.wire.model_validate(value)
            return body, served(self.gw, body.model, self.wire.kind)
        except Exception:  # invalid, or no such model: the route's answer
            return None

    async def __call__(
        self,
        body: In,
        pipeline: Pipeline,
        sent: Sent,
        receive: Receive,
        disconnect: Disconnect | None = None,
    ) -> Response:
        """The route's answer to ``body`` (read by :meth:`read`).

        Raises:
            ConveyorError: as the route raises it (answered in OpenAI's shape).
        """
        asked = Asked(self.gw, pipeline, sent, receive, self.shares, disconnect)
        return await self.answer(asked, body)


def posted(direct: Direct[Any]) -> Endpoint:
    """The FastAPI endpoint of an OpenAI-compatible POST route: its body read as
    ``direct.wire``, the pipeline its ``model`` names found (:func:`served`), then
    answered by ``direct`` (as the hot path answers what it takes).

    Args:
        direct: the route.
    """

    async def endpoint(
        http: Request, body: Any, sent: Annotated[Sent, sent_on("call")]
    ) -> Response:
        pipeline = served(direct.gw, body.model, direct.wire.kind)
        return await direct(body, pipeline, sent, http.receive, http.scope.get(DISCONNECT))

    # FastAPI reads the body model from the annotation; each route has its own.
    endpoint.__annotations__["body"] = Annotated[direct.wire, Body()]
    endpoint.__name__ = direct.answer.__name__
    return endpoint


def _result(reply: Reply, request_id: str) -> dict[str, Any]:
    if reply.outcome is Outcome.OK and isinstance(reply.result, dict):
        return reply.result
    reply_response(reply, request_id)  # raises the error this reply is
    raise ItemFailed("no result", status=502, request_id=request_id)


def usage(prompt_tokens: int, completion_tokens: int | None = None) -> dict[str, int]:
    """OpenAI's ``usage``: the prompt's tokens, the completion's where there is one, and
    their total."""
    answer = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if completion_tokens is not None:
        answer |= {"completion_tokens": completion_tokens}
        answer["total_tokens"] += completion_tokens
    return answer


def count(result: dict[str, Any], name: str, fallback: int) -> int:
    """A token count the stage's result carries (its tokenizer's), else ``fallback`` (the
    estimate of :mod:`pipelines.tokens`)."""
    value = result.get(name)
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else fallback
    )
