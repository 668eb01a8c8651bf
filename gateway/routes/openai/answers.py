"""How a completions or chat completions answer is written: whole (:meth:`Answer.whole`),
or streamed as OpenAI's Server-Sent Events (:func:`streamed`), chunk by chunk, ending in
``data: [DONE]``."""

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import Response

from gateway.routes.openai.errors import Refused
from gateway.routes.openai.serving import Asked, count, usage
from gateway.routes.pipelines import EventStream, Relay, open_stream, reply_response
from pipelines.envelope import Reply, new_request_id
from pipelines.errors import DeadlineExceeded, ItemFailed
from pipelines.outcomes import Outcome
from pipelines.tokens import CHARS_PER_TOKEN, estimate

DONE = b"data: [DONE]\n\n"
"""The event that ends a stream."""


class Answer:
    """How a completions or chat completions answer is written.

    Args:
        kind: its ``object`` (``text_completion``, ``chat.completion``).
        model: the model asked for.
        chat: a chat's (choices hold a ``message``, chunks a ``delta``).
    """

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
            prompt += count(result, "prompt_tokens", estimate(payload))
            completion += count(result, "completion_tokens", -(-len(text) // CHARS_PER_TOKEN))
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt, completion),
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


async def streamed(
    asked: Asked, payload: dict[str, Any], answer: Answer, include_usage: bool
) -> Response:
    """``payload`` sent as a streamed request (as ``POST /v1/{name}/stream``), answered as
    OpenAI's chunks (:func:`_chunks`) once its first reply came: a request that fails
    before any text (the worker refused it, its deadline passed) is answered with its
    HTTP status and an OpenAI error, and opens no stream.

    Args:
        asked: the request it is the one item of.
        payload: its one item, validated.
        answer: how its chunks are written.
        include_usage: end with a chunk holding the usage.

    Raises:
        Refused: the pipeline's stage does not stream.
        ConveyorError: the request failed before its first text.
    """
    pipeline = asked.pipeline
    if not pipeline.entry.stage.streaming:
        raise Refused(f"the model {pipeline.name!r} does not stream", 400, "stream")
    request_id, relay, ended = await open_stream(asked.gw, pipeline, payload, asked.sent)
    replies = relay.replies()
    try:
        first = await anext(replies)
        if first is None:
            raise DeadlineExceeded(f"no result within {relay.budget:g}s", request_id=request_id)
        if first.outcome != "partial" and first.outcome is not Outcome.OK:
            reply_response(first, request_id)  # raises the error it is
    except BaseException:
        ended()
        raise
    headers = {"X-Request-Id": request_id, "Cache-Control": "no-cache"}
    chunks = _chunks(relay, _again(first, replies), answer, payload, include_usage)
    return EventStream(chunks, headers=headers, ended=ended)


async def _again(first: Reply, rest: AsyncIterator[Reply | None]) -> AsyncIterator[Reply | None]:
    """``first``, then ``rest``."""
    yield first
    async for reply in rest:
        yield reply


async def _chunks(
    relay: Relay,
    replies: AsyncIterator[Reply | None],
    answer: Answer,
    payload: dict[str, Any],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """OpenAI's chunks: the text as it arrives, a last one with the finish reason (and
    one with the usage where asked), then ``[DONE]``; an error is a ``data: {"error"}``.
    What the result's text holds past what was streamed (a tail held back in case it
    became a stop string) is sent before the finish reason."""
    shown = ""
    async for reply in replies:
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
                shown += text
                yield answer.chunk(text, None)
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
        whole = result.get("generated_text")
        if isinstance(whole, str) and len(whole) > len(shown) and whole.startswith(shown):
            yield answer.chunk(whole[len(shown) :], None)
        yield answer.chunk("", _finish(result))
        if include_usage:
            text = result.get("generated_text")
            written = -(-len(text) // CHARS_PER_TOKEN) if isinstance(text, str) else 0
            used = usage(
                count(result, "prompt_tokens", estimate(payload)),
                count(result, "completion_tokens", written),
            )
            yield answer.chunk("", None, used)
        yield DONE
