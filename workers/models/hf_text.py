"""Hugging Face runners that call ``generate``: abstractive summaries and continuations.

Same contract as :mod:`workers.models.hf`: built once per worker process with ``model``,
``device``, ``dtype``, ``cache_dir`` and the options below, then called with whole batches
(one tokenizer call, one ``generate`` call). Results hold plain JSON types only.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, StoppingCriteriaList

from pipelines.errors import InvalidInput
from pipelines.model import Item, Result, check_deadline
from workers.models.decoder import Decoder, supports
from workers.models.hf_base import item_texts
from workers.models.hf_generate import GenerateRunner, InTime, RowStreamer, check_range
from workers.models.seq2seq import decoder_of
from workers.models.stops import cut, held, stops_of

logger = logging.getLogger(__name__)

SAMPLING = ("temperature", "top_p", "seed")
"""An item's own sampling fields (:meth:`Generator.sampling_of`)."""
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The chat template of a tokenizer that has none: a ``role: content`` line a message,
then ``assistant:``."""


class Summarizer(GenerateRunner):
    """Abstractive summaries from a sequence-to-sequence model (BART, T5, Pegasus, ...).

    Transformers 5 has no summarization pipeline, so this calls ``generate`` directly.
    Result per item: ``{"summary": str}``.

    Args:
        max_new_tokens: most tokens per summary.
        num_beams: beam width; 1 is greedy decoding.
        min_new_tokens: fewest tokens per summary (end-of-sequence is suppressed until then).
        load: how to load the model (:class:`~workers.models.hf_base.LoadOptions`), such
            as ``model="tiny:summarize"``; ``max_length`` bounds the input tokens per text.
    """

    auto_cls = AutoModelForSeq2SeqLM

    def __init__(
        self, *, max_new_tokens: int = 60, num_beams: int = 1, min_new_tokens: int = 0, **load: Any
    ) -> None:
        if max_new_tokens < 1 or num_beams < 1:
            raise ValueError(
                "max_new_tokens and num_beams must be at least 1, "
                f"got {max_new_tokens} and {num_beams}"
            )
        check_range("min_new_tokens", min_new_tokens, 0, ("max_new_tokens", max_new_tokens))
        super().__init__(max_new_tokens, **load)
        self.num_beams = num_beams
        self.min_new_tokens = min_new_tokens

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
                stopping_criteria=StoppingCriteriaList([InTime()]),
            )
        summaries = self.tokenizer.batch_decode(output, skip_special_tokens=True)
        return [{"summary": summary.strip()} for summary in summaries]

    def continuous_decoder(self, budget: int) -> Decoder | None:
        """A running batch for continuous decoding (:mod:`workers.models.seq2seq`), or None."""
        return decoder_of(self, budget)


class Generator(GenerateRunner):
    """Continuations from a decoder-only (causal) language model.

    Prompts are left-padded so that every row's last prompt token sits at the end of the
    batch and generation continues from it. An item may carry its own ``max_new_tokens``;
    the batch generates once up to the largest and each row is cut to its own limit (and at
    its first end-of-sequence). Result per item: ``{"generated_text": str}``, the new text
    only, without the prompt. An item with ``messages`` is a chat: its prompt is the
    messages rendered by the chat template. An item with ``stop`` strings ends before the
    first of them (:mod:`workers.models.stops`). An item with ``usage`` true also gets
    ``prompt_tokens``, ``completion_tokens`` (counted by the tokenizer) and
    ``finish_reason`` (``length``: cut at its limit; else ``stop``).

    Args:
        max_new_tokens: default new tokens per item, when the item has no ``max_new_tokens``.
        max_new_tokens_limit: the most an item may ask for; items above it are refused.
        do_sample: sample instead of greedy decoding.
        temperature: sampling temperature (only with ``do_sample``).
        top_p: nucleus sampling mass (only with ``do_sample``).
        chat_template: a Jinja chat template for ``messages`` (None: the tokenizer's own,
            else :data:`DEFAULT_CHAT_TEMPLATE`).
        load: how to load the model (:class:`~workers.models.hf_base.LoadOptions`), such
            as ``model="tiny:generate"``; prompts longer than ``max_length`` keep their end.
    """

    auto_cls = AutoModelForCausalLM

    def __init__(
        self,
        *,
        max_new_tokens: int = 32,
        max_new_tokens_limit: int = 512,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        chat_template: str | None = None,
        **load: Any,
    ) -> None:
        limit = ("max_new_tokens_limit", max_new_tokens_limit)
        check_range("max_new_tokens", max_new_tokens, 1, limit)
        super().__init__(max_new_tokens, **load)
        self.max_new_tokens_limit = max_new_tokens_limit
        self.chat_template: str = (
            chat_template or getattr(self.tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        )
        self.do_sample = do_sample
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

    @property
    def positions(self) -> int | None:
        """The model's position table size, where it has one (absolute positions: GPT-2):
        no generation may run past it."""
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return positions if isinstance(positions, int) else None

    def sampling_of(
        self, item: Item, name: str | None = None
    ) -> tuple[tuple[float, float] | None, torch.Generator | None]:
        """How ``item`` picks its tokens: (temperature, top_p) and its own random source,
        or (None, None) for greedy. The item's ``temperature``, ``top_p`` and ``seed``
        override the runner's; a temperature of 0 is greedy. Without a seed, the source is
        seeded from ``name`` (the request's id: the same text again if another worker
        takes the request over), else at random."""
        temperature = item.get("temperature")
        if temperature is None:
            temperature = self.sampling.get("temperature", 1.0) if self.do_sample else 0.0
        if temperature == 0:
            return None, None
        top_p = item.get("top_p")
        if top_p is None:
            top_p = self.sampling.get("top_p", 1.0)
        source = torch.Generator()
        seed = item.get("seed")
        if seed is not None:
            source.manual_seed(int(seed))
        elif name is not None:
            digest = hashlib.sha256(name.encode()).digest()
            source.manual_seed(int.from_bytes(digest[:8], "big") >> 1)
        else:
            source.seed()
        return (float(temperature), float(top_p)), source

    def continuous_decoder(self, budget: int) -> Decoder | None:
        """A running batch of this model for continuous batching
        (:mod:`workers.decoding`) holding at most ``budget`` token positions, or None
        (one line says why) where its cache is not of the kind that can join and leave."""
        overridden = [
            name
            for name in ("predict", "predict_stream", "generate_ids")
            if getattr(type(self), name) is not getattr(Generator, name)
        ]
        # A subclass that decodes its own way keeps it: the decoder would bypass it; so
        # does a model whose generation config asks for what the decoder does not apply.
        processors = self._processors()
        if overridden:
            why: str | None = f"it overrides {', '.join(overridden)}"
        elif processors:
            why = f"its generation config sets {', '.join(processors)}"
        else:
            why = supports(self)
        if why is not None:
            name = getattr(self, "weights_key", type(self).__name__)
            logger.warning("model %s decodes in static batches: %s", name, why)
            return None
        return Decoder(self, budget)

    def _processors(self) -> list[str]:
        """The fields of the model's generation config that change how tokens are picked
        beyond temperature and top-p (the decoder applies those two only)."""
        config = self.model.generation_config
        plain = {
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "encoder_no_repeat_ngram_size": 0,
            "bad_words_ids": None,
            "suppress_tokens": None,
            "begin_suppress_tokens": None,
            "forced_bos_token_id": None,
            "forced_eos_token_id": None,
            "min_new_tokens": None,
            "num_beams": 1,
            "typical_p": 1.0,
            "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0,
            "diversity_penalty": 0.0,
        }
        return [
            name
            for name, value in plain.items()
            if getattr(config, name, value) not in (value, None)
        ]

    def limits(self, items: list[Item]) -> list[int]:
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

    def prompts(self, items: list[Item]) -> list[str]:
        """Each item's prompt: its text, or its ``messages`` through the chat template.

        Raises:
            InvalidInput: the chat template refuses an item's messages (its
                ``raise_exception``: a role, an order).
        """
        texts = item_texts(items)
        for index, item in enumerate(items):
            messages = item.get("messages")
            if messages is None:
                continue
            # transformers renders a template with jinja2 (its chat-template extra) and
            # cannot without it; imported here, plain prompts need none.
            from jinja2 import TemplateError, TemplateSyntaxError

            try:
                rendered = self.tokenizer.apply_chat_template(
                    messages,
                    chat_template=self.chat_template,
                    tokenize=False,
                    add_generation_prompt=True,
                )
            except TemplateSyntaxError:
                raise  # the template itself is broken: the stage's fault, not the chat's
            except TemplateError as exc:  # it refused these messages (a role, an order)
                raise InvalidInput(
                    f"item {index}: the model's chat template refused the messages: {exc}"
                ) from None
            texts[index] = str(rendered)
        return texts

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
        if any(item.get(k) is not None for item in items for k in (*SAMPLING, "stop")):
            # An item's own sampling or stop strings: generate() takes one of each a batch.
            return self._decoded(items, on_tokens)
        limits = self.limits(items)
        budget = max(limits)
        prompt_length = self.max_length
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            # Absolute-position models cannot run past their table. The output gets room by
            # cutting the prompt's start, but the prompt keeps at least half the table;
            # past that, generation stops at the table's end ("at most" max_new_tokens).
            prompt_length = min(prompt_length, max(positions - budget, positions // 2))
        encoding = self.encode(self.prompts(items), max_length=prompt_length)
        if isinstance(positions, int):
            budget = min(budget, positions - encoding["input_ids"].shape[1])
            limits = [min(limit, budget) for limit in limits]
        with torch.inference_mode():
            # generate() derives position ids from the attention mask, so left padding
            # does not shift the positions of absolute-position models such as GPT-2.
            streamer = None if on_tokens is None else RowStreamer(limits, self.eos_ids, on_tokens)
            output = self.model.generate(
                input_ids=encoding["input_ids"],
                attention_mask=encoding["attention_mask"],
                max_new_tokens=budget,
                pad_token_id=self.tokenizer.pad_token_id,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([InTime()]),
                **self.sampling,
            )
        rows: list[list[int]] = output[:, encoding["input_ids"].shape[1] :].tolist()
        results = []
        for row, limit in zip(rows, limits, strict=True):
            row = row[:limit]
            end = next((i for i, token in enumerate(row) if token in self.eos_ids), len(row))
            results.append(row[:end])
        return results

    def _decoded(
        self, items: list[Item], on_tokens: Callable[[int, list[int]], None] | None
    ) -> list[list[int]]:
        """:meth:`generate_ids` for a batch where an item picks its own sampling or stop
        strings (``generate`` takes one setting a batch): the items decoded together, each
        from its own random source and leaving at its stop, as continuous batching
        decodes them."""
        decoder = Decoder(self, budget=sys.maxsize)
        generations = []
        for opened in decoder.open(items):
            if isinstance(opened, BaseException):
                raise opened
            generations.append(opened)
        lengths = [0] * len(generations)
        decoder.prefill(generations)
        while True:
            for index, generation in enumerate(generations):
                if on_tokens is not None and len(generation.ids) != lengths[index]:
                    lengths[index] = len(generation.ids)
                    on_tokens(index, generation.ids)
            if not decoder.rows:
                return [generation.ids for generation in generations]
            check_deadline()
            decoder.advance()

    def predict(self, items: list[Item]) -> list[Result]:
        """Continue each item's text.

        Args:
            items: ``{"text": str, "max_new_tokens": int (optional)}`` dicts.

        Returns:
            ``{"generated_text": str}`` per item (the continuation only).
        """
        return self._results(items, self.generate_ids(items))

    def _results(self, items: list[Item], rows: list[list[int]]) -> list[Result]:
        results: list[Result] = []
        asked = [i for i, item in enumerate(items) if item.get("usage") is True]
        # Counted again, for the items that ask only: the prompt as the model ran it
        # (truncated as generate_ids truncates it, at most), the new ids as returned.
        prompts = self.prompts([items[i] for i in asked]) if asked else []
        counted = dict(zip(asked, self._prompt_tokens(prompts), strict=True))
        limits = self.limits(items) if asked else []
        for index, ids in enumerate(rows):
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
            text, stopped = cut(text, stops_of(items[index]))
            result: Result = {"generated_text": text}
            if index in counted:
                result["prompt_tokens"] = counted[index]
                result["completion_tokens"] = len(ids)
                # At its limit: cut, not ended (the model chose no end-of-sequence).
                cut_short = len(ids) >= limits[index] and not stopped
                result["finish_reason"] = "length" if cut_short else "stop"
            results.append(result)
        return results

    def _prompt_tokens(self, prompts: list[str]) -> list[int]:
        if not prompts:
            return []
        encoded = self.tokenizer(prompts, truncation=True, max_length=self.max_length)
        return [len(ids) for ids in encoded["input_ids"]]

    def text_so_far(self, ids: list[int]) -> str:
        """A row's text, decoded whole from its new ``ids``, for streaming: a trailing
        U+FFFD (half a character, which the next token completes) held back."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)).rstrip("\ufffd")

    def predict_stream(self, items: list[Item], emit: Callable[[int, str], None]) -> list[Result]:
        """:meth:`predict`, calling ``emit(row, text_so_far)`` as each row grows.

        Each row of the batch streams on its own; the text is decoded whole each time, so
        a token that only completes a character with the next one is never cut in half. A
        byte-level tokenizer (GPT-2's) decodes half a character as U+FFFD, which the next
        token turns into the character: a trailing U+FFFD is held back until then, so what
        was emitted is always the start of what comes next. So is what could still become
        a stop string (:func:`~workers.models.stops.held`); the result has the rest.
        """
        stops = [stops_of(item) for item in items]

        def on_tokens(index: int, ids: list[int]) -> None:
            emit(index, held(self.text_so_far(ids), stops[index]))

        return self._results(items, self.generate_ids(items, on_tokens))

    def warm_paths(self, rows: int) -> None:
        """Run each path a static batch can take once (at load, before the stage says
        ready: :func:`~workers.build.prepare_shapes`): ``generate`` greedy on one prompt
        and on ``rows`` of different lengths, streamed, and a batch that samples (its own
        temperature and top-p: the decoder's path).

        Args:
            rows: the stage's most items a batch.
        """
        words = ["warm", "the", "model", "up", "before", "the", "first", "request", "comes"]
        items: list[Item] = [
            {"text": " ".join(words[: 1 + i % len(words)]), "max_new_tokens": 2}
            for i in range(max(rows, 1))
        ]
        self.predict(items[:1])
        self.predict_stream(items, lambda index, text: None)
        self.predict([{"text": "warm", "max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9}])
