"""``POST /v1/completions`` and ``POST /v1/chat/completions``: each prompt (a chat: its
messages) one request to a stage marked ``openai="completions"``, which takes
:class:`~pipelines.stages.GenerateIn` and is asked for its ``usage``; streamed where the
stage streams (:func:`~gateway.routes.openai.answers.streamed`)."""

from typing import Annotated

from fastapi import Body, FastAPI, Request
from fastapi.responses import Response

from gateway.headers import Sent, sent_on
from gateway.routes import json_response
from gateway.routes.openai.answers import Answer, streamed
from gateway.routes.openai.errors import Refused, post_errors
from gateway.routes.openai.serving import checked, run_all, served
from gateway.routes.openai.wire import (
    DEFAULT_MAX_TOKENS,
    ChatIn,
    CompletionsIn,
    content,
    texts,
    unsupported,
    wants_usage,
)
from gateway.service import Gateway


def add_completion_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> None:
    """Add ``POST /v1/completions`` and ``POST /v1/chat/completions``.

    Args:
        app: the application.
        gw: the gateway that runs their requests.
        edge: the statuses the edge can answer first.
    """

    async def completions(
        http: Request,
        body: Annotated[CompletionsIn, Body()],
        sent: Annotated[Sent, sent_on("call")],
    ) -> Response:
        pipeline = served(gw, body.model, "completions")
        prompts = texts(body.prompt, "prompt")
        unsupported(
            echo=body.echo,
            logprobs=body.logprobs is not None,
            suffix=body.suffix is not None,
            stop=body.stop is not None,
        )
        limit = body.max_tokens or DEFAULT_MAX_TOKENS
        sampling = _sampling(body)
        payloads = [
            checked(
                pipeline,
                {"text": p, "max_new_tokens": limit, "usage": True, **sampling},
                "prompt",
            )
            for p in prompts
        ]
        answer = Answer("text_completion", body.model, chat=False)
        if body.stream:
            if len(payloads) > 1:
                raise Refused("stream takes one prompt", 400, "prompt")
            return await streamed(
                gw, pipeline, payloads[0], sent, answer, wants_usage(body.stream_options)
            )
        budget = gw.timeout_for(sent.timeout_s)
        results = await run_all(
            [gw.call(pipeline, p, budget, sent.trace, http.receive, sent.lane) for p in payloads]
        )
        return json_response(answer.whole(results, payloads))

    async def chat(
        http: Request,
        body: Annotated[ChatIn, Body()],
        sent: Annotated[Sent, sent_on("call")],
    ) -> Response:
        pipeline = served(gw, body.model, "completions")
        unsupported(
            logprobs=bool(body.logprobs), stop=body.stop is not None, tools=bool(body.tools)
        )
        messages = [{"role": m.role, "content": content(m, i)} for i, m in enumerate(body.messages)]
        limit = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        payload = checked(
            pipeline,
            {
                "text": text or " ",
                "messages": messages,
                "max_new_tokens": limit,
                "usage": True,
                **_sampling(body),
            },
            "messages",
        )
        answer = Answer("chat.completion", body.model, chat=True)
        if body.stream:
            return await streamed(
                gw, pipeline, payload, sent, answer, wants_usage(body.stream_options)
            )
        budget = gw.timeout_for(sent.timeout_s)
        result = await run_all(
            [gw.call(pipeline, payload, budget, sent.trace, http.receive, sent.lane)]
        )
        return json_response(answer.whole(result, [payload]))

    errors = post_errors(edge)
    for path, endpoint, summary in (
        ("/v1/completions", completions, "Completions (OpenAI-compatible)"),
        ("/v1/chat/completions", chat, "Chat completions (OpenAI-compatible)"),
    ):
        app.add_api_route(
            path, endpoint, methods=["POST"], summary=summary, tags=["openai"], responses=errors
        )


def _sampling(body: CompletionsIn | ChatIn) -> dict[str, float | int]:
    """The request's ``temperature``, ``top_p`` and ``seed``, those it gives: the generate
    stage's own fields (unset: the stage's decoding)."""
    given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}
    return {name: value for name, value in given.items() if value is not None}
