"""The OpenAI options the completions routes serve beyond the basics: ``stop``, ``n``, chat
on a tokenizer without a chat template, errors before a stream's first byte as HTTP
statuses, refusals naming the OpenAI parameter, and tool calling refused by name. Called by
the real ``openai`` client (and LangChain's ``ChatOpenAI`` where installed) against a real
gateway on loopback, real workers with the built-in tiny GPT-2, and a real Redis."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from pipelines.stages import BUILTIN, Stage
from tests.helpers import Harness

GENERATE = BUILTIN["generate"]
# A stage that allows at most 4 new tokens: the worker, not the gateway, refuses more.
SHORT = replace(GENERATE, name="short", options={"max_new_tokens": 4, "max_new_tokens_limit": 4})
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def _serve(harness: Harness, stages: list[Stage], decoding: str = "continuous") -> str:
    workers = [harness.worker(s, device="cpu", threads=1, decoding=decoding) for s in stages]
    await asyncio.gather(*(w.start() for w in workers))
    for w in workers:
        harness.run(w)
    return await harness.http_server(stages)


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.mark.parametrize("decoding", ["continuous", "static"])
async def test_stop_ends_the_text_before_it_and_a_stream_never_shows_it(
    harness: Harness, decoding: str
) -> None:
    # Before: `stop` was refused (400).
    base = await _serve(harness, [GENERATE], decoding)
    async with _client(base) as client:
        asked: Any = {"model": "generate", "prompt": "Once upon", "max_tokens": 12}
        full = (await client.completions.create(**asked)).choices[0].text
        # Cut across tokens, where the text repeats what came before (its start is held
        # back while a stream cannot yet tell).
        stop = full[-6:]
        expected = full[: full.find(stop)]
        assert expected != full
        for given in (stop, [stop, "never-in-it"]):
            done = await client.completions.create(**asked, stop=given)
            assert done.choices[0].text == expected
            assert done.choices[0].finish_reason == "stop"
            chunks = [
                c async for c in await client.completions.create(**asked, stop=given, stream=True)
            ]
            texts = [c.choices[0].text for c in chunks if c.choices]
            assert "".join(texts) == expected
            shown = ""
            for text in texts:
                shown += text
                assert stop not in shown
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        with pytest.raises(openai.BadRequestError) as many:
            await client.completions.create(**asked, stop=["a", "b", "c", "d", "e"])
        assert many.value.body["param"] == "stop"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as empty:
            await client.completions.create(**asked, stop=[""])
        assert empty.value.body["param"] == "stop"  # type: ignore[index]


async def test_n_choices_are_requests_of_their_own_gathered(harness: Harness) -> None:
    # Before: n above 1 was refused.
    base = await _serve(harness, [GENERATE])
    async with _client(base) as client:
        asked: Any = {"model": "generate", "prompt": "Once upon", "max_tokens": 8}
        one = await client.completions.create(**asked, temperature=1.0, seed=5)
        three = await client.completions.create(**asked, temperature=1.0, seed=5, n=3)
        assert [c.index for c in three.choices] == [0, 1, 2]
        assert three.choices[0].text == one.choices[0].text  # the first keeps the seed
        assert len({c.text for c in three.choices}) > 1  # the others differ
        assert one.usage is not None
        assert three.usage is not None
        assert three.usage.prompt_tokens == 3 * one.usage.prompt_tokens
        assert three.usage.total_tokens == three.usage.prompt_tokens + (
            three.usage.completion_tokens
        )
        again = await client.completions.create(**asked, temperature=1.0, seed=5, n=3)
        assert [c.text for c in again.choices] == [c.text for c in three.choices]
        greedy = await client.completions.create(**{**asked, "prompt": ["a", "b"]}, n=2)
        assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
        assert greedy.choices[0].text == greedy.choices[1].text  # greedy: the same text
        with pytest.raises(openai.BadRequestError) as nine:
            await client.completions.create(**asked, n=9)
        assert nine.value.body["param"] == "n"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as streamed:
            await client.completions.create(**asked, n=2, stream=True)
        assert streamed.value.body["param"] == "n"  # type: ignore[index]
        messages: Any = [{"role": "user", "content": "Hello there"}]
        chat = await client.chat.completions.create(
            model="generate", messages=messages, max_tokens=3, temperature=1.0, seed=1, n=2
        )
        assert [c.index for c in chat.choices] == [0, 1]
        assert all(c.message.role == "assistant" for c in chat.choices)


async def test_a_chat_to_a_tokenizer_without_a_chat_template_takes_the_default(
    harness: Harness,
) -> None:
    # Before: a 400 ("this model's tokenizer has no chat template").
    base = await _serve(harness, [GENERATE])
    messages: Any = [{"role": "user", "content": "Hello there"}]
    async with _client(base) as client:
        chat = await client.chat.completions.create(
            model="generate", messages=messages, max_tokens=3
        )
        assert chat.choices[0].message.role == "assistant"
        # The default template: a "role: content" line a message, then "assistant:".
        plain = await client.completions.create(
            model="generate", prompt="user: Hello there\nassistant:", max_tokens=3
        )
        assert chat.choices[0].message.content == plain.choices[0].text
        assert chat.usage is not None
        assert plain.usage is not None
        assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
        stream = await client.chat.completions.create(
            model="generate", messages=messages, max_tokens=3, stream=True
        )
        deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(deltas) == plain.choices[0].text


async def test_a_stream_refused_before_its_first_byte_is_an_http_error(harness: Harness) -> None:
    # Before: HTTP 200 and an error event (the worker refuses more than 4 tokens).
    base = await _serve(harness, [SHORT])
    messages: Any = [{"role": "user", "content": "Hello there"}]
    async with _client(base) as client:
        with pytest.raises(openai.BadRequestError) as early:
            await client.completions.create(model="short", prompt="x", max_tokens=10, stream=True)
        assert "max_new_tokens" in early.value.message
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="short", messages=messages, max_tokens=10, stream=True
            )
        fine = await client.completions.create(model="short", prompt="x", max_tokens=4, stream=True)
        assert [c async for c in fine]
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        body = {"model": "short", "prompt": "x", "max_tokens": 10, "stream": True}
        resp = await http.post("/v1/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_a_refusal_names_the_openai_parameter(harness: Harness) -> None:
    # Refused by the gateway: no worker needed. Before: "prompt: max_new_tokens: ...",
    # param "prompt" (the stage's field, which the client never sent).
    base = await harness.http_server([GENERATE])
    messages: Any = [{"role": "user", "content": "Hello there"}]
    async with _client(base) as client:
        with pytest.raises(openai.BadRequestError) as big:
            await client.completions.create(model="generate", prompt="x", max_tokens=100_000)
        assert big.value.body["param"] == "max_tokens"  # type: ignore[index]
        assert big.value.body["message"].startswith("max_tokens: ")  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as chat_big:
            await client.chat.completions.create(
                model="generate", messages=messages, max_completion_tokens=100_000
            )
        assert chat_big.value.body["param"] == "max_completion_tokens"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as hot:
            await client.completions.create(model="generate", prompt="x", temperature=3)
        assert hot.value.body["param"] == "temperature"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as long_stop:
            await client.completions.create(model="generate", prompt="x", stop=["x" * 201])
        assert long_stop.value.body["param"] == "stop"  # type: ignore[index]
        assert long_stop.value.body["message"].startswith("stop[0]: ")  # type: ignore[index]


async def test_tool_calling_is_refused_naming_the_parameter(harness: Harness) -> None:
    # Before: tool_choice and functions were ignored (an answer without tool calls).
    base = await harness.http_server([GENERATE])
    messages: Any = [{"role": "user", "content": "Hello there"}]
    async with _client(base) as client:
        for option in (
            {"tools": [TOOL]},
            {"tool_choice": "auto"},
            {"functions": [TOOL["function"]]},
            {"function_call": "auto"},
        ):
            with pytest.raises(openai.BadRequestError) as tools:
                await client.chat.completions.create(
                    model="generate", messages=messages, max_tokens=3, **option
                )
            (name,) = option
            assert tools.value.body["param"] == name  # type: ignore[index]
            assert "not supported" in tools.value.body["message"]  # type: ignore[index]


async def test_langchain_chat_openai(harness: Harness) -> None:
    chat_models = pytest.importorskip("langchain_openai")
    base = await _serve(harness, [GENERATE])
    async with _client(base) as client:
        messages: Any = [{"role": "user", "content": "Hello there"}]
        direct = await client.chat.completions.create(
            model="generate", messages=messages, max_tokens=6
        )
        full = direct.choices[0].message.content
        assert full
    async with httpx.AsyncClient(timeout=60) as http:  # closed here, not left to the GC
        llm = chat_models.ChatOpenAI(
            model="generate",
            base_url=f"{base}/v1",
            api_key="unused",
            max_tokens=6,
            max_retries=0,
            http_async_client=http,
        )
        said = await llm.ainvoke("Hello there")
        assert said.content == full
        streamed = "".join([str(c.content) async for c in llm.astream("Hello there")])
        assert streamed == full
        stop = full[-3:]
        cut = await llm.ainvoke("Hello there", stop=[stop])
        assert cut.content == full[: full.find(stop)]
