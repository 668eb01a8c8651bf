"""One copy of a model for the stages of a process that share its weights: loaded once,
run in one model thread whose batches never overlap, each stage with its own stream,
batches and counters; and the threads a worker process runs."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import gc
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import torch

from pipelines.builtin import builtin_pipelines
from pipelines.model import Item, Result
from pipelines.registry import Registry
from pipelines.stages import BUILTIN, Resources
from tests.helpers import Harness, number_stage
from workers.build import build_model, process_threads
from workers.models.extractive import ExtractiveSummarizer
from workers.models.hf_base import _WEIGHTS
from workers.models.hf_embed import Embedder
from workers.models.zeroshot import AnchorSentiment
from workers.settings import WorkerSettings


def test_runners_on_the_same_weights_hold_one_copy(cache_dir: Path) -> None:
    load: dict[str, Any] = {"cache_dir": str(cache_dir), "device": "cpu"}
    embed = Embedder(model="minilm", **load)
    sentiment = AnchorSentiment(**load)
    summarize = ExtractiveSummarizer(num_sentences=2, **load)
    assert sentiment.embedder.model is embed.model
    assert summarize.embedder.model is embed.model
    assert embed.weights_key == sentiment.weights_key == summarize.weights_key
    assert embed.tokenizer is not sentiment.embedder.tokenizer  # small, and a runner may set it
    # Another dtype is other weights.
    half = Embedder(model="minilm", dtype="bfloat16", **load)
    assert half.model is not embed.model
    assert half.weights_key != embed.weights_key
    # Kept while a runner holds them, not for the process's life.
    key = embed.weights_key
    del embed, sentiment, summarize
    gc.collect()
    assert key not in _WEIGHTS


class Recorder:
    """A model on the weights ``key`` names, noting when (and in which thread) each batch
    ran; ``log`` may be shared by two models."""

    def __init__(self, key: str, log: list[tuple[str, int, float, float]], name: str) -> None:
        self.weights_key, self.log, self.name = key, log, name

    def predict(self, items: list[Item]) -> list[Result]:
        """Double each value, after 20 ms of model time."""
        started = time.monotonic()
        time.sleep(0.02)
        self.log.append((self.name, threading.get_ident(), started, time.monotonic()))
        return [{"value": i["value"] * 2} for i in items]


async def serve_two(
    harness: Harness, keys: tuple[str, str], n: int
) -> tuple[list[tuple[str, int, float, float]], Any, Any]:
    """Two stages (``a`` and ``b``) in this process, their models on the weights ``keys``
    name, ``n`` requests each served to the end."""
    log: list[tuple[str, int, float, float]] = []
    a = harness.worker(number_stage("a", max_batch_size=4), Recorder(keys[0], log, "a"))
    b = harness.worker(number_stage("b", max_batch_size=4), Recorder(keys[1], log, "b"))
    for w in (a, b):
        await w.start()
    await harness.enqueue("a", [{"value": v} for v in range(n)])
    await harness.enqueue("b", [{"value": v} for v in range(n)])
    tasks = [harness.run(w, burst=True) for w in (a, b)]
    for task in tasks:
        await task
    return log, a, b


async def test_stages_on_one_model_take_turns_in_one_thread_each_with_its_own_counters(
    harness: Harness, redis: aioredis.Redis
) -> None:
    log, a, b = await serve_two(harness, ("minilm", "minilm"), 24)
    assert a.runner.thread is b.runner.thread
    assert {name for name, *_ in log} == {"a", "b"}
    assert len({thread for _, thread, _, _ in log}) == 1
    spans = sorted((start, end) for *_, start, end in log)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    # Each stage keeps its own batches and counters.
    assert sum(r.size for r in a.history) == sum(r.size for r in b.history) == 24
    assert all(r.size <= 4 for r in [*a.history, *b.history])
    for worker in (a, b):
        stats = await harness.stats(worker.stage.name)
        assert (stats["items:ok"], stats["model_items"]) == (24, 24), stats
        assert stats["batches"] == len(worker.history)


async def test_stages_on_different_models_keep_their_own_threads(harness: Harness) -> None:
    log, a, b = await serve_two(harness, ("one", "other"), 8)
    assert a.runner.thread is not b.runner.thread
    assert len({thread for _, thread, _, _ in log}) == 2


async def test_a_worker_on_weights_another_worker_left_gets_a_live_thread(
    harness: Harness,
) -> None:
    # The first worker on the weights stops and lets its model thread go; a later one on
    # the same weights, in the same event loop (a restarted stage, or the next test),
    # must not be handed that stopped thread.
    log: list[tuple[str, int, float, float]] = []
    first = harness.worker(number_stage("a"), Recorder("reused", log, "a"))
    await first.start()
    first.runner.close()
    later = harness.worker(number_stage("a"), Recorder("reused", log, "a"))
    await later.start()
    assert later.runner.thread is not first.runner.thread
    await harness.enqueue("a", [{"value": 1}])
    assert await later.run(burst=True) == 1
    assert [name for name, *_ in log] == ["a"]


async def test_the_builtin_stages_on_minilm_load_it_once_in_one_worker_process(
    harness: Harness,
) -> None:
    registry = Registry(builtin_pipelines()).select(("embed", "sentiment", "summarize"))
    workers = [
        harness.worker(registry.stage(n), registry=registry, device="cpu", threads=1)
        for n in ("embed", "sentiment", "summarize")
    ]
    for w in workers:
        await w.start()
    embed, sentiment, summarize = (w.runner for w in workers)
    models: list[Any] = [r.model for r in (embed, sentiment, summarize)]
    assert models[1].embedder.model is models[0].model
    assert models[2].embedder.model is models[0].model
    assert embed.thread is sentiment.thread is summarize.thread
    assert embed.thread.users == 3
    for w in workers:
        await w.close()
    assert embed.thread.users == 0
    assert embed.thread.executor._shutdown  # the last one let the thread go


def test_a_process_runs_the_most_threads_its_stages_ask_else_conveyor_threads() -> None:
    settings = WorkerSettings(threads=3)
    embed, ner = BUILTIN["embed"], BUILTIN["ner"]
    assert process_threads([embed, ner], settings) == 3
    assert process_threads([embed, ner], WorkerSettings()) is None
    asked = [embed.with_resources(Resources(threads=2)), ner.with_resources(Resources(threads=4))]
    assert process_threads(asked, settings) == 4


@pytest.fixture
def torch_threads() -> Any:
    """torch's intra-op threads restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("torch_threads")
def test_the_stage_device_wins_and_the_threads_are_set_once_the_model_loads(
    cache_dir: Path,
) -> None:
    stage = BUILTIN["embed"].with_resources(Resources(device="cpu"))
    settings = WorkerSettings(device="cuda:7", threads=1, cache_dir=str(cache_dir))
    model = build_model(stage, settings)  # cuda:7 would fail on any machine here
    assert getattr(model, "device", None) == torch.device("cpu")
    assert torch.get_num_threads() == 1
