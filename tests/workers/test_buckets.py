"""Shape buckets, warmed before ready, proven on a simulated device.

Real models (MiniLM, tiny random-weight ones), a real redis-server, a real worker. The
simulated accelerator (:mod:`workers.models.simulated`) charges the first call of each
new shape and counts the cold shapes it met: on the CPU a new shape costs next to
nothing, so without it no test could tell a warm worker from a cold one.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelines.errors import ConfigError
from pipelines.stages import Stage, TextIn
from tests.helpers import Harness, until
from workers.loop import Worker
from workers.models.buckets import Buckets, batch_sizes, padded_lengths
from workers.models.hf import Embedder, TextClassifier, TokenClassifier
from workers.models.hf_encode import EncoderRunner
from workers.models.simulated import SimulatedDevice, SimulatedEmbedder
from workers.models.zeroshot import AnchorSentiment

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "near",
    "Paris",
    "while",
    "Angela",
    "Merkel",
    "waits",
]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


TEXTS = [
    "hi",
    "Angela Merkel met Barack Obama in Washington yesterday.",
    "New York is big",
    " ".join(WORDS * 3),  # past max_length below: truncated, then the longest
    "a somewhat longer sentence about Paris and Berlin and the rivers between them",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/workers/conftest.py


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-cache"))


# --- the bucket set ---------------------------------------------------------------------


def test_batch_sizes_are_powers_of_two_up_to_the_max() -> None:
    assert batch_sizes(1) == (1,)
    assert batch_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert batch_sizes(24) == (1, 2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="max_rows"):
        batch_sizes(0)


def test_padded_lengths_multiple_or_list_end_at_max_length() -> None:
    assert padded_lengths(16, 64) == (16, 32, 48, 64)
    assert padded_lengths(16, 50) == (16, 32, 48, 50)
    assert padded_lengths((128, 32, 1000), 512) == (32, 128, 512)
    for bad in (0, (), (0, 16)):
        with pytest.raises(ValueError, match="bucket length"):
            padded_lengths(bad, 512)


def test_shape_is_the_least_bucket_that_fits() -> None:
    buckets = Buckets.build(8, 16, 64)
    assert buckets.shape(3, 17) == (4, 32)
    assert buckets.shape(1, 1) == (1, 16)
    assert buckets.shape(8, 64) == (8, 64)
    assert buckets.shape(9, 70) == (9, 70)  # past the largest: left as it is
    assert len(buckets.shapes()) == 4 * 4


def test_stage_checks_bucket_lengths() -> None:
    Stage("ok", TextIn, "workers.models.hf:Embedder", bucket_lengths=(32, 128))
    for bad in (0, (), (16, -1)):
        with pytest.raises(ConfigError, match="bucket_lengths"):
            Stage("bad", TextIn, "workers.models.hf:Embedder", bucket_lengths=bad)


# --- (a) padding never changes an answer ------------------------------------------------


class ShapeLog:
    """The shapes a runner's forward passes ran (to prove the bucketed runner padded)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def note(self, encoding: Mapping[str, torch.Tensor]) -> None:
        self.shapes.append(tuple(encoding["input_ids"].shape))


class Logged(EncoderRunner):
    """An encoder runner that logs the shape of each forward pass (mixed in first)."""

    def __init__(self, **options: Any) -> None:
        self.log = ShapeLog()
        super().__init__(**options)

    def forward(self, encoding: Mapping[str, torch.Tensor], padded: bool) -> Any:
        self.log.note(encoding)
        return super().forward(encoding, padded)


class LoggedClassifier(Logged, TextClassifier):
    pass


class LoggedTokens(Logged, TokenClassifier):
    pass


@pytest.mark.parametrize("lengths", [16, (24, 40)])
def test_embeddings_identical_with_and_without_buckets(
    hf_cache: str, lengths: int | tuple[int, ...]
) -> None:
    plain = Embedder(model="minilm", device="cpu", cache_dir=hf_cache, max_length=48)
    bucketed = SimulatedEmbedder(
        model="minilm", device="cpu", cache_dir=hf_cache, max_length=48, first_call_s=0
    )
    assert bucketed.use_buckets(None, 8, lengths) is not None  # an accelerator: on
    items = [{"text": t} for t in TEXTS]
    ran = [r["embedding"] for r in plain.predict(items)]
    padded = [r["embedding"] for r in bucketed.predict(items)]
    (shape,) = bucketed.sim.shapes
    assert shape[0] == 8
    assert shape[1] in padded_lengths(lengths, 48)
    a, b = torch.tensor(ran), torch.tensor(padded)
    assert a.shape == b.shape == (len(TEXTS), 384)
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.nn.functional.cosine_similarity(a, b).min().item() >= 0.999999
    # One text alone, padded to 16 tokens (and no rows added): the same too.
    alone = bucketed.predict(items[:1])[0]["embedding"]
    assert torch.allclose(torch.tensor(alone), a[0], atol=1e-5)


def test_sentiment_on_the_encoder_identical_with_and_without_buckets(hf_cache: str) -> None:
    plain = AnchorSentiment(device="cpu", cache_dir=hf_cache, max_length=48)
    bucketed = AnchorSentiment(device="cpu", cache_dir=hf_cache, max_length=48)
    assert bucketed.use_buckets(True, 8, 16) is not None
    items = [{"text": t} for t in TEXTS]
    for x, y in zip(plain.predict(items), bucketed.predict(items), strict=True):
        assert x["label"] == y["label"]
        assert x["score"] == pytest.approx(y["score"], abs=1e-5)


def test_text_classifier_identical_with_and_without_buckets(hf_cache: str) -> None:
    plain = TextClassifier(model="tiny:sentiment", device="cpu", cache_dir=hf_cache)
    bucketed = LoggedClassifier(model="tiny:sentiment", device="cpu", cache_dir=hf_cache)
    bucketed.use_buckets(True, 32, 16)
    items = [{"text": t} for t in TEXTS]
    expected, got = plain.predict(items), bucketed.predict(items)
    assert bucketed.log.shapes[0][0] == 8
    assert bucketed.log.shapes[0][1] % 16 == 0
    assert len(got) == len(items)  # the padded rows' answers are dropped
    for x, y in zip(expected, got, strict=True):
        assert x["label"] == y["label"]
        assert x["score"] == pytest.approx(y["score"], abs=1e-5)


def test_token_classifier_identical_with_and_without_buckets(hf_cache: str) -> None:
    plain = TokenClassifier(model="tiny:ner", device="cpu", cache_dir=hf_cache, max_length=40)
    bucketed = LoggedTokens(model="tiny:ner", device="cpu", cache_dir=hf_cache, max_length=40)
    bucketed.use_buckets(True, 32, 16)
    items = [{"text": t} for t in TEXTS]
    expected, got = plain.predict(items), bucketed.predict(items)
    assert bucketed.log.shapes == [(8, 40)]  # 5 rows of at most 40 tokens
    assert any(r["entities"] for r in expected)  # something to compare
    for x, y in zip(expected, got, strict=True):
        assert len(x["entities"]) == len(y["entities"])
        for e, f in zip(x["entities"], y["entities"], strict=True):
            assert {k: v for k, v in e.items() if k != "score"} == {
                k: v for k, v in f.items() if k != "score"
            }
            assert e["score"] == pytest.approx(f["score"], abs=1e-5)


# --- (b) the shapes a runner runs are bounded -------------------------------------------


def test_shapes_run_are_bounded_by_the_buckets(hf_cache: str) -> None:
    rng = random.Random(24)
    batches = [
        [{"text": sentence(rng, rng.randint(1, 50))} for _ in range(rng.randint(1, 8))]
        for _ in range(24)
    ]
    # A tiny random-weight BERT: the shapes are the tokenizer's and the buckets', not the weights'.
    options: dict[str, Any] = {"model": "tiny:ner", "device": "cpu", "cache_dir": hf_cache}
    options |= {"max_length": 64, "batch_size": 8, "first_call_s": 0}
    bucketed, unbucketed = SimulatedEmbedder(**options), SimulatedEmbedder(**options)
    buckets = bucketed.use_buckets(None, 8, 16)
    assert buckets is not None
    assert unbucketed.use_buckets(False, 8, 16) is None
    for batch in batches:
        bucketed.predict(batch)
        unbucketed.predict(batch)
    assert bucketed.sim.shapes <= set(buckets.shapes())
    assert len(buckets.shapes()) == 4 * 4
    # The same traffic without buckets runs about one new shape per batch.
    assert len(unbucketed.sim.shapes) > len(buckets.shapes())


# --- (c) no cold shape once the worker is ready -----------------------------------------


def simulated_stage() -> Stage:
    return Stage(
        "simembed",
        TextIn,
        "workers.models.simulated:SimulatedEmbedder",
        model="minilm",
        max_batch_size=4,
        batch_wait_ms=20,
    )


async def serve_waves(harness: Harness, worker: Worker, rng: random.Random) -> int:
    """Send waves of 1-7 texts of 1-40 words, each once the one before is answered (so
    batches of every size and length, however slow the machine), and wait for every one
    to be answered; returns how many."""
    sent = 0
    harness.run(worker)

    async def answered() -> bool:
        return sum(r.outcomes["ok"] for r in worker.history) >= sent

    for _ in range(12):
        wave = [{"text": sentence(rng, rng.randint(1, 40))} for _ in range(rng.randint(1, 7))]
        await harness.enqueue("simembed", wave)
        sent += len(wave)
        await until(answered, 60)
    return sent


@pytest.mark.parametrize("warmup", [True, False])
async def test_no_cold_shape_after_the_worker_is_ready(
    harness: Harness, cache_dir: Path, warmup: bool, caplog: pytest.LogCaptureFixture
) -> None:
    model = SimulatedEmbedder(
        model="minilm", device="cpu", cache_dir=str(cache_dir), max_length=32, first_call_s=0.05
    )
    worker = harness.worker(simulated_stage(), model, warmup=warmup)

    async def warming() -> bool:
        return model.sim.cold > 0

    with caplog.at_level(logging.INFO, logger="workers.build"):
        starting = asyncio.create_task(worker.start())
        if warmup:
            await until(warming, 30)
            # Warming up: the stage is neither registered nor its group created yet.
            assert not await harness.redis.exists(*worker.streams)
            assert not await harness.redis.sismember(harness.keys.stages_set(), "simembed")
        await starting
    assert await harness.redis.sismember(harness.keys.stages_set(), "simembed")
    buckets = model.buckets
    assert buckets is not None
    assert buckets.shapes() == [(rows, length) for rows in (1, 2, 4) for length in (16, 32)]
    cold_when_ready = model.sim.cold
    sent = await serve_waves(harness, worker, random.Random(7))
    # Warm-up ran each shape twice; the traffic's shapes ran more.
    ran = {shape for shape, calls in model.sim.calls.items() if calls > (2 if warmup else 0)}
    assert len(ran) >= 3, f"the traffic ran too few shapes to tell: {ran}"
    assert model.sim.shapes <= set(buckets.shapes())
    if warmup:
        assert cold_when_ready == len(buckets.shapes())
        assert model.sim.cold == cold_when_ready, "a request met a cold shape after ready"
        assert "simembed: buckets 3 batch sizes x 2 lengths: warmed 6 shapes" in caplog.text
    else:  # the contrast: without the warm-up, requests pay the cold shapes
        assert cold_when_ready == 0
        assert model.sim.cold >= 3
        assert "not warmed (warmup off)" in caplog.text
    assert sent >= 12


async def test_buckets_setting_overrides_the_stage(harness: Harness, cache_dir: Path) -> None:
    model = SimulatedEmbedder(
        model="minilm", device="cpu", cache_dir=str(cache_dir), max_length=32, first_call_s=0
    )
    worker = harness.worker(simulated_stage(), model, buckets=False)
    await worker.start()
    assert model.buckets is None
    assert model.sim.cold == 0


async def test_cpu_runner_has_no_buckets_by_default(harness: Harness, cache_dir: Path) -> None:
    model = Embedder(model="minilm", device="cpu", cache_dir=str(cache_dir))
    stage = Stage("cpuembed", TextIn, "workers.models.hf:Embedder", model="minilm")
    await harness.worker(stage, model).start()
    assert model.buckets is None  # a new shape costs ~5 ms on a CPU; padding costs more


def test_simulated_device_counts_cold_shapes() -> None:
    device = SimulatedDevice(first_call_s=0)
    for shape in [(1, 16), (1, 16), (2, 16), (1, 16)]:
        device.run(shape)
    assert device.cold == 2
    assert device.calls[(1, 16)] == 3
    with pytest.raises(ValueError, match="first_call_s"):
        SimulatedDevice(first_call_s=-1)
