"""Hugging Face runners that produce text: abstractive and extractive summaries, generation.

Same contract as :mod:`workers.models.hf`: built once per worker process with ``model``,
``device``, ``dtype``, ``cache_dir`` and the options below, then called with whole batches
(one tokenizer call, one ``generate`` call). Results hold plain JSON types only.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

from pipelines.errors import InvalidInput
from pipelines.model import Item, Result
from workers.models.hf_base import MAX_LENGTH_CAP, HFRunner, item_texts
from workers.models.hf_encode import Embedder

logger = logging.getLogger(__name__)


def _drop_length_defaults(model: PreTrainedModel) -> None:
    """Let the runner's ``*_new_tokens`` options alone bound the output length.

    Hub checkpoints often ship ``max_length``/``min_length`` in their generation config
    (distilbart: 142 and 56). ``generate`` gives ``max_new_tokens``/``min_new_tokens``
    precedence anyway, but logs two warnings per batch when both are set.
    """
    model.generation_config.max_length = None
    model.generation_config.min_length = None


class Summarizer(HFRunner):
    """Abstractive summaries from a sequence-to-sequence model (BART, T5, Pegasus, ...).

    Transformers 5 has no summarization pipeline, so this calls ``generate`` directly.
    Result per item: ``{"summary": str}``.

    Args:
        model: hub id, local path or ``"tiny:summarize"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: ``"auto"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        cache_dir: where generated models are kept.
        max_new_tokens: most tokens per summary.
        num_beams: beam width; 1 is greedy decoding.
        min_new_tokens: fewest tokens per summary (end-of-sequence is suppressed until then).
        max_length: most input tokens per text; longer texts are truncated.
    """

    auto_cls = AutoModelForSeq2SeqLM

    def __init__(
        self,
        *,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        cache_dir: str,
        max_new_tokens: int = 60,
        num_beams: int = 1,
        min_new_tokens: int = 0,
        max_length: int = MAX_LENGTH_CAP,
    ) -> None:
        if max_new_tokens < 1 or num_beams < 1:
            raise ValueError(
                "max_new_tokens and num_beams must be at least 1, "
                f"got {max_new_tokens} and {num_beams}"
            )
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], "
                f"got {min_new_tokens}"
            )
        super().__init__(
            model=model,
            device=device,
            dtype=dtype,
            cache_dir=cache_dir,
            max_length=max_length,
        )
        self.max_new_tokens = max_new_tokens
        self.num_beams = num_beams
        self.min_new_tokens = min_new_tokens
        _drop_length_defaults(self.model)

    def predict(self, items: list[Item]) -> list[Result]:
        """Summarize each item's text.

        Args:
            items: ``{"text": str}`` dicts.

        Returns:
            ``{"summary": str}`` per item.
        """
        if not items:
            return []
        encoding = self.encode(item_texts(items))
        with torch.inference_mode():
            # Only ids and mask: BERT-style tokenizers also return token_type_ids, which
            # seq2seq models reject.
            output = self.model.generate(
                input_ids=encoding["input_ids"],
                attention_mask=encoding["attention_mask"],
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.min_new_tokens,
                num_beams=self.num_beams,
                do_sample=False,
            )
        summaries = self.tokenizer.batch_decode(output, skip_special_tokens=True)
        return [{"summary": summary.strip()} for summary in summaries]


class _RowStreamer:
    """What ``generate(streamer=...)`` feeds: the prompt first, then each step's new token
    per row. Keeps every row's new ids, cut at its limit and first end-of-sequence."""

    def __init__(
        self, limits: list[int], eos_ids: set[int], on_tokens: Callable[[int, list[int]], None]
    ) -> None:
        self.limits = limits
        self.eos_ids = eos_ids
        self.on_tokens = on_tokens
        self.rows: list[list[int]] = [[] for _ in limits]
        self.done = [False] * len(limits)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        for index, token in enumerate(value.reshape(-1).tolist()):
            if self.done[index]:
                continue
            if token in self.eos_ids:
                self.done[index] = True
                continue
            self.rows[index].append(token)
            self.done[index] = len(self.rows[index]) >= self.limits[index]
            self.on_tokens(index, self.rows[index])

    def end(self) -> None:
        """Generation finished (nothing left to flush: rows are reported as they grow)."""


class Generator(HFRunner):
    """Continuations from a decoder-only (causal) language model.

    Prompts are left-padded so that every row's last prompt token sits at the end of the
    batch and generation continues from it. An item may carry its own ``max_new_tokens``;
    the batch generates once up to the largest and each row is cut to its own limit (and at
    its first end-of-sequence). Result per item: ``{"generated_text": str}``, the new text
    only, without the prompt.

    Args:
        model: hub id, local path or ``"tiny:generate"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: ``"auto"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        cache_dir: where generated models are kept.
        max_new_tokens: default new tokens per item, when the item has no ``max_new_tokens``.
        max_new_tokens_limit: the most an item may ask for; items above it are refused.
        do_sample: sample instead of greedy decoding.
        temperature: sampling temperature (only with ``do_sample``).
        top_p: nucleus sampling mass (only with ``do_sample``).
        max_length: most prompt tokens; longer prompts keep their end.
    """

    auto_cls = AutoModelForCausalLM

    def __init__(
        self,
        *,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        cache_dir: str,
        max_new_tokens: int = 32,
        max_new_tokens_limit: int = 512,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_length: int = MAX_LENGTH_CAP,
    ) -> None:
        if not 1 <= max_new_tokens <= max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens must be in [1, max_new_tokens_limit={max_new_tokens_limit}], "
                f"got {max_new_tokens}"
            )
        super().__init__(
            model=model,
            device=device,
            dtype=dtype,
            cache_dir=cache_dir,
            max_length=max_length,
        )
        self.max_new_tokens = max_new_tokens
        self.max_new_tokens_limit = max_new_tokens_limit
        _drop_length_defaults(self.model)
        self.sampling: dict[str, float | bool] = {"do_sample": do_sample}
        if do_sample:
            self.sampling.update(temperature=temperature, top_p=top_p)
        self.tokenizer.padding_side = "left"
        # A prompt's end is what the continuation follows, so truncation drops its start.
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            # Padding positions are masked out, so any id will do; EOS always exists.
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in [*eos_ids, self.tokenizer.eos_token_id] if i is not None}

    def _limits(self, items: list[Item]) -> list[int]:
        limits = []
        for index, item in enumerate(items):
            limit = item.get("max_new_tokens", self.max_new_tokens)
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise ValueError(f"item {index}: max_new_tokens must be an integer, got {limit!r}")
            if not 1 <= limit <= self.max_new_tokens_limit:
                raise InvalidInput(
                    f"item {index}: max_new_tokens must be in [1, {self.max_new_tokens_limit}], "
                    f"got {limit}"
                )
            limits.append(limit)
        return limits

    def generate_ids(
        self, items: list[Item], on_tokens: Callable[[int, list[int]], None] | None = None
    ) -> list[list[int]]:
        """Generate the new token ids for each item.

        Args:
            items: ``{"text": str, "max_new_tokens": int (optional)}`` dicts.
            on_tokens: called from inside ``generate`` after each step with a row's
                index and its new ids so far (cut like the result), for streaming.

        Returns:
            Per item, its new token ids: at most its ``max_new_tokens``, ending before the
            first end-of-sequence token. A model with a position table (GPT-2) gives the
            output room by cutting the prompt's start down to no less than half the table,
            and stops generating at the table's end.

        Raises:
            ValueError: an item's ``max_new_tokens`` is not an integer.
            InvalidInput: an item's ``max_new_tokens`` is above ``max_new_tokens_limit``.
        """
        if not items:
            return []
        limits = self._limits(items)
        budget = max(limits)
        prompt_length = self.max_length
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            # Absolute-position models cannot run past their table. The output gets room by
            # cutting the prompt's start, but the prompt keeps at least half the table;
            # past that, generation stops at the table's end ("at most" max_new_tokens).
            prompt_length = min(prompt_length, max(positions - budget, positions // 2))
        encoding = self.encode(item_texts(items), max_length=prompt_length)
        if isinstance(positions, int):
            budget = min(budget, positions - encoding["input_ids"].shape[1])
            limits = [min(limit, budget) for limit in limits]
        with torch.inference_mode():
            # generate() derives position ids from the attention mask, so left padding
            # does not shift the positions of absolute-position models such as GPT-2.
            streamer = None if on_tokens is None else _RowStreamer(limits, self.eos_ids, on_tokens)
            output = self.model.generate(
                input_ids=encoding["input_ids"],
                attention_mask=encoding["attention_mask"],
                max_new_tokens=budget,
                pad_token_id=self.tokenizer.pad_token_id,
                streamer=streamer,
                **self.sampling,
            )
        rows: list[list[int]] = output[:, encoding["input_ids"].shape[1] :].tolist()
        results = []
        for row, limit in zip(rows, limits, strict=True):
            row = row[:limit]
            end = next((i for i, token in enumerate(row) if token in self.eos_ids), len(row))
            results.append(row[:end])
        return results

    def predict(self, items: list[Item]) -> list[Result]:
        """Continue each item's text.

        Args:
            items: ``{"text": str, "max_new_tokens": int (optional)}`` dicts.

        Returns:
            ``{"generated_text": str}`` per item (the continuation only).
        """
        return [
            {"generated_text": self.tokenizer.decode(ids, skip_special_tokens=True)}
            for ids in self.generate_ids(items)
        ]

    def predict_stream(self, items: list[Item], emit: Callable[[int, str], None]) -> list[Result]:
        """:meth:`predict`, calling ``emit(row, text_so_far)`` as each row grows.

        Each row of the batch streams on its own; the text is decoded whole each time, so
        a token that only completes a character with the next one is never cut in half. A
        byte-level tokenizer (GPT-2's) decodes half a character as U+FFFD, which the next
        token turns into the character: a trailing U+FFFD is held back until then, so what
        was emitted is always the start of what comes next.
        """

        def on_tokens(index: int, ids: list[int]) -> None:
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
            emit(index, text.rstrip("\ufffd"))

        return [
            {"generated_text": self.tokenizer.decode(ids, skip_special_tokens=True)}
            for ids in self.generate_ids(items, on_tokens)
        ]


# A sentence ends at . ! or ? (optionally followed by a closing quote or bracket) and
# whitespace; a line break always ends one. Abbreviations ("e.g. this") split wrongly,
# which costs little here: a fragment is simply a less central "sentence".
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"'\u201d\u2019)\]])\s+|\s*\n\s*")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with a simple punctuation rule.

    Args:
        text: any text.

    Returns:
        The non-empty sentences, stripped, in order.
    """
    return [part.strip() for part in _SENTENCE_BREAK.split(text) if part.strip()]


class ExtractiveSummarizer:
    """Extractive summaries: the sentences closest in meaning to the whole document.

    Each text is split into sentences; the sentences are embedded with a real sentence
    encoder (all sentences of the batch together, in chunks of ``batch_size``), scored by
    cosine similarity to the mean of the text's sentence embeddings, and the best
    ``num_sentences`` are kept in their original order. A text with no more sentences than
    that is returned as it is. Result per item: ``{"summary": str}``.

    Args:
        model: the sentence encoder: ``"minilm"`` (bundled), a hub id or a local path.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: ``"auto"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        cache_dir: where generated models are kept.
        num_sentences: sentences per summary.
        batch_size: most sentences per forward pass.
        max_length: most tokens per sentence.
    """

    def __init__(
        self,
        *,
        model: str = "minilm",
        device: str = "auto",
        dtype: str = "auto",
        cache_dir: str,
        num_sentences: int = 3,
        batch_size: int = 64,
        max_length: int = MAX_LENGTH_CAP,
    ) -> None:
        if num_sentences < 1:
            raise ValueError(f"num_sentences must be at least 1, got {num_sentences}")
        started = time.perf_counter()
        self.embedder = Embedder(
            model=model,
            device=device,
            dtype=dtype,
            cache_dir=cache_dir,
            normalize=True,
            batch_size=batch_size,
            max_length=max_length,
        )
        self.num_sentences = num_sentences
        logger.info(
            "ExtractiveSummarizer loaded %s on %s as %s in %.2fs (num_sentences=%d)",
            self.embedder.model_path,
            self.embedder.device,
            self.embedder.dtype,
            time.perf_counter() - started,
            num_sentences,
        )

    def predict(self, items: list[Item]) -> list[Result]:
        """Summarize each item's text by picking its most central sentences.

        Args:
            items: ``{"text": str}`` dicts.

        Returns:
            ``{"summary": str}`` per item.
        """
        texts = item_texts(items)
        documents = [split_sentences(text) for text in texts]
        to_rank = [
            i for i, sentences in enumerate(documents) if len(sentences) > self.num_sentences
        ]
        embeddings = self.embedder.embed([s for i in to_rank for s in documents[i]])
        results: list[Result] = [{"summary": text} for text in texts]
        offset = 0
        for i in to_rank:
            sentences = documents[i]
            vectors = embeddings[offset : offset + len(sentences)]
            offset += len(sentences)
            # Rows are unit vectors, so a dot product with the normalised centroid is the
            # cosine similarity.
            centroid = torch.nn.functional.normalize(vectors.mean(dim=0), dim=0)
            best = (vectors @ centroid).topk(self.num_sentences).indices.tolist()
            results[i] = {"summary": " ".join(sentences[j] for j in sorted(best))}
        return results
