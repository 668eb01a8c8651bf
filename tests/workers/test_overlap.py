"""CPU work overlapped with the device, and batching on the device's own cost (issue 24,
items 3 and 4), proven on the simulated accelerator (:mod:`workers.models.simulated`):
host preparation that holds the GIL, a device time that releases it, a cost flat in the
batch's size up to saturation, a first-call cost per new shape. A real redis-server and a
real worker; what is asserted is what the device saw (its spans, its busy time), never
how long the test took.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import pytest

from pipelines.model import Result, StagedModel
from pipelines.stages import Stage, TextIn
from tests.helpers import Harness, until
from workers.loop import Worker
from workers.models.hf import TextClassifier
from workers.models.simulated import OneCall, SimulatedAccelerator, Span

RUNNER = "workers.models.simulated:SimulatedAccelerator"


def stage(max_batch_size: int = 8, max_batch_tokens: int | None = None) -> Stage:
    return Stage(
        "sim",
        TextIn,
        RUNNER,
        max_batch_size=max_batch_size,
        batch_wait_ms=5,
        max_batch_tokens=max_batch_tokens,
    )


def during_another(spans: list[Span], phase: str, at: str) -> int:
    """How many ``phase`` spans had their ``at`` moment (``start`` or ``end``) while the
    device ran another batch."""
    device = [s for s in spans if s.phase == "device"]
    return sum(
        any(d.batch != s.batch and d.start < getattr(s, at) < d.end for d in device)
        for s in spans
        if s.phase == phase
    )


def overlapped(spans: list[Span]) -> int:
    """How many batches were prepared (began preparing) while the device ran another."""
    return during_another(spans, "prepare", "start")


def queued_while_busy(spans: list[Span]) -> int:
    """How many batches the host queued (ended its launch) while the device ran another."""
    return during_another(spans, "launch", "end")


def texts(rng: random.Random, count: int, words: tuple[int, int]) -> list[dict[str, str]]:
    return [{"text": " ".join(["word"] * rng.randint(*words))} for _ in range(count)]


@pytest.mark.parametrize("staged", [True, False])
async def test_the_next_batch_is_prepared_while_the_device_runs(
    harness: Harness, staged: bool
) -> None:
    sim = SimulatedAccelerator(prepare_s=0.03, device_s=0.08, first_call_s=0.0)
    assert isinstance(sim, StagedModel)
    model = sim if staged else OneCall(sim)
    await harness.enqueue("sim", texts(random.Random(1), 96, (3, 12)))
    worker = harness.worker(stage(), model)
    assert await worker.run(burst=True) == 12
    assert sum(r.outcomes["ok"] for r in worker.history) == 96
    device = sorted((s for s in sim.spans if s.phase == "device"), key=lambda s: s.start)
    assert len(device) == 12
    assert all(a.end <= b.start + 1e-6 for a, b in pairwise(device))
    if staged:
        # Batch n+1 tokenized while batch n ran, nearly every time (the first had nothing
        # to overlap; a loaded machine may delay a read past a device run now and then).
        assert overlapped(sim.spans) >= 8, sim.spans
        assert queued_while_busy(sim.spans) >= 8, sim.spans  # and queued while n ran
    else:  # one call per batch in one thread: the device waits while the host prepares
        assert overlapped(sim.spans) == 0
        assert queued_while_busy(sim.spans) == 0


@pytest.mark.usefixtures("one_thread")  # tests/workers/conftest.py
@pytest.mark.parametrize("reads", [False, True])
async def test_a_launch_that_reads_the_device_cannot_queue_behind_the_running_batch(
    harness: Harness, tmp_path_factory: pytest.TempPathFactory, reads: bool
) -> None:
    # The real classifier's launch on a device whose reads wait for it, as a GPU's sync
    # does. Given the 2D mask (reads: the mask path of transformers 5 before issue 30),
    # its forward reads the mask once a batch: batch n+1 is queued only once n is done.
    # Given what lets it skip that read, it queues n+1 while n runs, as a GPU needs.
    classifier = TextClassifier(
        model="tiny:sentiment", device="cpu", cache_dir=str(tmp_path_factory.mktemp("hf"))
    )
    classifier.given_mask = not reads
    sim = SimulatedAccelerator(prepare_s=0.0, device_s=0.15, first_call_s=0.0, runner=classifier)
    rng = random.Random(6)
    await harness.enqueue("sim", texts(rng, 96, (3, 12)))
    worker = harness.worker(stage(), sim)
    assert await worker.run(burst=True) == 12
    assert sum(r.outcomes["ok"] for r in worker.history) == 96
    if reads:
        assert sim.reads == 12  # one a batch (one forward pass each)
        assert queued_while_busy(sim.spans) == 0, sim.spans
    else:
        assert sim.reads == 0
        assert queued_while_busy(sim.spans) >= 8, sim.spans


async def test_a_cold_shape_is_not_a_cost_sample(harness: Harness) -> None:
    # Every batch size a new shape at first: their 0.4 s first calls would be taken for
    # the model's cost, as on the H100, where they made the learned cost 10x the real one.
    sim = SimulatedAccelerator(prepare_s=0.0, device_s=0.01, first_call_s=0.4)
    worker = harness.worker(stage(max_batch_size=8), sim)
    harness.run(worker)
    rng = random.Random(2)
    for size in (1, 2, 4, 8, 1, 2, 4, 8, 3, 5, 8, 8):
        await harness.enqueue("sim", texts(rng, size, (3, 6)))
        await ran(worker, size)
    cold = [r for r in worker.history if r.cold]
    warm = [r for r in worker.history if not r.cold and r.outcomes["ok"]]
    assert len(cold) == sim.cold >= 3
    assert warm, "no warm batch ran"
    policy = worker.parts.window.policy
    assert policy is not None
    assert policy.cost.w < len(worker.history)  # the cold ones were left out
    a, b = policy.cost.coefficients()
    assert a + 8 * b < 0.2, (a, b)  # a warm batch's cost, not a first call's


async def ran(worker: Worker, size: int) -> None:
    """Wait until ``worker`` has run ``size`` more entries."""
    want = sum(r.size for r in worker.history) + size

    async def done() -> bool:
        return sum(r.size for r in worker.history) >= want

    await until(done, 60)


async def test_a_loaded_stage_fills_to_its_max_batch_on_a_flat_cost(harness: Harness) -> None:
    # Short texts of uneven length, a backlog, a length-aware stage: on a cost flat in
    # tokens (a GPU below saturation), cutting a window by length only adds batches.
    sim = SimulatedAccelerator(prepare_s=0.0, device_s=0.01, first_call_s=0.0)
    await harness.enqueue("sim", texts(random.Random(3), 320, (2, 40)))
    worker = harness.worker(stage(max_batch_size=32, max_batch_tokens=32 * 512), sim)
    await worker.run(burst=True)
    sizes = [r.size for r in worker.history]
    assert sum(sizes) == 320
    assert sizes == [32] * 10, sizes


async def test_length_aware_never_loses_to_item_count_on_a_gpu_like_cost(
    harness: Harness,
) -> None:
    # Long-tailed lengths (as bench/mixed.jsonl), a device flat up to 4,096 padded tokens
    # then linear: what the two batching modes cost the device, for the same backlog.
    rng = random.Random(4)
    backlog = [
        {"text": " ".join(["word"] * min(300, max(3, int(rng.lognormvariate(2.8, 1.0)))))}
        for _ in range(640)
    ]
    busy: dict[str, float] = {}
    for mode, tokens in (("items", 0), ("lengths", None)):
        sim = SimulatedAccelerator(
            prepare_s=0.0, device_s=0.01, first_call_s=0.0, saturation_tokens=4096
        )
        await harness.enqueue("sim", backlog)
        worker = harness.worker(
            stage(max_batch_size=32, max_batch_tokens=32 * 256), sim, max_batch_tokens=tokens
        )
        await worker.run(burst=True)
        assert sum(r.outcomes["ok"] for r in worker.history) == len(backlog)
        busy[mode] = sim.device_busy_s
    assert busy["lengths"] <= busy["items"], busy


class PoisonAtFinish(SimulatedAccelerator):
    """Fails a batch that holds a "poison" text when its device work is fetched (as an
    asynchronous device error surfaces at the wait)."""

    def finish(self, launched: Any) -> Sequence[Result | BaseException]:
        if any("poison" in item["text"] for item in launched.items):
            raise RuntimeError("the device failed this batch")
        return super().finish(launched)


async def test_a_batch_failing_at_finish_fails_only_its_bad_item(harness: Harness) -> None:
    sim = PoisonAtFinish(prepare_s=0.0, device_s=0.001, first_call_s=0.0)
    payloads = [{"text": f"fine {i}"} for i in range(7)]
    payloads.insert(3, {"text": "poison"})
    await harness.enqueue("sim", payloads)
    worker = harness.worker(stage(max_batch_size=8), sim)
    assert await worker.run(burst=True) == 1
    (record,) = worker.history
    assert record.outcomes["ok"] == 7
    assert record.outcomes["error"] == 1
    assert (
        not worker.parts.window.policy or not worker.parts.window.policy.cost.known
    )  # no cost sample
