"""Continuous batching of an encoder-decoder model (workers/models/seq2seq.py): summaries
whose encoder outputs and cross-attention caches join and leave the running batch with
them, each decoding the tokens ``generate()`` gives it alone. A tiny BART made from a
config (offline, random weights wide enough that every input and position decides
tokens), and the summarize stage served through a real worker, Redis and gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GenerationConfig,
    T5Config,
    T5ForConditionalGeneration,
)

from pipelines.stages import BUILTIN
from tests.helpers import Harness
from workers.models.hf import Summarizer
from workers.models.seq2seq import Seq2SeqDecoder
from workers.models.tiny import CLS_ID, PAD_ID, SEP_ID, _bert_tokenizer

WORDS = ["the", "council", "met", "on", "monday", "river", "farms", "mills", "budget", "roads"]
IDS = {"bos_token_id": CLS_ID, "eos_token_id": SEP_ID, "pad_token_id": PAD_ID}


def build(folder: Path, **generation: Any) -> str:
    """A tiny BART (random weights, seeded) and the MiniLM tokenizer in ``folder``."""
    config = BartConfig(
        vocab_size=30522,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=512,
        # Wide enough that the prompt and each position change the tokens (at BART's
        # 0.02 every prompt gives the same summary).
        init_std=0.3,
        decoder_start_token_id=CLS_ID,
        forced_eos_token_id=None,
        bos_token_id=CLS_ID,
        eos_token_id=SEP_ID,
        pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BartForConditionalGeneration(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        decoder_start_token_id=CLS_ID, **IDS, **generation
    )
    model.save_pretrained(folder)
    _bert_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory.mktemp("bart-plain"))


@pytest.fixture(scope="module")
def constrained(tmp_path_factory: pytest.TempPathFactory) -> str:
    # What distilbart-cnn's generation config sets (beams aside): the decoder applies it.
    return build(
        tmp_path_factory.mktemp("bart-constrained"),
        no_repeat_ngram_size=2,
        forced_bos_token_id=1996,
        forced_eos_token_id=SEP_ID,
    )


def summarizer(folder: str, **options: Any) -> Summarizer:
    return Summarizer(model=folder, device="cpu", cache_dir=folder, **options)


def texts(count: int, seed: int) -> list[str]:
    pick = random.Random(seed)
    return [" ".join(pick.choices(WORDS, k=pick.randint(1, 60))) for _ in range(count)]


def alone(runner: Summarizer, text: str) -> list[int]:
    """The new tokens ``generate()`` gives ``text`` alone, greedy, without the end."""
    encoding = runner.encode([text])
    with torch.inference_mode():
        output = runner.model.generate(
            input_ids=encoding["input_ids"],
            attention_mask=encoding["attention_mask"],
            max_new_tokens=runner.max_new_tokens,
            min_new_tokens=runner.min_new_tokens,
            num_beams=1,
            do_sample=False,
        )
    ids: list[int] = output[0, 1:].tolist()  # after the decoder's start token
    return ids[: ids.index(SEP_ID)] if SEP_ID in ids else ids


@pytest.mark.parametrize("kind", ["plain", "constrained"])
def test_summaries_joining_at_different_steps_are_generate_alone(
    kind: str, request: pytest.FixtureRequest
) -> None:
    runner = summarizer(request.getfixturevalue(kind), max_new_tokens=12, min_new_tokens=3)
    prompts = texts(7, seed=5)
    expected = [alone(runner, text) for text in prompts]
    assert len({tuple(ids) for ids in expected}) > 3  # the prompt decides the summary
    decoder = runner.continuous_decoder(100_000)
    assert isinstance(decoder, Seq2SeqDecoder)
    generations = [g for g in decoder.open([{"text": t} for t in prompts])]
    assert not any(isinstance(g, BaseException) for g in generations)
    pick, waiting, steps, widest = random.Random(7), list(generations), 0, 0
    while waiting or decoder.rows:
        if waiting and steps % 3 == 0:  # a few join every third step, others end
            count = pick.randint(1, 3)
            joining, waiting = waiting[:count], waiting[count:]
            decoder.prefill(joining)  # type: ignore[arg-type]
        decoder.advance()
        widest = max(widest, len(decoder.rows))
        steps += 1
    assert widest > 1  # they ran side by side
    assert [g.ids for g in generations] == expected  # type: ignore[union-attr]
    answers = [decoder.result(g) for g in generations]  # type: ignore[arg-type]
    assert answers == [runner.predict([{"text": t}])[0] for t in prompts]


def test_a_summary_that_leaves_takes_its_rows_and_the_others_go_on(plain: str) -> None:
    runner = summarizer(plain, max_new_tokens=12)
    prompts = texts(4, seed=11)
    prompts[2] = " ".join(WORDS * 8)  # the longest encoder input leaves: its columns go
    expected = [alone(runner, text) for text in prompts]
    decoder = runner.continuous_decoder(100_000)
    assert isinstance(decoder, Seq2SeqDecoder)
    first, second, third, fourth = [g for g in decoder.open([{"text": t} for t in prompts])]
    assert not isinstance(first, BaseException)
    assert not isinstance(second, BaseException)
    assert not isinstance(third, BaseException)
    assert not isinstance(fourth, BaseException)
    decoder.prefill([first, third])
    decoder.advance()
    decoder.prefill([second])
    decoder.advance()
    decoder.leave([third])
    assert third.reason == "left"
    assert len(decoder.rows) == 2
    assert decoder._encoded.shape[1] < len(third.prompt)  # its encoder columns were cut
    decoder.prefill([fourth])
    while decoder.rows:
        decoder.advance()
    assert [first.ids, second.ids, fourth.ids] == [expected[0], expected[1], expected[3]]
    assert third.ids == expected[2][: len(third.ids)]


def test_what_the_decoder_cannot_apply_decodes_in_static_batches(
    plain: str, tmp_path: Path
) -> None:
    assert summarizer(plain, num_beams=2).continuous_decoder(100_000) is None
    suppressing = build(tmp_path, suppress_tokens=[5, 6])
    assert summarizer(suppressing).continuous_decoder(100_000) is None


async def test_the_summarize_stage_decodes_continuously_with_the_answers_alone(
    harness: Harness, plain: str
) -> None:
    stage = dataclasses.replace(
        BUILTIN["summarize"],
        runner="workers.models.hf:Summarizer",
        model=plain,
        hub_model=None,
        hub_runner=None,
    )
    worker = harness.worker(stage, device="cpu", decoding="continuous")
    await worker.start()
    harness.run(worker)
    base = await harness.http_server([stage])
    prompts = texts(6, seed=13)
    runner = summarizer(plain)
    expected = [runner.predict([{"text": t}])[0] for t in prompts]
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:

        async def ask(text: str, after: float) -> dict[str, Any]:
            await asyncio.sleep(after)  # they arrive at different steps
            resp = await http.post("/v1/summarize", json={"text": text})
            assert resp.status_code == 200, resp.text
            answer: dict[str, Any] = resp.json()
            return answer

        answers = await asyncio.gather(*(ask(t, 0.02 * i) for i, t in enumerate(prompts)))
    assert answers == expected
    # Each left the running batch with its own tokens counted: the decoding loop ran it.
    assert sum(r.generated for r in worker.history) > 0


def test_a_slice_of_steps_ends_at_an_end_or_when_asked_to(plain: str) -> None:
    # What the decoding loop hands the model thread: steps until one summary ends, the
    # loop asks it to stop (a request came to join), or its time is up.
    runner = summarizer(plain, max_new_tokens=12)
    decoder = runner.continuous_decoder(100_000)
    assert isinstance(decoder, Seq2SeqDecoder)
    short, long = [g for g in decoder.open([{"text": "the council"}, {"text": "the river"}])]
    assert not isinstance(short, BaseException)
    assert not isinstance(long, BaseException)
    short.limit = 5
    decoder.prefill([short, long])
    seen: list[int] = []
    stop = threading.Event()
    ended = decoder.steps(stop, 60.0, lambda: seen.append(len(long.ids)))
    assert ended == [short]  # the slice ended with the first summary that did
    assert seen == list(range(2, 6))  # on_step after each step
    stop.set()  # asked to stop: one step, then back
    assert decoder.steps(stop, 60.0, lambda: None) == []
    assert (decoder.stepped, len(long.ids)) == (1, 6)
    stop.clear()
    decoder.steps(stop, 0.0, lambda: None)  # no time: one step
    assert decoder.stepped == 1


def test_a_t5_with_relative_positions_decodes_as_alone_too(tmp_path: Path) -> None:
    # No position table to read per row: T5's relative bias is not shifted by the
    # left padding of the self-attention cache.
    config = T5Config(
        vocab_size=30522,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        initializer_factor=3.0,  # wide enough that the prompt and positions decide
        pad_token_id=PAD_ID,
        eos_token_id=SEP_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        decoder_start_token_id=PAD_ID, pad_token_id=PAD_ID, eos_token_id=SEP_ID
    )
    model.save_pretrained(tmp_path)
    _bert_tokenizer().save_pretrained(tmp_path)
    runner = summarizer(str(tmp_path), max_new_tokens=10)
    prompts = texts(4, seed=17)
    expected = [alone(runner, text) for text in prompts]
    decoder = runner.continuous_decoder(100_000)
    assert isinstance(decoder, Seq2SeqDecoder)
    generations = [g for g in decoder.open([{"text": t} for t in prompts])]
    assert not any(isinstance(g, BaseException) for g in generations)
    decoder.prefill(generations[:1])  # type: ignore[arg-type]
    decoder.advance()
    decoder.prefill(generations[1:3])  # type: ignore[arg-type]
    decoder.advance()
    decoder.advance()
    decoder.prefill(generations[3:])  # type: ignore[arg-type]
    while decoder.rows:
        decoder.advance()
    assert [g.ids for g in generations] == expected  # type: ignore[union-attr]
