"""``POST /v1/completions`` and ``POST /v1/chat/completions``: each prompt (a chat: its
messages) one request to a stage marked ``openai="completions"``, which takes
:class:`~pipelines.stages.GenerateIn` and is asked for its ``usage``; streamed where the
stage streams (:func:`~gateway.routes.openai.answers.streamed`)."""

from fastapi.responses import Response

from gateway.routes import json_response
from gateway.routes.openai.answers import Answer, streamed
from gateway.routes.openai.errors import Refused
from gateway.routes.openai.serving import Asked, checked
from gateway.routes.openai.wire import (
    DEFAULT_MAX_TOKENS,
    ChatIn,
    CompletionsIn,
    content,
    texts,
    unsupported,
    wants_usage,
)


async def completions(asked: Asked, body: CompletionsIn) -> Response:
    """Answer ``POST /v1/completions``: each prompt one request."""
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
            asked.pipeline,
            {"text": p, "max_new_tokens": limit, "usage": True, **sampling},
            "prompt",
        )
        for p in prompts
    ]
    answer = Answer("text_completion", body.model, chat=False)
    if body.stream:
        if len(payloads) > 1:
            raise Refused("stream takes one prompt", 400, "prompt")
        return await streamed(asked, payloads[0], answer, wants_usage(body.stream_options))
    return json_response(answer.whole(await asked.run_all(payloads), payloads))


async def chat(asked: Asked, body: ChatIn) -> Response:
    """Answer ``POST /v1/chat/completions``: the chat one request."""
    unsupported(logprobs=bool(body.logprobs), stop=body.stop is not None, tools=bool(body.tools))
    messages = [{"role": m.role, "content": content(m, i)} for i, m in enumerate(body.messages)]
    limit = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    payload = checked(
        asked.pipeline,
        {
            "text": text or " ",
            "messages": messages,
            "max_new_tokens": limit,
            "usage": True,
            **_sampling(body),
        },
        "messages",
        "all of them together (each as 'role: content')",
    )
    answer = Answer("chat.completion", body.model, chat=True)
    if body.stream:
        return await streamed(asked, payload, answer, wants_usage(body.stream_options))
    return json_response(answer.whole(await asked.run_all([payload]), [payload]))


def _sampling(body: CompletionsIn | ChatIn) -> dict[str, float | int]:
    """The request's ``temperature``, ``top_p`` and ``seed``, those it gives: the generate
    stage's own fields (unset: the stage's decoding)."""
    given = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}
    return {name: value for name, value in given.items() if value is not None}
