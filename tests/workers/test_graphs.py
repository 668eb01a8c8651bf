"""CUDA graphs per shape bucket, behind ``CONVEYOR_CUDA_GRAPHS``.

Without a GPU: the setting reads and refuses as every setting does, and where a runner
cannot capture (on the CPU, buckets off, a capture that raises) one log line says why and
its answers are the eager ones, bit for bit; the worker still starts; with torch.cuda
faked (tests/workers/fake_cuda.py), the stages on one copy of the weights capture each
shape once, in one pool, and warm-up runs a served batch's every kernel. With one: every
bucket is captured, batches run by the graphs, and their answers equal the eager ones.
Real models (MiniLM, a tiny random-weight classifier).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelines.errors import ConfigError
from pipelines.settings import load_settings
from pipelines.stages import Stage, TextIn
from tests.helpers import Harness, until
from tests.workers.fake_cuda import FakeCuda
from workers.build import prepare_shapes
from workers.models import graphs
from workers.models.buckets import Bucketed, CannotCapture
from workers.models.hf import Embedder, TextClassifier
from workers.models.zeroshot import AnchorSentiment
from workers.settings import WorkerSettings

CUDA = torch.cuda.is_available()

TEXTS = [
    "hi",
    "Angela Merkel met Barack Obama in Washington yesterday.",
    "New York is big",
    "a somewhat longer sentence about Paris and Berlin and the rivers between them",
    "the quick brown fox jumps over the lazy dog " * 4,  # past max_length: truncated
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/workers/conftest.py


def embed_stage(max_batch_size: int = 4) -> Stage:
    return Stage(
        "graphembed",
        TextIn,
        "workers.models.hf:Embedder",
        model="minilm",
        max_batch_size=max_batch_size,
    )


def graph_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]


def embeddings(model: Embedder, texts: list[str]) -> torch.Tensor:
    return torch.tensor([r["embedding"] for r in model.predict([{"text": t} for t in texts])])


# --- the setting ------------------------------------------------------------------------


def test_the_setting_reads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().cuda_graphs is False  # off until proven on a GPU
    monkeypatch.setenv("CONVEYOR_CUDA_GRAPHS", "1")
    assert load_settings(WorkerSettings).cuda_graphs is True
    monkeypatch.setenv("CONVEYOR_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ConfigError) as refused:
        load_settings(WorkerSettings)
    assert str(refused.value).startswith("CONVEYOR_CUDA_GRAPHS: ")
    assert "'sometimes'" in str(refused.value)
    assert "\n" not in str(refused.value)


# --- where it cannot capture: one line, eager answers -----------------------------------


@pytest.mark.parametrize(
    ("buckets", "reason"),
    [(None, "shape buckets are off"), (True, "the model runs on cpu, not cuda")],
)
def test_on_the_cpu_one_line_says_why_and_the_answers_are_eager(
    cache_dir: Path, caplog: pytest.LogCaptureFixture, buckets: bool | None, reason: str
) -> None:
    options: dict[str, Any] = {"model": "minilm", "device": "cpu", "cache_dir": str(cache_dir)}
    options["max_length"] = 32
    eager, asked = Embedder(**options), Embedder(**options)
    stage = embed_stage()
    prepare_shapes(eager, stage, WorkerSettings(buckets=buckets, warmup=False))
    with caplog.at_level(logging.INFO):
        prepare_shapes(asked, stage, WorkerSettings(buckets=buckets, cuda_graphs=True))
    (line,) = graph_lines(caplog)
    assert line.startswith("stage graphembed: no CUDA graphs, eager forward passes: ")
    assert reason in line
    assert asked.graphs is None
    assert (asked.buckets is None) is (buckets is None)  # the buckets are as without graphs
    assert torch.equal(embeddings(asked, TEXTS), embeddings(eager, TEXTS))


def test_a_capture_that_raises_is_one_line_and_the_answers_are_eager(
    cache_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the device check, the capture itself fails, on any machine: torch refuses a
    # CPU model's first cuda call (on a GPU, an op that reads the device would fail it).
    monkeypatch.setattr(graphs, "unsupported", lambda device, buckets: None)
    options: dict[str, Any] = {"model": "tiny:sentiment", "device": "cpu", "max_length": 32}
    options["cache_dir"] = str(cache_dir)
    eager, asked = TextClassifier(**options), TextClassifier(**options)
    stage = Stage("graphclass", TextIn, "workers.models.hf:TextClassifier", max_batch_size=4)
    eager.use_buckets(True, 4, 16)
    settings = WorkerSettings(buckets=True, cuda_graphs=True, warmup=False)
    with caplog.at_level(logging.INFO):
        prepare_shapes(asked, stage, settings)
    (line,) = graph_lines(caplog)
    assert line.startswith(
        "stage graphclass: no CUDA graphs, eager forward passes: capture failed: "
    )
    assert "\n" not in line
    assert asked.graphs is None
    items = [{"text": t} for t in TEXTS[:3]]
    assert asked.predict(items) == eager.predict(items)


async def test_a_worker_asked_for_graphs_on_the_cpu_starts_and_serves(
    harness: Harness, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = Embedder(model="minilm", device="cpu", cache_dir=str(cache_dir), max_length=32)
    worker = harness.worker(embed_stage(), model, cuda_graphs=True)
    with caplog.at_level(logging.INFO):
        await worker.start()
    assert len(graph_lines(caplog)) == 1
    harness.run(worker)
    await harness.enqueue("graphembed", [{"text": t} for t in TEXTS[:2]])

    async def answered() -> bool:
        return sum(r.outcomes["ok"] for r in worker.history) >= 2

    await until(answered, 30)


def test_runners_on_a_sentence_encoder_pass_graphs_on_to_it(cache_dir: Path) -> None:
    model = AnchorSentiment(device="cpu", cache_dir=str(cache_dir), max_length=32)
    assert isinstance(model, Bucketed)
    model.use_buckets(True, 2, 16)
    with pytest.raises(CannotCapture, match="the model runs on cpu, not cuda"):
        model.use_graphs()
    assert model.embedder.graphs is None


def test_a_runner_without_buckets_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    stage = Stage("plain", TextIn, "workers.models.hf:Embedder")
    with caplog.at_level(logging.INFO):
        prepare_shapes(object(), stage, WorkerSettings(cuda_graphs=True))  # type: ignore[arg-type]
    assert graph_lines(caplog) == ["stage plain: no CUDA graphs: its runner has no shape buckets"]


# --- one capture per weights; warm-up meets every kernel (torch.cuda faked) -------------


def test_stages_on_one_copy_of_the_weights_capture_each_shape_once(
    cache_dir: Path, fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    # embed and sentiment on MiniLM: one copy of the weights, so one graph per shape and
    # one memory pool between them (torch.cuda faked: the capture runs, on the CPU).
    monkeypatch.setattr(graphs, "unsupported", lambda device, buckets: None)
    load: dict[str, Any] = {"device": "cpu", "cache_dir": str(cache_dir), "max_length": 32}
    embed = Embedder(model="minilm", **load)
    sentiment = AnchorSentiment(**load)
    assert sentiment.embedder.model is embed.model
    embed.use_buckets(True, 4, 16)  # 3 batch sizes x 2 lengths
    sentiment.use_buckets(True, 2, 16)  # 2 x 2, all among embed's
    assert embed.use_graphs() == 6
    assert sentiment.use_graphs() == 4
    assert len(fake_cuda.captures) == 6, "a shape captured again for the same weights"
    assert fake_cuda.pools == 1
    assert embed.graphs is not None
    assert sentiment.embedder.graphs is not None
    for shape in sentiment.embedder.graphs.shapes:
        assert sentiment.embedder.graphs._graphs[shape] is embed.graphs._graphs[shape]
    # Other weights (another dtype) are captured for themselves.
    half = Embedder(model="minilm", dtype="bfloat16", **load)
    half.use_buckets(True, 1, 16)
    assert half.use_graphs() == 2
    assert (len(fake_cuda.captures), fake_cuda.pools) == (8, 2)


def test_warm_up_runs_each_bucket_as_a_served_batch_runs(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every bucket: its host copy through the pinning step, the forward pass padded (a
    # masked position) and unpadded (none masked: another attention kernel), and the
    # pooling and the copy back of a served batch.
    model = Embedder(model="minilm", device="cpu", cache_dir=str(cache_dir), max_length=32)
    buckets = model.use_buckets(True, 2, 16)
    assert buckets is not None
    passes: list[tuple[tuple[int, int], bool]] = []  # (shape, any position masked)
    fetched: list[tuple[int, ...]] = []
    pinned: list[tuple[int, int]] = []
    forward, fetch, pin = model.forward, model.fetch, model.pinned

    def counted_forward(encoding: Any, padded: bool) -> Any:
        mask = encoding["attention_mask"]
        masks = bool((mask == 0).any())
        # Told as the host read it: an unmasked pass takes the mask-free path.
        assert padded == masks, f"{tuple(mask.shape)}: told padded={padded}"
        passes.append((tuple(mask.shape), masks))
        return forward(encoding, padded)

    def counted_fetch(tensors: list[torch.Tensor]) -> Any:
        fetched.extend(tuple(t.shape) for t in tensors)
        return fetch(tensors)

    def counted_pin(host: Any) -> Any:
        pinned.append(tuple(host.encoding["input_ids"].shape))
        kept = pin(host)
        assert kept.padded == host.padded  # the host's read travels with the copy
        return kept

    monkeypatch.setattr(model, "forward", counted_forward)
    monkeypatch.setattr(model, "fetch", counted_fetch)
    monkeypatch.setattr(model, "pinned", counted_pin)
    runs = model.warm_up()
    assert [(r.rows, r.length) for r in runs] == buckets.shapes()
    hidden = int(model.model.config.hidden_size)
    for shape in buckets.shapes():
        assert (shape, True) in passes, f"{shape}: no padded pass"
        assert (shape, False) in passes, f"{shape}: no unpadded pass"
        assert pinned.count(shape) >= 2, f"{shape}: host copies not through the pinning step"
        assert (shape[0], hidden) in fetched, f"{shape}: no pooled rows fetched"
    assert len(fetched) == len(passes)  # each pass pooled and copied back


# --- on a GPU: every bucket captured, answers equal to eager -----------------------------


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_graphed_answers_equal_eager_on_cuda(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options: dict[str, Any] = {"model": "minilm", "device": "cuda", "cache_dir": str(cache_dir)}
    options["max_length"] = 64
    eager, graphed = Embedder(**options), Embedder(**options)  # one copy of the weights
    stage = embed_stage(max_batch_size=8)
    prepare_shapes(eager, stage, WorkerSettings(buckets=True))
    with caplog.at_level(logging.INFO):
        prepare_shapes(graphed, stage, WorkerSettings(buckets=True, cuda_graphs=True))
    buckets = graphed.buckets
    assert buckets is not None
    assert graphed.graphs is not None, caplog.text
    assert graphed.graphs.shapes == set(buckets.shapes())  # every bucket captured
    (line,) = graph_lines(caplog)
    assert f"graphembed: {len(buckets.shapes())} CUDA graphs captured (one per bucket)" in line
    rng = random.Random(5)
    words = " ".join(TEXTS).split()
    for size in (1, 3, 8, 5, 2, 8):
        texts = [" ".join(rng.choices(words, k=rng.randint(1, 40))) for _ in range(size)]
        replays = graphed.graphs.replays
        a, b = embeddings(eager, texts), embeddings(graphed, texts)
        assert graphed.graphs.replays == replays + 1, "the batch ran eager"
        assert torch.nn.functional.cosine_similarity(a, b).min().item() >= 0.9999

    # A result is the caller's to keep: the next replay of its shape does not change it.
    first = graphed.encode(TEXTS[:2])
    second = graphed.encode(TEXTS[1:3])
    assert first["input_ids"].shape == second["input_ids"].shape
    with torch.inference_mode():
        kept = graphed.forward(first, padded=True).last_hidden_state
        copy = kept.clone()
        graphed.forward(second, padded=True)
        assert torch.equal(kept, copy)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_graphed_classifier_labels_equal_eager_on_cuda(cache_dir: Path) -> None:
    # float32: a random-weight model's near ties must not flip on fp16 noise.
    options: dict[str, Any] = {"model": "tiny:sentiment", "device": "cuda", "max_length": 64}
    options |= {"dtype": "float32", "cache_dir": str(cache_dir)}
    eager, graphed = TextClassifier(**options), TextClassifier(**options)
    stage = Stage("graphclass", TextIn, "workers.models.hf:TextClassifier", max_batch_size=8)
    prepare_shapes(eager, stage, WorkerSettings(buckets=True, warmup=False))
    prepare_shapes(graphed, stage, WorkerSettings(buckets=True, cuda_graphs=True, warmup=False))
    assert graphed.graphs is not None
    assert graphed.buckets is not None
    assert graphed.graphs.shapes == set(graphed.buckets.shapes())
    items = [{"text": t} for t in TEXTS]
    for x, y in zip(eager.predict(items), graphed.predict(items), strict=True):
        assert x["label"] == y["label"]
        assert x["score"] == pytest.approx(y["score"], abs=1e-3)
    assert graphed.graphs.replays == 1
