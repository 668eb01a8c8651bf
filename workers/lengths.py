"""Length-aware batching: what a window took, split into batches of similar length.

A model pads every item of a batch to the batch's longest, so a batch costs its fixed
overhead plus its items times its longest item, in tokens. One 400-token paragraph among
31 short sentences makes all 32 cost 400. A stage with ``max_batch_tokens`` therefore
does not run its window's entries as one batch: it sorts them by estimated length
(:mod:`pipelines.tokens`, read from each entry without decoding it) and cuts the sorted
run into consecutive groups, choosing the cuts that minimise the total predicted cost,
the sum over groups of ``overhead + items * longest``, ``overhead`` being a batch's
learned fixed cost in tokens (:meth:`workers.policy.BatchPolicy.batch_overhead_tokens`).
Each group holds at most
``max_batch_tokens`` padded tokens (an item longer than that alone goes alone).

The groups run back to back, shortest first, as separate batches (each its own model
call, publish and log line). Nothing is passed over: everything the window took runs in
this round, so the window's guarantee (a batch closes ``batch_wait_ms`` after its oldest
entry) and deadlines hold as they do for one batch; an item of a later group waits only
for the model time of the groups before it, which it would have shared, padded, anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipelines.envelope import FIELD
from pipelines.model import Item
from pipelines.tokens import capped, entry_cost, estimate
from workers.values import BatchRecord, Entry


def entry_tokens(entry: Entry, max_length: int | None) -> int:
    """``entry``'s estimated tokens as the model runs them (capped at its ``max_length``)."""
    return capped(entry_cost(entry.fields, entry.fields.get(FIELD, b"")), max_length)


def item_tokens(item: Item, max_length: int | None) -> int:
    """A decoded item's estimated tokens as the model runs them (the same estimate its
    entry carries, :func:`pipelines.tokens.estimate`)."""
    return capped(estimate(item), max_length)


def padding(tokens: Sequence[int]) -> tuple[int, int]:
    """(real, padded) tokens of a batch of items of ``tokens`` each."""
    return sum(tokens), len(tokens) * max(tokens, default=0)


def input_cap(model: object) -> int | None:
    """A model's input cap in tokens, where it has one (``max_length``, as the Hugging
    Face runners do); None without one (or before it loads)."""
    cap = getattr(model, "max_length", None)
    return cap if isinstance(cap, int) and cap > 0 else None


def account(record: BatchRecord, items: list[Item], cap: int | None) -> int:
    """Note the real and padded tokens of the items a batch ran in its record; returns
    the padded ones (what a length-aware stage learns its cost on)."""
    record.tokens, record.padded_tokens = padding([item_tokens(i, cap) for i in items])
    return record.padded_tokens


def cuts(tokens: Sequence[int], max_tokens: int, overhead: float) -> list[int]:
    """Where to cut ``tokens`` (ascending) into groups of least total cost.

    The cost of a group ``tokens[i:j]`` is ``overhead + (j - i) * tokens[j - 1]``; a group
    of more than one item holds at most ``max_tokens`` padded tokens.

    Returns:
        The end index of each group, in order (the last is ``len(tokens)``).
    """
    n = len(tokens)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of tokens[:j]
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = tokens[j - 1]
        most = max(1, max_tokens // max(1, longest))  # items a group ending here may hold
        for i in range(max(0, j - most), j):
            cost = best[i] + overhead + (j - i) * longest
            if cost < best[j]:
                best[j], start[j] = cost, i
    ends: list[int] = []
    j = n
    while j > 0:
        ends.append(j)
        j = start[j]
    return ends[::-1]


class Lengths:
    """Splits one stage's windows into batches of similar length.

    Args:
        max_tokens: the most padded tokens in one batch.
        overhead: the fixed cost of one batch, in tokens (asked for each split: it is
            learned as the worker runs).
        max_length: the model's input cap in tokens (asked for each split: known once the
            model has loaded; None: no cap).
    """

    def __init__(
        self,
        max_tokens: int,
        overhead: Callable[[], float],
        max_length: Callable[[], int | None],
    ) -> None:
        self.max_tokens = max_tokens
        self._overhead = overhead
        self._max_length = max_length

    def split(self, entries: list[Entry]) -> list[list[Entry]]:
        """``entries`` in groups of similar length, shortest first (one group when there
        is only one entry)."""
        if len(entries) < 2:
            return [entries]
        cap = self._max_length()
        each = [entry_tokens(e, cap) for e in entries]
        order = sorted(range(len(entries)), key=each.__getitem__)
        groups, begin = [], 0
        for end in cuts([each[i] for i in order], self.max_tokens, self._overhead()):
            # Within a group, the window's order (oldest first), as a batch always has.
            groups.append([entries[i] for i in sorted(order[begin:end])])
            begin = end
        return groups
