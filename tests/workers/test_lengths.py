"""Length-aware batching: a window's entries run as batches of similar length (real Redis)."""

from __future__ import annotations

import itertools
import threading
from typing import cast

import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pipelines.envelope import FIELD, decode_replies
from pipelines.model import Item, Result
from pipelines.stages import Stage
from pipelines.tokens import COST, estimate
from tests.helpers import Harness
from workers.lengths import Lengths as Splitter
from workers.lengths import cuts
from workers.policy import FLAT_OVERHEAD_TOKENS, OVERHEAD_PRIOR_TOKENS, BatchPolicy
from workers.values import Entry


class TextIn(BaseModel):
    text: str


class Lengths:
    """Records the texts of every batch; answers each with its length. ``max_length``
    caps the estimate as a Hugging Face runner's input cap does."""

    def __init__(self, max_length: int | None = None) -> None:
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()
        if max_length is not None:
            self.max_length = max_length

    def predict(self, items: list[Item]) -> list[Result]:
        with self.lock:
            self.batches.append([i["text"] for i in items])
        return [{"n": len(i["text"])} for i in items]


def text_stage(**options: object) -> Stage:
    return Stage("lens", TextIn, runner="tests.workers.test_lengths:Lengths", **options)  # type: ignore[arg-type]


async def entries_of(redis: aioredis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(stream))


def words(n: int, tag: str) -> str:
    return " ".join([tag] * n)


def group_cost(tokens: list[int], ends: list[int], overhead: float) -> float:
    cost, begin = 0.0, 0
    for end in ends:
        cost += overhead + (end - begin) * tokens[end - 1]
        begin = end
    return cost


def feasible(tokens: list[int], ends: list[int], max_tokens: int) -> bool:
    begin = 0
    for end in ends:
        if end - begin > 1 and (end - begin) * tokens[end - 1] > max_tokens:
            return False
        begin = end
    return True


def test_one_long_text_among_short_ones_goes_alone() -> None:
    tokens = [10] * 31 + [400]
    assert cuts(tokens, 8192, 32.0) == [31, 32]
    # Uniform lengths: one batch (a cut would only add a batch's overhead).
    assert cuts([20] * 32, 8192, 32.0) == [32]


def test_the_token_bound_holds_for_every_group_of_more_than_one() -> None:
    ends = cuts([100] * 10, 300, 1000.0)  # overhead favours few groups; the bound splits
    assert feasible([100] * 10, ends, 300)
    sizes = [end - begin for begin, end in zip([0, *ends], ends, strict=False)]
    assert sorted(sizes) == [1, 3, 3, 3]
    assert cuts([500, 600], 300, 1000.0) == [1, 2]  # each longer than the bound: alone


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=8),
    st.integers(1, 2000),
    st.floats(0, 500),
)
def test_cuts_are_the_cheapest_feasible_split(
    lengths: list[int], max_tokens: int, overhead: float
) -> None:
    tokens = sorted(lengths)
    n = len(tokens)
    ends = cuts(tokens, max_tokens, overhead)
    assert ends[-1] == n
    assert ends == sorted(set(ends))
    assert feasible(tokens, ends, max_tokens)
    # Every other way to cut the sorted run is no cheaper (exhaustive for n <= 8).
    best = min(
        group_cost(tokens, [*inner, n], overhead)
        for k in range(n)
        for inner in itertools.combinations(range(1, n), k)
        if feasible(tokens, [*inner, n], max_tokens)
    )
    assert group_cost(tokens, ends, overhead) <= best + 1e-6


async def test_a_window_runs_as_batches_of_similar_length(harness: Harness) -> None:
    model = Lengths()
    texts = [words(3, f"s{i}") for i in range(6)]
    texts[2] = words(300, "long")  # one long text, arriving third
    texts[4] = words(280, "long")
    await harness.enqueue("lens", [{"text": t} for t in texts])
    worker = harness.worker(text_stage(max_batch_size=32, max_batch_tokens=8192), model)
    assert await worker.run(burst=True) == 2
    short, long = model.batches
    # The short ones together, first, in arrival order; the two long ones together.
    assert short == [texts[0], texts[1], texts[3], texts[5]]
    assert long == [texts[2], texts[4]]
    replies = [
        one
        for _, f in await entries_of(harness.redis, harness.keys.reply_stream("test"))
        for one in decode_replies(f)
    ]
    assert sorted(r.result["n"] for r in replies if r.result) == sorted(map(len, texts))
    stats = await harness.stats("lens")
    one_batch = 6 * max(estimate({"text": t}) for t in texts)
    assert stats["padded_tokens"] < one_batch / 2  # grouping saved at least half the padding
    assert stats["tokens"] == sum(estimate({"text": t}) for t in texts)


async def test_item_count_batching_when_the_token_bound_is_off(harness: Harness) -> None:
    model = Lengths()
    texts = [words(3, "a"), words(300, "long"), words(3, "b")]
    await harness.enqueue("lens", [{"text": t} for t in texts])
    stage = text_stage(max_batch_size=32, max_batch_tokens=8192)
    worker = harness.worker(stage, model, max_batch_tokens=0)  # CONVEYOR_MAX_BATCH_TOKENS=0
    assert await worker.run(burst=True) == 1
    assert model.batches == [texts]
    stats = await harness.stats("lens")
    # Still measured: three items padded to the longest.
    assert stats["padded_tokens"] == 3 * estimate({"text": texts[1]})


async def test_the_model_input_cap_bounds_the_estimate(harness: Harness) -> None:
    # Two texts far past the model's 16-token cap: it truncates both to 16, so they cost the
    # same and share a batch with the short ones (no padding to save by splitting).
    model = Lengths(max_length=16)
    texts = [words(40, "x"), words(400, "y"), words(60, "z")]
    await harness.enqueue("lens", [{"text": t} for t in texts])
    worker = harness.worker(text_stage(max_batch_tokens=8192), model)
    await worker.start()
    assert await worker.run(burst=True) == 1
    assert model.batches == [texts]
    assert (await harness.stats("lens"))["padded_tokens"] == 3 * 16


async def test_every_request_entry_carries_its_estimate(harness: Harness) -> None:
    (request,) = await harness.enqueue("lens", [{"text": "twelve chars"}])
    ((_, fields),) = await entries_of(harness.redis, harness.keys.stage_stream("lens"))
    assert int(fields[COST]) == estimate(request.payload) == 3 + 2


async def test_an_entry_without_an_estimate_is_estimated_from_its_envelope(
    harness: Harness,
) -> None:
    # A join's entry is written by the publish script, without the field.
    model = Lengths()
    (short,) = await harness.enqueue("lens", [{"text": "hi"}])
    (long,) = await harness.enqueue("lens", [{"text": words(400, "w")}])
    stream = harness.keys.stage_stream("lens")
    for entry_id, fields in await entries_of(harness.redis, stream):
        await harness.redis.xdel(stream, entry_id)
        await harness.redis.xadd(stream, {FIELD: fields[FIELD]})  # no COST field
    worker = harness.worker(text_stage(max_batch_tokens=8192), model)
    assert await worker.run(burst=True) == 2
    assert model.batches == [[short.payload["text"]], [long.payload["text"]]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=40), st.integers(1, 10_000))
def test_a_split_runs_every_entry_once_each_group_in_arrival_order(
    chars: list[int], max_tokens: int
) -> None:
    entries = [
        Entry(f"{i}-0".encode(), {FIELD: b"{}", COST: str(-(-c // 4) + 2).encode()}, "s")
        for i, c in enumerate(chars)
    ]
    groups = Splitter(max_tokens, lambda: 32.0, lambda: None).split(entries)
    assert sorted(e.id for g in groups for e in g) == sorted(e.id for e in entries)
    for group in groups:
        assert group == sorted(group, key=entries.index)


async def test_hostile_estimates_in_entries_neither_crash_nor_lose_them(harness: Harness) -> None:
    # The estimate field is only a hint: any foreign value in it falls back to the
    # envelope's length, a huge one only sends its entry alone.
    model = Lengths()
    requests = await harness.enqueue("lens", [{"text": f"t{i}"} for i in range(5)])
    stream = harness.keys.stage_stream("lens")
    hostile = [b"-5", b"abc", b"99999999999999999999999", b"", "\u0663".encode()]
    for (entry_id, fields), value in zip(
        await entries_of(harness.redis, stream), hostile, strict=True
    ):
        await harness.redis.xdel(stream, entry_id)
        await harness.redis.xadd(stream, {FIELD: fields[FIELD], COST: value})
    worker = harness.worker(text_stage(max_batch_tokens=64), model)
    await worker.run(burst=True)
    assert sorted(t for batch in model.batches for t in batch) == sorted(
        r.payload["text"] for r in requests
    )
    answered = await entries_of(harness.redis, harness.keys.reply_stream("test"))
    assert len(answered) == 5


def test_the_cost_is_learned_in_tokens_and_predicted_per_item() -> None:
    policy = BatchPolicy(32)
    assert policy.batch_overhead_tokens() == OVERHEAD_PRIOR_TOKENS
    # 5 ms per batch + 0.1 ms per padded token, batches of 8 items padded to 20 or 50.
    for n, longest in [(8, 20), (8, 50), (8, 20), (8, 50), (4, 50)]:
        policy.observe(n, n * longest, 0.005 + 0.0001 * n * longest)
    a, b_token = policy.cost.coefficients()
    assert abs(a - 0.005) < 1e-4
    assert abs(b_token - 0.0001) < 1e-6
    assert abs(policy.batch_overhead_tokens() - 50) < 1
    a_item, b_item = policy.per_item_cost()
    assert a_item == a
    assert 20 * b_token < b_item < 50 * b_token  # at the recent tokens per item


def test_a_flat_cost_is_never_split_for_padding() -> None:
    # A GPU below saturation: a batch costs the same whatever its tokens. One more batch
    # is then a whole batch's cost and no padding saved pays for it.
    policy = BatchPolicy(32)
    for tokens in (320, 1600, 640, 3200, 960):
        policy.observe(32, tokens, 0.010)
    assert policy.cost.slope_known
    assert policy.batch_overhead_tokens() == FLAT_OVERHEAD_TOKENS
    lengths = sorted([6] * 28 + [300] * 4)
    assert cuts(lengths, 32 * 512, policy.batch_overhead_tokens()) == [32]
    # ...cut only where the budget says (here 4 x 300 is over 1,000 tokens with the rest).
    assert len(cuts(lengths, 1000, policy.batch_overhead_tokens())) == 3
