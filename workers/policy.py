"""Adaptive batching: learn what a batch costs and decide when waiting pays.

The model's cost is learned online as ``run_s ≈ a + b·n`` (an exponentially weighted
least-squares fit over recent batches, so it follows drift). The arrival rate ``λ`` is
measured from the stream ids of recent entries. A batch of ``k`` items on an idle model
goes at once when a batch of ``k`` already keeps up with arrivals
(``k / (a + b·k) ≥ λ``): waiting would only add latency. Otherwise it fills toward the
smallest size that keeps up, ``n = λ·a / (1 - λ·b)`` with headroom, and never past
``max_batch_size`` or the window (``batch_wait_ms`` after its oldest arrival), which stay
hard bounds. (Deadlines are not consulted here: an expired item is never run, and the
window bounds any wait far below a request's deadline.)

A length-aware stage (``max_batch_tokens``) learns its cost in padded tokens instead of
items (``run_s ≈ a + b·tokens``), so the fit holds when lengths vary; a batch of ``k``
is then predicted at the recent padded tokens per item (:attr:`BatchPolicy.per_item`).

Only warm runs are cost samples: a batch whose shape the device met for the first time
(:func:`pipelines.model.cold_shape`) paid a one-off cost that is not the model's, and
learning from it made batches small on a GPU. Where the cost is flat in the
batch's size, as on a GPU below saturation, one more batch costs a whole batch and no
padding is worth it, so a length-aware stage does not split (:meth:`BatchPolicy.
batch_overhead_tokens`).
"""

from __future__ import annotations

import math
from collections import deque


class CostModel:
    """Exponentially weighted least squares of run time on batch size.

    Args:
        decay: weight kept by past batches at each new one (0.9: ~10 batches of memory).
    """

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.w = self.sn = self.st = self.snn = self.snt = 0.0

    def observe(self, n: int, run_s: float) -> None:
        """Add one batch: ``n`` items took ``run_s`` seconds."""
        d = self.decay
        self.w = d * self.w + 1
        self.sn = d * self.sn + n
        self.st = d * self.st + run_s
        self.snn = d * self.snn + n * n
        self.snt = d * self.snt + n * run_s

    @property
    def known(self) -> bool:
        """Whether any batch has been seen."""
        return self.w > 0

    @property
    def slope_known(self) -> bool:
        """Whether the slope is learned: the recent batches' sizes spread by a tenth of
        their mean or more. Sizes that barely differ (1,632 and 1,664 padded tokens) fit
        a slope of timing noise, which may read as no fixed cost at all."""
        return self.known and self._spread() >= 0.01 * self.sn * self.sn

    def _spread(self) -> float:
        """``w²`` times the recent sizes' variance: the fit's denominator."""
        return self.w * self.snn - self.sn * self.sn

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``: fixed seconds per batch and seconds per item (both ≥ 0).

        With one batch size seen only, the split is unknowable; all cost is taken as
        fixed (b = 0), which makes batching look as good as it can be, so the policy
        leans towards trying larger batches and learning the slope.
        """
        if not self.known:
            return 0.0, 0.0
        denom = self._spread()
        mean_t = self.st / self.w
        if denom <= 1e-9 * max(1.0, self.w * self.snn):
            return mean_t, 0.0
        b = (self.w * self.snt - self.sn * self.st) / denom
        a = (self.st - b * self.sn) / self.w
        if b < 0:
            return mean_t, 0.0
        if a < 0:
            return 0.0, self.snt / self.snn
        return a, b


class ArrivalRate:
    """Items per second over the last ``horizon_s``, from arrival timestamps.

    Args:
        horizon_s: how far back arrivals count.
    """

    def __init__(self, horizon_s: float = 2.0) -> None:
        self.horizon_s = horizon_s
        self._arrivals: deque[float] = deque()

    def observe(self, arrival_s: float) -> None:
        """One item arrived at ``arrival_s`` (server clock)."""
        self._arrivals.append(arrival_s)

    def rate(self, now: float) -> float:
        """Arrivals per second seen in the last ``horizon_s`` before ``now``."""
        while self._arrivals and self._arrivals[0] < now - self.horizon_s:
            self._arrivals.popleft()
        return len(self._arrivals) / self.horizon_s


OVERHEAD_PRIOR_TOKENS = 32.0
"""A batch's fixed cost in tokens until one is learned, on a CPU: about what
all-MiniLM-L6-v2 shows there (5 ms per call, 0.15 ms per padded token). On an accelerator
it is :data:`FLAT_OVERHEAD_TOKENS`: a cost flat in tokens until measured otherwise."""

FLAT_OVERHEAD_TOKENS = 1e9
"""A batch's fixed cost in tokens where its cost does not grow with its tokens: more than
any padding, so a length-aware stage cuts only at its budget."""


class BatchPolicy:
    """Decides the batch size worth waiting for.

    Args:
        max_batch: the hard bound on items per batch.
        headroom: target this much more than the size that just keeps up.

    Attributes:
        cost: ``run_s`` on the batch's units: items, or padded tokens (length-aware).
        per_item: units per item, recently (1 when the units are items).
    """

    def __init__(self, max_batch: int, headroom: float = 1.25) -> None:
        self.max_batch = max_batch
        self.headroom = headroom
        self.cost = CostModel()
        self.arrivals = ArrivalRate()
        self.per_item = 1.0

    def observe(self, items: int, units: int, run_s: float) -> None:
        """A batch of ``items`` items, ``units`` units (items, or padded tokens), took
        ``run_s``."""
        if items <= 0:
            return
        self.cost.observe(units, run_s)
        rate = units / items
        self.per_item = rate if self.cost.w <= 1 else 0.9 * self.per_item + 0.1 * rate

    def per_item_cost(self) -> tuple[float, float]:
        """``(a, b)`` with ``b`` per item at the recent units per item: what admission
        predicts a backlog of items with."""
        a, b = self.cost.coefficients()
        return a, b * self.per_item

    def batch_overhead_tokens(self, prior: float = OVERHEAD_PRIOR_TOKENS) -> float:
        """A batch's fixed cost in units (``a / b``): what a length-aware split weighs one
        more batch against padding by: ``prior`` until the slope is learned,
        :data:`FLAT_OVERHEAD_TOKENS` where it is none (a flat cost: splitting only adds
        batches)."""
        if not self.cost.slope_known:
            return prior
        a, b = self.cost.coefficients()
        if b <= 0:
            return FLAT_OVERHEAD_TOKENS
        if a <= 0:  # a cost steeper than linear (attention on a CPU) fits no fixed part
            return prior
        return min(FLAT_OVERHEAD_TOKENS, a / b)

    def target(self, now: float) -> int:
        """The batch size to fill to before going (1: go with what is there)."""
        if not self.cost.known:
            return 1
        a, b = self.per_item_cost()
        lam = self.arrivals.rate(now)
        if lam <= 0:
            return 1
        if lam * b >= 1:  # even full batches cannot keep up: fill them
            return self.max_batch
        keeps_up = lam * a / (1 - lam * b)
        if keeps_up <= 1:
            return 1  # single items keep up: any wait is pure latency
        return min(self.max_batch, math.ceil(keeps_up * self.headroom))

    def go_now(self, k: int, now: float) -> bool:
        """Whether a batch of ``k`` on an idle model should run without waiting more."""
        return k >= self.max_batch or k >= self.target(now)
