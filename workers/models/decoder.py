"""Continuous batching for a causal language model: generations join and leave the running
batch between decoding steps.

:class:`Decoder` holds the running batch of a :class:`Decodable` (what it needs of a
generator): per layer, the key/value cache of every generation in flight, left-padded to
one length, and the attention mask that hides the padding. :meth:`Decoder.prefill` runs
new prompts (one forward over them, less the starts it holds from earlier prompts:
:mod:`workers.models.prefixes`) and appends them to the batch;
:meth:`Decoder.advance` feeds every generation its last token (one forward for the whole
batch) and picks the next; a generation that reaches its ``max_new_tokens``, an
end-of-sequence token or one of its stop strings (checked in its text after each step)
leaves at once (:meth:`Decoder.leave` takes out the cancelled and
expired ones too), and the columns no generation uses any more are cut off the left.

Positions come from the mask (the number of real tokens before each one), so padding
shifts neither absolute-position models (GPT-2) nor rotary ones, and a generation decodes
as it would alone: greedy output is the same token ids. Sampling is per generation, from
its own ``torch.Generator``: a request that gives a ``seed`` gets the same text whoever
its batch-mates are.

Memory is bounded by a token budget: the padded cache holds at most ``budget`` token
positions (rows x longest reservation, each generation reserving its prompt plus its
``max_new_tokens``); a generation that does not fit now waits (:meth:`Decoder.fits`), one
that could never fit is refused.

The methods that touch tensors (:meth:`Decoder.prefill`, :meth:`Decoder.advance`,
:meth:`Decoder.leave`) run in the model thread, one at a time; :meth:`Decoder.open`
tokenizes, :meth:`Decoder.result` and :meth:`Decoder.text` decode.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from pipelines.errors import InvalidInput
from pipelines.model import Item, Result
from workers.models.blocks import in_blocks
from workers.models.prefixes import BLOCK, PrefixCache, Prepared, prepared, shared_starts
from workers.models.stops import cut, held, stops_of

logger = logging.getLogger(__name__)


class Decodable(Protocol):
    """What a :class:`Decoder` needs of its generator
    (:class:`~workers.models.hf_text.Generator` is one).

    Attributes:
        model: the causal language model, on :attr:`device`.
        device: where the model runs.
        tokenizer: its tokenizer (left padding and truncation).
        max_length: the most prompt tokens.
        eos_ids: the token ids that end a generation.
    """

    model: Any
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    max_length: int
    eos_ids: set[int]

    @property
    def positions(self) -> int | None:
        """The model's position table size, where it has one."""

    def limits(self, items: list[Item]) -> list[int]:
        """Each item's most new tokens (refusing one out of range)."""

    def prompts(self, items: list[Item]) -> list[str]:
        """Each item's prompt text."""

    def sampling_of(
        self, item: Item, name: str | None = None
    ) -> tuple[tuple[float, float] | None, torch.Generator | None]:
        """How ``item`` picks its tokens: (temperature, top_p) and its own random
        source, or (None, None) for greedy; ``name`` seeds it where the item does not."""

    def text_so_far(self, ids: list[int]) -> str:
        """A generation's text from its new ``ids``, for streaming."""


@dataclass(eq=False)
class Generation:
    """One request's generation: its prompt, the ids made so far, and how it ends.

    Attributes:
        item: the request's item (what :meth:`Decoder.result` answers from).
        prompt: the prompt's ids, as the model runs them (truncated).
        limit: the most new tokens it may have.
        ids: the new ids so far, without an end-of-sequence token.
        reason: ``stop`` (an end-of-sequence token or a stop string), ``length`` (its
            limit), ``left`` (taken out: cancelled, expired, failed); None while it runs.
    """

    item: Item
    prompt: list[int]
    limit: int
    sampling: tuple[float, float] | None  # temperature, top_p; None: greedy
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    reason: str | None = None

    @property
    def reserved(self) -> int:
        """Cache positions it may come to hold: its prompt and every new token."""
        return len(self.prompt) + self.limit

    @property
    def done(self) -> bool:
        """Whether it has ended (and left the running batch)."""
        return self.reason is not None


class Decoder:
    """The running batch of one :class:`Decodable`'s model.

    Args:
        runner: the generator whose model, tokenizer, limits and sampling it uses.
        budget: the most token positions the padded cache may hold (see the module).

    Attributes:
        rows: the generations in flight, in batch order.
    """

    def __init__(self, runner: Decodable, budget: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.device = runner.device
        self.budget = budget
        self.rows: list[Generation] = []
        self.stepped = 0  # the steps of the last call of steps()
        self._cache: Any = None  # a DynamicCache: per layer, keys/values [rows, heads, T, dim]
        self.prefixes: PrefixCache | None = None  # prompt starts reused (share_prefixes)
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self._next = torch.zeros((0,), dtype=torch.long, device=self.device)
        # transformers 5.2x names the cache argument and output ``cache``; older ones
        # (the floor, 4.56) ``past_key_values``.
        takes = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in takes else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}

    # -- admission -----------------------------------------------------------------

    def open(
        self, items: list[Item], names: list[str] | None = None
    ) -> list[Generation | BaseException]:
        """Each item as a generation not yet started (its prompt tokenized and truncated,
        its limit and sampling read), or the error that refuses it: each item alone.

        Args:
            items: the requests' items.
            names: each item's request id: an item that samples without a ``seed`` is
                seeded from it, so a worker that takes the request over (its first one
                died mid-stream) makes the same text again (None: seeded at random).
        """
        opened: list[Generation | BaseException] = []
        for index, item in enumerate(items):
            try:
                opened.append(self._open(item, None if names is None else names[index]))
            except Exception as exc:  # an invalid item fails alone
                opened.append(exc if index == 0 else _renumbered(exc, index))
        return opened

    def _open(self, item: Item, name: str | None) -> Generation:
        runner = self.runner
        limit = runner.limits([item])[0]
        prompt_length = runner.max_length
        positions = runner.positions
        if positions is not None:
            # As generate_ids: the output gets room by cutting the prompt's start, down to
            # half the position table; past that it stops at the table's end.
            prompt_length = min(prompt_length, max(positions - limit, positions // 2))
        text = runner.prompts([item])[0]
        prompt = runner.tokenizer(text, truncation=True, max_length=prompt_length)["input_ids"]
        if not prompt:  # an empty prompt continues from the end-of-sequence token
            prompt = [runner.tokenizer.eos_token_id]
        if positions is not None:
            limit = min(limit, positions - len(prompt))
        generation = Generation(item, list(prompt), limit, *runner.sampling_of(item, name))
        if generation.reserved > self.budget:
            raise InvalidInput(
                f"the prompt ({len(prompt)} tokens) and max_new_tokens ({limit}) need "
                f"{generation.reserved} cache positions; this stage holds {self.budget} "
                "(CONVEYOR_DECODE_TOKEN_BUDGET): shorten the prompt or ask for fewer tokens"
            )
        return generation

    def fits(self, generation: Generation, joining: Iterable[Generation] = ()) -> bool:
        """Whether ``generation`` fits in the budget beside the batch and ``joining`` (those
        admitted with it): every row of the padded cache is as long as the longest."""
        rows = [*self.rows, *joining, generation]
        return len(rows) * max(r.reserved for r in rows) <= self.budget

    def share_prefixes(self, tokens: int) -> None:
        """Reuse prompt starts' keys and values (:mod:`workers.models.prefixes`), at most
        ``tokens`` positions (0: none); a subclass that prefills its own way does not."""
        own = type(self).prefill is Decoder.prefill
        self.prefixes = PrefixCache(tokens) if tokens and own else None

    # -- the batch -----------------------------------------------------------------

    def prefill(self, generations: list[Generation]) -> list[Generation]:
        """Prefill ``generations`` (one forward) and add them to the running batch; each gets
        its first token. Returns those that ended at once (an end of sequence, a limit of 1)."""
        if not generations:
            return []
        pad, prompts = int(self.runner.tokenizer.pad_token_id or 0), [g.prompt for g in generations]
        with torch.inference_mode():
            if starts := shared_starts(prompts, self.prefixes):  # a burst's: prefilled once
                self._prefilled(prepared(starts, pad, self.device, self.prefixes))
            out, (cache, mask) = self._prefilled(prepared(prompts, pad, self.device, self.prefixes))
        chosen = self._choose(out.logits[:, -1, :], generations)
        self._append(cache, mask, chosen)
        self.rows.extend(generations)
        return self._record(generations, chosen.tolist())

    def _prefilled(self, run: Prepared) -> tuple[Any, tuple[Any, torch.Tensor]]:
        out = self.model(use_cache=True, **self._last_only, **run.inputs(self._cache_arg))
        return out, run.settled(_cache_of(out))

    def advance(self) -> list[Generation]:
        """One decoding step for every generation in flight: each gets its next token.
        Returns those that ended (they have left the batch)."""
        if not self.rows:
            return []
        ones = torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)
        positions = self._mask.sum(-1, keepdim=True)  # real tokens before the new one
        mask = torch.cat([self._mask, ones], dim=1)
        in_blocks(self._cache)
        with torch.inference_mode():
            out = self.model(
                input_ids=self._next[:, None],
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: self._cache},
            )
        self._mask, self._cache = mask, _cache_of(out)
        chosen = self._choose(out.logits[:, -1, :], self.rows)
        self._next = chosen
        ended = self._record(list(self.rows), chosen.tolist())
        return ended

    def steps(
        self, stop: threading.Event, most_s: float, on_step: Callable[[], None]
    ) -> list[Generation]:
        """Decoding steps (:meth:`advance`), ``on_step`` after each (the streamed text),
        until a generation ends, ``stop`` is set (a request came to join) or ``most_s``
        has passed: one call into the model thread for them all, not one a token.
        Returns those that ended."""
        until, self.stepped = time.monotonic() + most_s, 0
        while True:
            ended = self.advance()
            self.stepped += 1
            on_step()
            if ended or not self.rows or stop.is_set() or time.monotonic() >= until:
                return ended

    def leave(self, generations: list[Generation]) -> None:
        """Take ``generations`` (cancelled, expired, failed) out of the running batch now.
        After a step that raised, leaving every row starts the batch afresh (the cache of
        a failed forward is not trusted)."""
        for generation in generations:
            if generation.reason is None:
                generation.reason = "left"
        self._drop(generations)

    def result(self, generation: Generation) -> Result:
        """The request's answer, as :meth:`~workers.models.hf_text.Generator.predict`
        gives it."""
        runner = self.runner
        text = str(runner.tokenizer.decode(generation.ids, skip_special_tokens=True))
        result: Result = {"generated_text": cut(text, stops_of(generation.item))[0]}
        if generation.item.get("usage") is True:
            result["prompt_tokens"] = len(generation.prompt)
            result["completion_tokens"] = len(generation.ids)
            result["finish_reason"] = generation.reason or "stop"
        return result

    def text(self, generation: Generation) -> str:
        """Its text so far, for streaming (a trailing half character held back: see
        :meth:`~workers.models.hf_text.Generator.predict_stream`), and while it runs,
        what could still become a stop string (:func:`~workers.models.stops.held`)."""
        text, stops = self.runner.text_so_far(generation.ids), stops_of(generation.item)
        return cut(text, stops)[0] if generation.done else held(text, stops)

    def warm_up(self, rows: int) -> None:
        """Run every path a request can take once (at load, before the stage says ready,
        so that no request pays a first call): a prefill of one prompt and one of
        ``rows`` together, a join into a running batch, decoding steps, greedy and
        sampled picks (temperature, top-p), a cached prompt start reused, the streamed text,
        the answer and a leave. The batch (and the prefix cache) is as before after it.

        Args:
            rows: the most generations the stage runs at once (its widest prefill).
        """
        words = "warm the model up before the first request comes, " * 2  # a block and more
        sampled = {"temperature": 0.7, "top_p": 0.9, "seed": 0, "max_new_tokens": 3}
        items: list[Item] = [{"text": words, "max_new_tokens": 4}, {"text": "warm", **sampled}]
        items += [{"text": f"{words} {i}", "max_new_tokens": 3} for i in range(max(rows, 2))]
        opened = [g for g in self.open(items) if not isinstance(g, BaseException)]
        held, self.prefixes = self.prefixes, PrefixCache(4 * BLOCK)  # the last prefill hits
        self.prefill(opened[:1])
        self.prefill(opened[1:2])  # joins a running batch
        self.advance()
        self.prefill(opened[2:])
        while self.rows:
            for generation in self.rows:
                self.text(generation)
            self.advance()
        for generation in opened:
            self.result(generation)
        self.leave(list(self.rows))
        self.prefixes = held

    # -- tensors -------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, generations: list[Generation]) -> torch.Tensor:
        """Each row's next token: greedy, or sampled from its own generator."""
        chosen = logits.argmax(dim=-1)
        for row, generation in enumerate(generations):
            if generation.sampling is None:
                continue
            temperature, top_p = generation.sampling
            probs = torch.softmax(logits[row].float() / temperature, dim=-1)
            if not bool(torch.isfinite(probs).all()):  # logits too wide for it: greedy
                continue
            if top_p < 1.0:
                ordered, order = probs.sort(descending=True)
                # Keep the most likely tokens up to top_p of the mass (the first always).
                cut = ordered.cumsum(-1) - ordered > top_p
                ordered[cut] = 0.0
                probs = torch.zeros_like(probs).scatter(0, order, ordered)
            pick = torch.multinomial(probs.cpu(), 1, generator=generation.generator)
            chosen[row] = pick.to(chosen.device)[0]
        return chosen

    def _record(self, generations: list[Generation], tokens: list[int]) -> list[Generation]:
        """Append each generation's new token; those that end leave the batch."""
        eos = self.runner.eos_ids
        ended = []
        for generation, token in zip(generations, tokens, strict=True):
            if token in eos:
                generation.reason = "stop"
            else:
                generation.ids.append(token)
                if len(generation.ids) >= generation.limit:
                    generation.reason = "length"
                stops = stops_of(generation.item)
                if stops and cut(self.runner.text_so_far(generation.ids), stops)[1]:
                    generation.reason = "stop"  # its text holds a stop string: it ends
            if generation.reason is not None:
                ended.append(generation)
        if ended:
            self._drop(ended)
        return ended

    def _append(self, cache: Any, mask: torch.Tensor, chosen: torch.Tensor) -> None:
        """Add a prefilled group (its cache, mask and first tokens) under the batch,
        both left-padded to the longer of the two."""
        if not self.rows:
            self._cache, self._mask, self._next = cache, mask, chosen
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(mask, width)])
        self._next = torch.cat([self._next, chosen])

    def _drop(self, generations: list[Generation]) -> None:
        """Take ``generations`` out of the batch's rows and tensors."""
        gone = {id(g) for g in generations}
        self._keep([i for i, r in enumerate(self.rows) if id(r) not in gone])

    def _keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` of the batch, then cut the columns none of them uses."""
        self.rows = [self.rows[i] for i in rows]
        if not rows:
            self._cache = None
            self._mask = self._mask[:0, :0]
            self._next = self._next[:0]
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        self._mask = mask[:, start:]
        self._next = self._next.index_select(0, index)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:, :]
            layer.values = layer.values.index_select(0, index)[:, :, start:, :]


def _cache_of(out: Any) -> Any:
    """A forward's key/value cache, by either of its names (see :class:`Decoder`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` (its sequence axis the last of a mask, the third of keys/values) padded
    with zeros on the left to ``width`` positions."""
    axis = 1 if tensor.dim() == 2 else 2
    missing = width - tensor.shape[axis]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=axis)


def _renumbered(exc: Exception, index: int) -> Exception:
    """``exc``, its message saying ``item {index}`` rather than ``item 0`` (each item is
    read alone, but the client sent a batch)."""
    message = str(exc)
    if message.startswith("item 0:"):
        return type(exc)(f"item {index}:" + message[len("item 0:") :])
    return exc


def supports(runner: Decodable) -> str | None:
    """Why ``runner``'s model cannot decode continuously (None: it can): its cache must be
    one key/value tensor pair per layer, as a plain ``DynamicCache`` keeps it."""
    probe = torch.tensor([[int(runner.tokenizer.eos_token_id or 0)]], device=runner.device)
    ones = torch.ones_like(probe)
    try:
        with torch.inference_mode():  # the call prefill() makes
            out = runner.model(
                input_ids=probe, attention_mask=ones, position_ids=ones - 1, use_cache=True
            )
    except Exception as exc:  # a model that takes no such forward: say so, do not fail
        return f"its forward failed on a one-token probe ({exc})"
    cache = _cache_of(out)
    layers = getattr(cache, "layers", None)
    if not layers or not all(
        type(layer).__name__ == "DynamicLayer" and isinstance(layer.keys, torch.Tensor)
        for layer in layers
    ):
        return f"its cache ({type(cache).__name__}) is not one DynamicLayer a layer"
    return None
