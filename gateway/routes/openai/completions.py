"""``POST /v1/completions`` and ``POST /v1/chat/completions``: each prompt (a chat: its
messages) ``n`` requests to a stage marked ``openai="completions"``, which takes
:class:`~pipelines.stages.GenerateIn` and is asked for its ``usage``; streamed where the
stage streams (:func:`~gateway.routes.openai.answers.streamed`)."""

from typing import Any

from fastapi.responses import Response

from gateway.routes import json_response
from gateway.routes.openai.answers import Answer, streamed
from gateway.routes.openai.errors import Refused
from gateway.routes.openai.serving import Asked, checked
from gateway.routes.openai.wire import (
    DEFAULT_MAX_TOKENS,
    MAX_INPUTS,
    ChatIn,
    CompletionsIn,
    content,
    texts,
    unsupported,
    wants_usage,
)


async def completions(asked: Asked, body: CompletionsIn) -> Response:
    """Answer ``POST /v1/completions``: each prompt ``n`` requests."""
    prompts = texts(body.prompt, "prompt")
    unsupported(echo=body.echo, logprobs=body.logprobs is not None, suffix=body.suffix is not None)
    limit = body.max_tokens or DEFAULT_MAX_TOKENS
    decoding, params = _decoding(body, "max_tokens")
    payloads = [
        checked(
            asked.pipeline,
            {"text": p, "max_new_tokens": limit, "usage": True, **decoding},
            "prompt",
            params=params,
        )
        for p in prompts
    ]
    answer = Answer("text_completion", body.model, chat=False)
    if body.stream:
        if len(payloads) > 1:
            raise Refused("stream takes one prompt", 400, "prompt")
        _one_choice(body)
        return await streamed(asked, payloads[0], answer, wants_usage(body.stream_options))
    n = body.n or 1
    if len(payloads) * n > MAX_INPUTS:
        asks = f"{len(payloads)} prompts times n={n} is {len(payloads) * n} completions"
        raise Refused(f"{asks}; at most {MAX_INPUTS}", 400, "n")
    each = _choices(payloads, n)
    return json_response(answer.whole(await asked.run_all(each), each))


async def chat(asked: Asked, body: ChatIn) -> Response:
    """Answer ``POST /v1/chat/completions``: the chat ``n`` requests."""
    unsupported(
        logprobs=bool(body.logprobs),
        # Empty ones and "none" ask for no tool call, which is what is answered.
        tools=bool(body.tools),
        tool_choice=body.tool_choice not in (None, "none"),
        functions=bool(body.functions),
        function_call=body.function_call not in (None, "none"),
    )
    messages = [{"role": m.role, "content": content(m, i)} for i, m in enumerate(body.messages)]
    limit = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    named = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    decoding, params = _decoding(body, named)
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    payload = checked(
        asked.pipeline,
        {
            "text": text or " ",
            "messages": messages,
            "max_new_tokens": limit,
            "usage": True,
            **decoding,
        },
        "messages",
        "all of them together (each as 'role: content')",
        params,
    )
    answer = Answer("chat.completion", body.model, chat=True)
    if body.stream:
        _one_choice(body)
        return await streamed(asked, payload, answer, wants_usage(body.stream_options))
    each = _choices([payload], body.n or 1)
    return json_response(answer.whole(await asked.run_all(each), each))


def _decoding(
    body: CompletionsIn | ChatIn, max_tokens: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The request's ``temperature``, ``top_p``, ``seed`` and ``stop`` (a list), those it
    gives: the generate stage's own fields (unset: the stage's decoding); and the request
    field each payload field comes from (``max_tokens``: the one the request gave), so a
    refusal names it."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": stop or None,  # [] asks for no stop, as null does
    }
    params = {name: name for name in given} | {"max_new_tokens": max_tokens}
    return {name: value for name, value in given.items() if value is not None}, params


def _one_choice(body: CompletionsIn | ChatIn) -> None:
    """Refuse a stream that asks for more than one choice."""
    if (body.n or 1) > 1:
        raise Refused("n above 1 cannot be streamed here; ask without stream", 400, "n")


def _choices(payloads: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Each payload ``n`` times, in order (choice ``i * n + j`` is the ``j``-th of payload
    ``i``), each a request of its own; one with a ``seed`` gets ``seed + j``, so their
    samples differ and the same request still gets the same texts."""
    each = []
    for payload in payloads:
        for j in range(n):
            seed = payload.get("seed")
            each.append(payload if seed is None else payload | {"seed": (seed + j) % 2**63})
    return each
