"""Prompt starts reused across generations in continuous decoding
(workers/models/prefixes.py through workers/models/decoder.py): greedy answers equal the
prompt decoded alone, the cache is hit, held within its bound while it evicts, and a block
matches only with its whole prefix. The built-in tiny GPT-2 and a tiny Llama (rotary)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipelines.model import Item
from tests.support.tinyllama import tiny_llama
from workers.models.decoder import Decoder, Generation
from workers.models.hf import Generator
from workers.models.prefixes import BLOCK
from workers.models.seq2seq import Seq2SeqDecoder
from workers.settings import WorkerSettings

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into"]


@pytest.fixture(scope="module")
def gpt2(cache_dir: Path) -> Generator:
    return Generator(model="tiny:generate", device="cpu", cache_dir=str(cache_dir))


@pytest.fixture(scope="module")
def llama(gpt2: Generator, tmp_path_factory: pytest.TempPathFactory) -> Generator:
    return tiny_llama(gpt2, tmp_path_factory.mktemp("llama"))


def words(count: int, seed: int) -> str:
    return " ".join(random.Random(seed).choices(WORDS, k=count))


def opened(decoder: Decoder, items: list[Item]) -> list[Generation]:
    generations = [g for g in decoder.open(items) if not isinstance(g, BaseException)]
    assert len(generations) == len(items)
    return generations


def shared(a: list[int], b: list[int]) -> int:
    """How many tokens two prompts start with alike."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def run(decoder: Decoder, joins: dict[int, list[Generation]], bound: int | None = None) -> None:
    """Decode until every generation has ended, ``joins[step]`` joining before that step;
    with ``bound``, the cache holds at most that many positions after every prefill."""
    last = max(joins)
    for step in range(1000):
        decoder.prefill(joins.get(step, []))
        if bound is not None:
            assert decoder.prefixes is not None
            assert decoder.prefixes.held <= bound
        if not decoder.rows and step > last:
            return
        decoder.advance()
    raise AssertionError("the generations did not end")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_shared_system_prompt_is_prefilled_once_and_answers_stay_as_alone(
    model: str, request: pytest.FixtureRequest
) -> None:
    generator: Generator = request.getfixturevalue(model)
    system = words(70, seed=1)
    texts = [f"{system} {words(n, seed=10 + n)}" for n in (3, 9, 1, 14, 6)]
    texts.insert(3, words(40, seed=2))  # one that shares nothing joins beside the others
    items: list[Item] = [{"text": t, "max_new_tokens": 12} for t in texts]
    alone = [generator.generate_ids([item])[0] for item in items]
    decoder = generator.continuous_decoder(100_000)
    assert decoder is not None
    decoder.share_prefixes(4096)
    generations = opened(decoder, items)
    # The first alone; two more at step 2 (both find its start); then three together at
    # step 5: cached starts of different lengths (one none) in one prefill.
    run(decoder, {0: generations[:1], 2: generations[1:3], 5: generations[3:]})
    assert [g.ids for g in generations] == alone
    prompts = [g.prompt for g in generations]
    # Each one after the first reuses every whole block it shares with one before it,
    # all but its last token at most; the rest it prefills.
    reused = [0] + [
        min(max(shared(p, q) for q in prompts[:i]), len(p) - 1) // BLOCK * BLOCK
        for i, p in enumerate(prompts)
        if i
    ]
    if model == "gpt2":  # the tokenizer gives one token a word: the system prompt's 70
        assert reused[1] >= 64
        assert reused[3] == 0
    prefixes = decoder.prefixes
    assert prefixes is not None
    assert prefixes.reused == sum(reused) > 0
    assert prefixes.prefilled == sum(len(p) for p in prompts) - sum(reused)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_burst_sharing_a_start_prefills_it_once_between_them(
    model: str, request: pytest.FixtureRequest
) -> None:
    # Four requests of one chat arrive together (one prefill): its start, new to the
    # cache, runs once in a forward of its own, not once each; two of them share a
    # longer start still; a fifth shares nothing. Answers as alone.
    generator: Generator = request.getfixturevalue(model)
    system, more = words(50, seed=7), words(20, seed=8)
    texts = [f"{system} {words(n, seed=20 + n)}" for n in (2, 5)]
    texts += [f"{system} {more} {words(n, seed=30 + n)}" for n in (3, 7)]
    texts += [words(30, seed=9)]
    items: list[Item] = [{"text": t, "max_new_tokens": 10} for t in texts]
    alone = [generator.generate_ids([item])[0] for item in items]
    decoder = generator.continuous_decoder(100_000)
    assert decoder is not None
    decoder.share_prefixes(4096)
    generations = opened(decoder, items)
    run(decoder, {0: generations})
    assert [g.ids for g in generations] == alone
    prompts = [g.prompt for g in generations]
    pairs = [(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1 :]]

    # What the burst shares, in whole blocks (never a prompt's last token): each shared
    # block was prefilled once, and reused by every prompt that starts with it.
    def whole(p: list[int]) -> int:
        return max(min(shared(p, q), len(p) - 1, len(q) - 1) for q in prompts if q is not p)

    reused = [whole(p) // BLOCK * BLOCK for p in prompts]
    seeded = max(min(shared(a, b), len(a) - 1, len(b) - 1) // BLOCK for a, b in pairs) * BLOCK
    prefixes = decoder.prefixes
    assert prefixes is not None
    assert seeded >= 3 * BLOCK
    assert reused[-1] == 0
    assert prefixes.reused == sum(reused)
    assert prefixes.prefilled == seeded + sum(len(p) for p in prompts) - sum(reused)


def test_eviction_under_a_tiny_bound_holds_it_and_running_answers_stay_exact(
    gpt2: Generator,
) -> None:
    one, two = words(40, seed=3), words(40, seed=4)  # two system prompts, 2 blocks each
    texts = [f"{one} a", f"{one} cat sat", f"{two} dogs", f"{one} mat", f"{one} far away"]
    items: list[Item] = [{"text": t, "max_new_tokens": 30} for t in texts]
    alone = [gpt2.generate_ids([item])[0] for item in items]
    decoder = gpt2.continuous_decoder(100_000)
    assert decoder is not None
    bound = 2 * BLOCK
    decoder.share_prefixes(bound)
    generations = opened(decoder, items)
    # The second reuses the first's start; the third's start evicts it while both still
    # run; the fourth finds nothing and evicts the third's; the fifth reuses the fourth's.
    run(decoder, {i * 3: [g] for i, g in enumerate(generations)}, bound=bound)
    assert [g.ids for g in generations] == alone
    prefixes = decoder.prefixes
    assert prefixes is not None
    assert prefixes.evicted >= 4
    assert prefixes.reused == 2 * bound  # the second's and the fifth's, nothing else


def test_a_block_differing_in_one_token_mid_block_does_not_match(gpt2: Generator) -> None:
    tokens = gpt2.tokenizer
    original = words(60, seed=5).split()
    middle = BLOCK + BLOCK // 2  # a token in the second block
    # The word that holds it (the tokenizer makes one token a word, after a start token).
    index = next(
        i for i in range(60) if len(tokens(" ".join(original[: i + 1]))["input_ids"]) > middle
    )
    edited = original.copy()
    edited[index] = next(w for w in WORDS if w != original[index])
    system, text = " ".join(original), " ".join(edited)
    base, changed = tokens(system)["input_ids"], tokens(text)["input_ids"]
    assert len(base) == len(changed) >= 3 * BLOCK + 1
    assert [i for i, (a, b) in enumerate(zip(base, changed, strict=True)) if a != b] == [middle]
    items: list[Item] = [{"text": t, "max_new_tokens": 10} for t in (system, text)]
    alone = [gpt2.generate_ids([item])[0] for item in items]
    decoder = gpt2.continuous_decoder(100_000)
    assert decoder is not None
    decoder.share_prefixes(4096)
    first, second = opened(decoder, items)
    run(decoder, {0: [first], 2: [second]})
    assert [first.ids, second.ids] == alone
    prefixes = decoder.prefixes
    assert prefixes is not None
    # Only the first block matches: the second and every one after it differ in their
    # prefix, though blocks 3 on hold the same tokens.
    assert prefixes.reused == BLOCK


def test_the_setting_turns_it_off_the_default_holds_some_and_seq2seq_keeps_none(
    gpt2: Generator,
) -> None:
    assert WorkerSettings().decode_prefix_cache_tokens > 0
    decoder = gpt2.continuous_decoder(100_000)
    assert decoder is not None
    decoder.share_prefixes(0)
    assert decoder.prefixes is None
    decoder.warm_up(2)  # reuses a prompt start of its own, then leaves things as they were
    assert decoder.prefixes is None
    assert not decoder.rows
    item: Item = {"text": words(50, seed=6), "max_new_tokens": 5}
    run(decoder, {0: opened(decoder, [item]), 1: opened(decoder, [item])})
    # An encoder-decoder's decoder prefills its own way (its prompt is the encoder's): none.
    seq2seq = Seq2SeqDecoder.__new__(Seq2SeqDecoder)  # no model needed to ask
    seq2seq.share_prefixes(4096)
    assert seq2seq.prefixes is None
