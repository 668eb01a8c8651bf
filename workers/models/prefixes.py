"""Prompt prefixes reused across generations: the keys and values a prefill made for a
prompt's start, kept so a later prompt that starts the same (a chat's system prompt) runs
only the rest.

:class:`PrefixCache` holds blocks of :data:`BLOCK` prompt tokens, each keyed by the chain
of every token from the prompt's start to the block's end (so a block matches only with its
whole prefix), each holding, per layer, that block's keys and values for one row: copies,
never a view of a running batch, so evicting one cannot touch a generation in flight, and
a generation's own cache is never one of them. It holds at most ``tokens`` positions,
least recently used out first (a prefix's first blocks are its most recently used, so a
chain is cut from its end, never from its start).

:func:`prepared` lays out a prefill (:meth:`~workers.models.decoder.Decoder.prefill`):
each prompt's longest run of cached blocks from its start (at most all but its last token,
whose logits pick the first new one) becomes the forward's past, left-padded to the
longest, and only the rest of each prompt is run, left-padded too; the mask marks what is
real, and positions come from it, as the decoder's do. :meth:`Prepared.settled` packs the
forward's cache back into the decoder's layout (each row's tokens at the right, the padding
at the left) and stores the prompts' new full blocks. Prompts that join in one prefill
and share a start the cache does not hold yet (a burst of one chat's requests) have it
prefilled once first, in a forward of its own (:func:`shared_starts`), and then find it
as they would an earlier prompt's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

BLOCK = 16
"""Prompt tokens a cached block holds: a prefix is reused in whole blocks."""


@dataclass(eq=False)
class Block:
    """One cached block of a prompt's start.

    Attributes:
        tokens: its tokens (checked on a match, beside its key).
        layers: per layer, its keys and values ``[heads, BLOCK, dim]`` (copies).
    """

    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def _chain(prompt: list[int], blocks: int) -> list[bytes]:
    """The keys of the first ``blocks`` blocks of ``prompt``: each one the digest of the
    one before and its own tokens, so it names the whole prefix up to its end."""
    keys, key = [], b""
    for index in range(blocks):
        tokens = prompt[index * BLOCK : (index + 1) * BLOCK]
        digest = hashlib.blake2b(key, digest_size=16)
        digest.update(array("q", tokens).tobytes())
        key = digest.digest()
        keys.append(key)
    return keys


class PrefixCache:
    """Cached blocks of prompt starts, at most ``tokens`` positions (least recently used
    out first).

    Args:
        tokens: the most token positions it holds (whole blocks: below one, none).

    Attributes:
        prefilled: prompt tokens the model ran in prefills since it was made.
        reused: prompt tokens taken from it instead.
        evicted: blocks dropped to stay within the bound.
    """

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.prefilled = 0
        self.reused = 0
        self.evicted = 0
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    @property
    def held(self) -> int:
        """Token positions it holds now."""
        return len(self._blocks) * BLOCK

    def find(self, prompt: list[int]) -> list[Block]:
        """``prompt``'s longest run of cached blocks from its start, leaving out at least
        its last token; those found become the most recently used."""
        found: list[Block] = []
        keys = _chain(prompt, (len(prompt) - 1) // BLOCK)
        for index, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None or list(block.tokens) != prompt[index * BLOCK : (index + 1) * BLOCK]:
                break
            found.append(block)
        self._touch(keys[: len(found)])
        return found

    def store(
        self, prompt: list[int], known: int, layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Keep ``prompt``'s full blocks from block ``known`` on (those before are cached).

        Args:
            prompt: the prompt's ids.
            known: how many of its first blocks it found cached.
            layers: per layer, its row's keys and values ``[heads, len(prompt), dim]``
                (views: the blocks kept are copies).
        """
        blocks = min(len(prompt) // BLOCK, self.tokens // BLOCK)
        keys = _chain(prompt, blocks)
        for index in range(known, blocks):
            if keys[index] in self._blocks:
                continue
            span = slice(index * BLOCK, (index + 1) * BLOCK)
            self._blocks[keys[index]] = Block(
                tuple(prompt[span]),
                [(k[:, span].clone(), v[:, span].clone()) for k, v in layers],
            )
        self._touch(keys)
        while self.held > self.tokens:
            self._blocks.popitem(last=False)
            self.evicted += 1

    def _touch(self, keys: list[bytes]) -> None:
        """Make the blocks of ``keys`` (one prefix, first block first) the most recently
        used, the first block last: eviction cuts a prefix from its end."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)


@dataclass(eq=False)
class Prepared:
    """A prefill's inputs and what it found cached.

    Attributes:
        ids: the tokens the forward runs ``[rows, W]`` (each prompt's uncached rest,
            left-padded).
        mask: the attention mask over the past and ``ids`` ``[rows, P + W]``.
        positions: each token of ``ids``'s position ``[rows, W]``.
        past: the cached blocks' keys and values as a cache of ``P`` positions, or None.
        prompts: the prompts' ids.
        found: how many blocks each prompt found cached.
        cache: where its blocks are kept (None: no reuse).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    past: Any
    prompts: list[list[int]]
    found: list[int]
    cache: PrefixCache | None

    def inputs(self, past_name: str) -> dict[str, Any]:
        """The forward's keyword arguments, the past (if any) under ``past_name``."""
        inputs = {
            "input_ids": self.ids,
            "attention_mask": self.mask,
            "position_ids": self.positions,
        }
        return inputs if self.past is None else {**inputs, past_name: self.past}

    def settled(self, cache: Any) -> tuple[Any, torch.Tensor]:
        """The forward's ``cache`` and its mask in the decoder's layout (each row's tokens
        at the right, no gap between a cached start and its rest); the prompts' new
        blocks are kept."""
        mask = self.mask
        if self.past is not None:  # a gap between a row's past and its rest: packed out
            lengths = [len(p) for p in self.prompts]
            width, total = max(lengths), mask.shape[1]
            start = total - self.ids.shape[1]  # the first column of the tokens run
            index = torch.zeros((len(lengths), width), dtype=torch.long)
            for row, length in enumerate(lengths):
                cached, rest = self.found[row] * BLOCK, length - self.found[row] * BLOCK
                index[row, width - length : width - rest] = torch.arange(start - cached, start)
                index[row, width - rest :] = torch.arange(total - rest, total)
            index = index.to(mask.device)
            left = torch.tensor([width - n for n in lengths], device=mask.device)[:, None]
            mask = (torch.arange(width, device=mask.device)[None, :] >= left).long()
            for layer in cache.layers:
                rows, heads, _, dim = layer.keys.shape
                gather = index[:, None, :, None].expand(rows, heads, width, dim)
                layer.keys = layer.keys.gather(2, gather)
                layer.values = layer.values.gather(2, gather)
        if self.cache is not None:
            width = mask.shape[1]
            for row, prompt in enumerate(self.prompts):
                start = width - len(prompt)
                layers = [
                    (layer.keys[row, :, start:], layer.values[row, :, start:])
                    for layer in cache.layers
                ]
                self.cache.store(prompt, self.found[row], layers)
        return cache, mask


def shared_starts(prompts: list[list[int]], cache: PrefixCache | None) -> list[list[int]]:
    """The starts (whole blocks) two or more of ``prompts`` share beyond what ``cache``
    holds, none the start of another: prefilled first (one forward for them all), each is
    then reused by every prompt that begins with it instead of run once per prompt. Empty
    without a cache, or where nothing new is shared."""
    if cache is None or len(prompts) < 2:
        return []
    chains = [_chain(p, (len(p) - 1) // BLOCK) for p in prompts]
    counts = Counter(key for keys in chains for key in keys)
    starts: dict[bytes, list[int]] = {}  # by the key of its last block
    for prompt, keys in zip(prompts, chains, strict=True):
        both = sum(1 for key in keys if counts[key] > 1)  # a chain: shared ones come first
        held = next((i for i, key in enumerate(keys) if key not in cache), len(keys))
        if both > held:
            starts[keys[both - 1]] = prompt[: both * BLOCK]
    inner = {key for start in starts.values() for key in _chain(start, len(start) // BLOCK)[:-1]}
    return [start for key, start in starts.items() if key not in inner]


def prepared(
    prompts: list[list[int]], pad: int, device: torch.device, cache: PrefixCache | None
) -> Prepared:
    """A prefill of ``prompts`` (see the module): what each finds in ``cache`` (None:
    nothing, every prompt runs whole) as the past, and the rest to run."""
    found = [cache.find(p) if cache is not None else [] for p in prompts]
    cached = [len(blocks) * BLOCK for blocks in found]
    rests = [p[n:] for p, n in zip(prompts, cached, strict=True)]
    past_width, width = max(cached), max(len(r) for r in rests)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), past_width + width), dtype=torch.long)
    for row, (rest, length) in enumerate(zip(rests, cached, strict=True)):
        ids[row, width - len(rest) :] = torch.tensor(rest)
        mask[row, past_width - length : past_width] = 1
        mask[row, past_width + width - len(rest) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past_width:]
    past = None
    if past_width:
        past = DynamicCache()
        like = next(blocks for blocks in found if blocks)[0]
        for layer, (key, value) in enumerate(like.layers):
            keys = [_row([b.layers[layer][0] for b in blocks], key, past_width) for blocks in found]
            values = [
                _row([b.layers[layer][1] for b in blocks], value, past_width) for blocks in found
            ]
            past.update(torch.stack(keys), torch.stack(values), layer)
    if cache is not None:
        cache.prefilled += sum(len(r) for r in rests)
        cache.reused += sum(cached)
    return Prepared(ids, mask, positions, past, prompts, [len(b) for b in found], cache)


def _row(blocks: list[torch.Tensor], like: torch.Tensor, width: int) -> torch.Tensor:
    """One row of the past for one layer: its blocks' keys (or values) in order, after
    zeros (the left padding) up to ``width`` positions; ``like`` gives the shape."""
    pad = like.new_zeros((like.shape[0], width - len(blocks) * BLOCK, like.shape[2]))
    return torch.cat([pad, *blocks], dim=1)
