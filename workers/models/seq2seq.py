"""Continuous batching for an encoder-decoder model (BART, T5, ...): summaries join and
leave the running batch between decoding steps, as :mod:`workers.models.decoder` does
for a causal model.

A joining group is encoded in one forward (its prompts right-padded: the encoder's
positions count from the start), and its first decoding step runs on its own, which
fills its cross-attention keys and values. Then it joins the batch with its rows: per
layer, the self-attention cache left-padded to the batch's length (as the causal
decoder pads it), the cross-attention cache and the encoder outputs right-padded to the
longest prompt, and the two masks that hide the padding. A summary that ends takes its
rows of all of them along; the columns no row uses any more are cut off both ends.

A decoder with learned absolute positions (BART's) counts them from the cache length,
which the left padding shifts: its position table is read through a forward hook that
gives each row its own positions (the number of real tokens before it). A decoder whose
positions are relative (T5's bias) is not shifted by the padding. Any other kind is
checked at load (:func:`supports`: tokens of prompts that join at different steps equal
to each decoded alone), and decodes in static batches where it fails.

Greedy only, with what ``generate`` applies for the summarizer's generation config
(``min_new_tokens``, ``no_repeat_ngram_size``, ``repetition_penalty``, forced first and
last tokens), applied per row by transformers' own processors: a summary's tokens are
those ``generate`` gives it alone.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.modeling_outputs import BaseModelOutput

from pipelines.model import Item, Result
from workers.models.blocks import in_blocks
from workers.models.decoder import Decoder, Generation, _cache_of, _left_pad
from workers.models.hf_base import item_texts

logger = logging.getLogger(__name__)

PLAIN = {
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "encoder_no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "diversity_penalty": 0.0,
    "sequence_bias": None,
    "guidance_scale": None,
    "exponential_decay_length_penalty": None,
    "min_length": None,
}
"""Generation-config fields the decoder does not apply, with their no-op values: a model
that sets one decodes in static batches."""


class Summaries:
    """What :class:`~workers.models.decoder.Decoder` needs of a generator
    (:class:`~workers.models.decoder.Decodable`), for a
    :class:`~workers.models.hf_text.Summarizer`: each item's text is the encoder's
    prompt, its limit the summarizer's ``max_new_tokens``, its tokens greedy.

    Args:
        summarizer: the runner (its model, tokenizer, ``max_new_tokens``,
            ``min_new_tokens``).
    """

    def __init__(self, summarizer: Any) -> None:
        self.model: Any = summarizer.model
        self.device: torch.device = summarizer.device
        self.tokenizer: PreTrainedTokenizerBase = summarizer.tokenizer
        self.max_length: int = summarizer.max_length
        self.max_new_tokens: int = summarizer.max_new_tokens
        self.min_new_tokens: int = summarizer.min_new_tokens
        config = self.model.generation_config
        eos = config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids: set[int] = {int(i) for i in (eos if isinstance(eos, list) else [eos])}
        start = config.decoder_start_token_id
        if start is None:
            start = self.model.config.decoder_start_token_id
        self.start = int(start if start is not None else self.tokenizer.pad_token_id or 0)

    @property
    def positions(self) -> int | None:
        """None: the prompt goes to the encoder, which the output does not share."""
        return None

    def limits(self, items: list[Item]) -> list[int]:
        return [self.max_new_tokens] * len(items)

    def prompts(self, items: list[Item]) -> list[str]:
        return item_texts(items)

    def sampling_of(
        self, item: Item, name: str | None = None
    ) -> tuple[tuple[float, float] | None, torch.Generator | None]:
        return None, None  # greedy, as Summarizer.predict

    def text_so_far(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)).rstrip("\ufffd")

    def unapplied(self) -> list[str]:
        """The generation-config fields this decoder would not apply (see :data:`PLAIN`)."""
        config = self.model.generation_config
        return [n for n, v in PLAIN.items() if getattr(config, n, v) not in (v, None, 0)]

    def processors(self, generation: Generation) -> LogitsProcessorList:
        """What ``generate`` applies to this summary's scores, in its order (the decoder
        input counting its start token, as ``generate`` counts it)."""
        config = self.model.generation_config
        found: list[LogitsProcessor] = []
        penalty = config.repetition_penalty
        if penalty is not None and penalty != 1.0:
            found.append(RepetitionPenaltyLogitsProcessor(float(penalty)))
        if config.no_repeat_ngram_size:
            found.append(NoRepeatNGramLogitsProcessor(int(config.no_repeat_ngram_size)))
        if self.min_new_tokens > 0:
            eos = sorted(self.eos_ids)
            found.append(MinNewTokensLengthLogitsProcessor(1, self.min_new_tokens, eos))
        if config.forced_bos_token_id is not None:
            found.append(ForcedBOSTokenLogitsProcessor(int(config.forced_bos_token_id)))
        if config.forced_eos_token_id is not None:
            forced = config.forced_eos_token_id
            found.append(ForcedEOSTokenLogitsProcessor(1 + generation.limit, forced))
        return LogitsProcessorList(found)


class Seq2SeqDecoder(Decoder):
    """The running batch of an encoder-decoder model (see the module).

    Args:
        runner: the summarizer, as :class:`Summaries`.
        budget: the most token positions it holds (prompt and new tokens a row, times
            the rows, as :class:`~workers.models.decoder.Decoder` counts them).
    """

    def __init__(self, runner: Summaries, budget: int) -> None:
        super().__init__(runner, budget)
        self.summaries = runner
        self._hidden: torch.Tensor | None = None  # encoder outputs [rows, S, d]
        self._encoded = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [rows, S]
        self._positions = _positions_of(self.model)
        self._processed = bool(runner.processors(Generation({}, [], 1, None, None)))

    def prefill(self, generations: list[Generation]) -> list[Generation]:
        if not generations:
            return []
        width = max(len(g.prompt) for g in generations)
        pad = int(self.runner.tokenizer.pad_token_id or 0)
        ids = torch.full((len(generations), width), pad, dtype=torch.long)
        encoded = torch.zeros((len(generations), width), dtype=torch.long)
        for row, generation in enumerate(generations):
            ids[row, : len(generation.prompt)] = torch.tensor(generation.prompt)
            encoded[row, : len(generation.prompt)] = 1
        ids, encoded = ids.to(self.device), encoded.to(self.device)
        start = torch.full((len(generations), 1), self.summaries.start, device=self.device)
        mask = torch.ones_like(start)
        with torch.inference_mode():
            hidden = self.model.get_encoder()(input_ids=ids, attention_mask=encoded)[0]
            out = self._forward(hidden, encoded, start, mask, None, mask - 1)
        chosen = self._choose(out.logits[:, -1, :], generations)
        self._join(_cache_of(out), hidden, encoded, mask, chosen)
        self.rows.extend(generations)
        return self._record(generations, chosen.tolist())

    def advance(self) -> list[Generation]:
        if not self.rows:
            return []
        assert self._hidden is not None
        ones = torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)
        positions = self._mask.sum(-1, keepdim=True)  # real tokens before the new one
        mask = torch.cat([self._mask, ones], dim=1)
        in_blocks(self._cache.self_attention_cache)
        with torch.inference_mode():
            out = self._forward(
                self._hidden, self._encoded, self._next[:, None], mask, self._cache, positions
            )
        self._mask, self._cache = mask, _cache_of(out)
        chosen = self._choose(out.logits[:, -1, :], self.rows)
        self._next = chosen
        return self._record(list(self.rows), chosen.tolist())

    def result(self, generation: Generation) -> Result:
        """The summary, as :meth:`~workers.models.hf_text.Summarizer.predict` gives it."""
        text = str(self.runner.tokenizer.decode(generation.ids, skip_special_tokens=True))
        return {"summary": text.strip()}

    def warm_up(self, rows: int) -> None:
        """Run each path once before the stage says ready (see
        :meth:`~workers.models.decoder.Decoder.warm_up`), two tokens a summary: a
        prefill of one, a join, steps, a prefill of ``rows`` together, the answers."""
        words = "warm the model up before the first request comes"
        items: list[Item] = [{"text": f"{words} {'up ' * i}"} for i in range(max(rows, 2) + 2)]
        opened = [g for g in self.open(items) if not isinstance(g, BaseException)]
        for generation in opened:
            generation.limit = min(generation.limit, 2)
        self.prefill(opened[:1])
        self.prefill(opened[1:2])
        self.advance()
        self.prefill(opened[2:])
        while self.rows:
            self.advance()
        for generation in opened:
            self.result(generation)

    # -- tensors -------------------------------------------------------------------

    def _forward(
        self,
        hidden: torch.Tensor,
        encoded: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        positions: torch.Tensor,
    ) -> Any:
        """One decoder forward over the encoder outputs, each row at its own positions."""
        cached = {} if cache is None else {self._cache_arg: cache}
        if self._positions is not None:
            self._positions.rows = positions
        try:
            return self.model(
                encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
                attention_mask=encoded,
                decoder_input_ids=ids,
                decoder_attention_mask=mask,
                use_cache=True,
                **cached,
            )
        finally:
            if self._positions is not None:
                self._positions.rows = None

    def _choose(self, logits: torch.Tensor, generations: list[Generation]) -> torch.Tensor:
        """Each row's next token, greedy, after what ``generate`` would apply to it."""
        if self._processed:
            start = self.summaries.start
            picked = []
            for row, generation in enumerate(generations):
                ids: Any = torch.tensor([[start, *generation.ids]], device=self.device)
                processors = self.summaries.processors(generation)
                picked.append(processors(ids, logits[row : row + 1].float()))
            logits = torch.cat(picked)
        return logits.argmax(dim=-1)

    def _join(
        self,
        cache: Any,
        hidden: torch.Tensor,
        encoded: torch.Tensor,
        mask: torch.Tensor,
        chosen: torch.Tensor,
    ) -> None:
        """Add a prefilled group under the batch: its self-attention cache left-padded,
        its cross-attention cache, encoder outputs and mask right-padded."""
        if not self.rows or self._hidden is None:
            self._cache, self._mask, self._next = cache, mask, chosen
            self._hidden, self._encoded = hidden, encoded
            return
        width = max(self._mask.shape[1], mask.shape[1])
        pairs = zip(
            self._cache.self_attention_cache.layers, cache.self_attention_cache.layers, strict=True
        )
        for old, new in pairs:
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(mask, width)])
        self._next = torch.cat([self._next, chosen])
        span = max(self._encoded.shape[1], encoded.shape[1])
        crossed = zip(
            self._cache.cross_attention_cache.layers,
            cache.cross_attention_cache.layers,
            strict=True,
        )
        for old, new in crossed:
            old.keys = torch.cat([_right_pad(old.keys, span, 2), _right_pad(new.keys, span, 2)])
            old.values = torch.cat(
                [_right_pad(old.values, span, 2), _right_pad(new.values, span, 2)]
            )
        self._hidden = torch.cat([_right_pad(self._hidden, span, 1), _right_pad(hidden, span, 1)])
        self._encoded = torch.cat(
            [_right_pad(self._encoded, span, 1), _right_pad(encoded, span, 1)]
        )

    def _keep(self, rows: list[int]) -> None:
        """Keep only ``rows``, then cut the self-attention columns none of them uses off
        the left, and the encoder positions none of them uses off the right."""
        self.rows = [self.rows[i] for i in rows]
        if not rows:
            self._cache, self._hidden = None, None
            self._mask, self._encoded = self._mask[:0, :0], self._encoded[:0, :0]
            self._next = self._next[:0]
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self._mask = mask[:, start:]
        self._next = self._next.index_select(0, index)
        for layer in self._cache.self_attention_cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:, :]
            layer.values = layer.values.index_select(0, index)[:, :, start:, :]
        encoded = self._encoded.index_select(0, index)
        read = encoded.any(dim=0).nonzero()
        end = int(read[-1]) + 1 if len(read) else 0
        self._encoded = encoded[:, :end]
        assert self._hidden is not None
        self._hidden = self._hidden.index_select(0, index)[:, :end]
        for layer in self._cache.cross_attention_cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, :end, :]
            layer.values = layer.values.index_select(0, index)[:, :, :end, :]


def _right_pad(tensor: torch.Tensor, width: int, axis: int) -> torch.Tensor:
    """``tensor`` padded with zeros on the right of ``axis`` to ``width`` positions."""
    missing = width - tensor.shape[axis]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=axis)


class _RowPositions:
    """A forward hook on a decoder's learned position table: while :attr:`rows` is set
    (``[rows, new tokens]``), the table is read at each row's own positions."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.rows: torch.Tensor | None = None

    def __call__(
        self, module: Any, args: Any, kwargs: Any, output: torch.Tensor
    ) -> torch.Tensor | None:
        if self.rows is None:
            return None  # generate() and the static batches: as the model reads it
        weight = module.weight
        return torch.nn.functional.embedding(self.rows.to(weight.device) + self.offset, weight)


_HOOKS: weakref.WeakKeyDictionary[Any, _RowPositions] = weakref.WeakKeyDictionary()


def _positions_of(model: Any) -> _RowPositions | None:
    """The position hook of ``model``'s decoder (registered once a model), or None where
    its decoder has no learned position table (relative positions: T5)."""
    table = getattr(model.get_decoder(), "embed_positions", None)
    if table is None:
        return None
    hook = _HOOKS.get(table)
    if hook is None:
        offset = getattr(table, "offset", 0)
        hook = _RowPositions(offset if isinstance(offset, int) else 0)
        table.register_forward_hook(hook, with_kwargs=True)
        _HOOKS[table] = hook
    return hook


def decoder_of(summarizer: Any, budget: int) -> Seq2SeqDecoder | None:
    """``summarizer``'s running batch for continuous batching (:mod:`workers.decoding`)
    holding at most ``budget`` token positions, or None (one line says why) where it
    cannot decode so: its class overrides ``predict``, or see :func:`supports`."""
    base = next(c for c in type(summarizer).__mro__ if c.__name__ == "Summarizer")
    if getattr(type(summarizer), "predict", None) is not getattr(base, "predict", None):
        why: str | None = "it overrides predict"
    else:
        why = supports(summarizer)
    if why is not None:
        name = getattr(summarizer, "weights_key", type(summarizer).__name__)
        logger.warning("model %s decodes in static batches: %s", name, why)
        return None
    return Seq2SeqDecoder(Summaries(summarizer), budget)


def supports(summarizer: Any) -> str | None:
    """Why ``summarizer``'s model cannot decode continuously (None: it can): greedy only,
    a generation config the decoder applies, a cache of plain layers, a position table
    it can read per row, and three prompts joining at different steps decoding the
    tokens each gives alone."""
    if getattr(summarizer, "num_beams", 1) != 1:
        return f"it searches {summarizer.num_beams} beams"
    summaries = Summaries(summarizer)
    unapplied = summaries.unapplied()
    if unapplied:
        return f"its generation config sets {', '.join(unapplied)}"
    table = getattr(summarizer.model.get_decoder(), "embed_positions", None)
    if table is not None and not isinstance(table, torch.nn.Embedding):
        return f"its decoder's positions ({type(table).__name__}) are not one table"
    try:
        return _probe(summaries)
    except Exception as exc:  # a model that takes no such forward: say so, do not fail
        return f"its decoder failed a probe ({exc})"


def _probe(summaries: Summaries) -> str | None:
    """Decode three prompts joining at different steps, and each alone: None where every
    one's tokens are the same, else what differs."""
    texts = ["probe", "a longer probe of the encoder", "the third probe of joining"]
    alone = []
    for text in texts:
        decoder = Seq2SeqDecoder(summaries, budget=1 << 30)
        (generation,) = _opened(decoder, [text])
        decoder.prefill([generation])
        while decoder.rows:
            decoder.advance()
        alone.append(generation.ids)
    decoder = Seq2SeqDecoder(summaries, budget=1 << 30)
    together = _opened(decoder, texts)
    decoder.prefill(together[:1])
    decoder.advance()
    decoder.prefill(together[1:])
    while decoder.rows:
        decoder.advance()
    if [g.ids for g in together] != alone:
        return "prompts decoded together gave other tokens than each alone"
    return None


def _opened(decoder: Seq2SeqDecoder, texts: list[str]) -> list[Generation]:
    """``texts`` opened on ``decoder``, four tokens each."""
    opened = []
    for generation in decoder.open([{"text": text} for text in texts]):
        if isinstance(generation, BaseException):
            raise generation
        generation.limit = min(generation.limit, 4)
        opened.append(generation)
    return opened
