"""No host read of a device value in a staged runner's launch (issue 30, item 1).

A read (``bool(tensor)``, ``.item()``, ``nonzero``) is a sync on a GPU: the host waits
for every kernel queued before it, so it cannot queue batch n+1 while batch n runs.
Counted on the CPU, where the same operations run (:class:`workers.models.reads.DeviceReads`):
transformers 5 read the attention mask once per forward pass (``masking_utils``); the
runners now give the model what lets it skip that read, and their answers are those of
the read path (the runner given the 2D mask, ``given_mask = False``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from workers.models.hf import Embedder, TextClassifier
from workers.models.hf_encode import EncoderRunner, padded
from workers.models.reads import DeviceReads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/workers/conftest.py

SAME = [{"text": "the quick brown fox"}] * 4  # one length: no padding (but a bucket's)
MIXED = [
    {"text": "hi"},
    {"text": "Angela Merkel met Barack Obama in Washington yesterday."},
    {"text": "New York is big"},
]


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-cache"))


def runner(kind: str, hf_cache: str, buckets: bool) -> EncoderRunner:
    made: EncoderRunner
    if kind == "embed":
        made = Embedder(model="minilm", device="cpu", cache_dir=hf_cache, max_length=48)
    else:
        made = TextClassifier(model="tiny:sentiment", device="cpu", cache_dir=hf_cache)
    if buckets:
        # SAME is 6 tokens and 4 rows: a bucket of its own shape, so unpadded still.
        assert made.use_buckets(True, 4, (6, 16)) is not None
    return made


def launched(model: Any, items: list[dict[str, Any]]) -> tuple[list[str], torch.Tensor]:
    """The reads in ``model.launch`` on ``items``, and its answers as one tensor."""
    prepared = model.prepare(items)
    with DeviceReads() as reads:
        value = model.launch(prepared)
    results = model.finish(value)
    if isinstance(model, Embedder):
        return reads.seen, torch.tensor([r["embedding"] for r in results])
    return reads.seen, torch.tensor([[r["score"]] for r in results])


def chunks(model: Any, items: list[dict[str, Any]]) -> list[bool]:
    """Whether each forward pass of ``items`` is padded, as the host reads it."""
    prepared = model.prepare(items)
    return [c.padded for c in prepared.chunks] if isinstance(model, Embedder) else [prepared.padded]


@pytest.mark.parametrize("buckets", [False, True], ids=["eager", "bucketed"])
@pytest.mark.parametrize("kind", ["embed", "sentiment"])
@pytest.mark.parametrize("items", [SAME, MIXED], ids=["unpadded", "padded"])
def test_launch_reads_nothing_from_the_device(
    hf_cache: str, kind: str, buckets: bool, items: list[dict[str, Any]]
) -> None:
    model = runner(kind, hf_cache, buckets)
    assert chunks(model, items) == [items is MIXED]  # the case is the one named
    with torch.inference_mode():
        seen, answers = launched(model, items)
        assert seen == []
        model.given_mask = False  # the 2D mask: transformers reads it, once a pass
        before, read_path = launched(model, items)
    assert len(before) == 1, before  # what this test found before the fix
    if kind == "embed":
        cosine = torch.nn.functional.cosine_similarity(answers, read_path)
        assert cosine.min().item() >= 0.99999
    else:
        assert torch.allclose(answers, read_path, atol=1e-5)


@pytest.fixture
def eager_attention(hf_cache: str) -> Iterator[TextClassifier]:
    """A classifier whose model runs transformers' eager attention (an additive mask);
    the shared weights' attention restored after."""
    model = TextClassifier(model="tiny:sentiment", device="cpu", cache_dir=hf_cache)
    was = model.model.config._attn_implementation
    model.model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.model.set_attn_implementation(was)


def test_eager_attention_reads_nothing_either(eager_attention: TextClassifier) -> None:
    model = eager_attention
    assert model.model.config._attn_implementation == "eager"
    assert model.given_mask
    with torch.inference_mode():
        seen, answers = launched(model, MIXED)
        model.given_mask = False
        before, read_path = launched(model, MIXED)
    assert seen == []
    assert len(before) == 1, before
    assert torch.allclose(answers, read_path, atol=1e-5)


def test_padded_is_read_from_the_host_mask() -> None:
    assert not padded({"attention_mask": torch.ones(2, 3, dtype=torch.long)})
    assert padded({"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    assert not padded({"input_ids": torch.ones(2, 3, dtype=torch.long)})  # no mask at all
