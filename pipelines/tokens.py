"""What an item costs a model, in tokens, estimated before the model sees it.

A length-aware stage (``Stage.max_batch_tokens``) groups requests of similar length into
batches, and a batch costs its items times its longest item (padding): so the worker must
know each item's length before it runs. The estimate is made once, where the request is
enqueued (the gateway, or the worker that forwards it to its next step), from the
payload's text, and travels in the stream entry (:data:`COST`), so the worker reads it
without decoding the envelope.

It counts characters, about four to a token for English with the common sub-word
tokenizers (BERT's WordPiece, GPT-2's BPE), plus two for the special tokens a text
encoder adds. It is an estimate: it ranks texts by length well, which is what grouping
needs; a model that truncates its input (``max_length``) caps it (:func:`capped`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COST = b"c"
"""The stream-entry field holding a request's estimated tokens (an integer, as text)."""
COST_DIGITS = 9
"""The most digits a :data:`COST` field is read with; a longer one counts as absent."""
CHARS_PER_TOKEN = 4
"""Characters per token in the estimate."""
SPECIAL_TOKENS = 2
"""Tokens a text encoder adds around every text ([CLS] and [SEP], or BOS and EOS)."""


def estimate(payload: Mapping[str, Any]) -> int:
    """The estimated tokens of ``payload``: its strings' characters (at any depth) over
    :data:`CHARS_PER_TOKEN`, rounded up, plus :data:`SPECIAL_TOKENS`."""
    return -(-_chars(payload) // CHARS_PER_TOKEN) + SPECIAL_TOKENS


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_chars(v) for v in value)
    return 0


def entry_cost(fields: Mapping[bytes, bytes], envelope: bytes) -> int:
    """A stream entry's estimated tokens: its :data:`COST` field, or, for an entry
    written without one (a join's, which Redis builds; an older gateway's), its
    envelope's length counted as text (an overestimate: the envelope's own fields)."""
    raw = fields.get(COST)
    # Untrusted: bytes.isdigit is ASCII only, and the length bound keeps int() from
    # refusing a forged field of thousands of digits (and the cost within any budget).
    if raw is not None and 0 < len(raw) <= COST_DIGITS and raw.isdigit():
        return max(1, int(raw))
    return -(-len(envelope) // CHARS_PER_TOKEN) + SPECIAL_TOKENS


def capped(tokens: int, max_length: int | None) -> int:
    """``tokens`` as the model runs them: no more than ``max_length`` (None: no cap),
    past which it truncates."""
    return tokens if max_length is None else max(1, min(tokens, max_length))
