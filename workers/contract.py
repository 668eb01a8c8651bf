"""The batch contract: n items in, n results out, each a JSON object an envelope can
carry; a failing item fails alone; a model that breaks the contract is said and counted."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from pipelines.envelope import wire_problem
from pipelines.errors import BatchContractError, DeadlineExceeded, InvalidInput
from pipelines.model import Item, Model, Result

logger = logging.getLogger(__name__)

T = TypeVar("T")

REPORT_EVERY_S = 60.0
"""A stage logs at most one contract-breach line this often (the rest are counted in it)."""


class Breaches:
    """The batch-contract breaches of one stage's model, said and counted.

    A model that answers a batch with the wrong number of results, or an item with a
    result that is not a JSON object, still has its items isolated (:func:`run_isolating`
    splits the batch until each part keeps the contract), which hides a throughput
    collapse: so each breach is also noted here, from the model thread
    (:func:`contract`), counted into the stage's stats
    (``conveyor_stage_contract_errors_total``) and logged as one ERROR line naming the
    stage, the runner and both counts, at most once per :data:`REPORT_EVERY_S` with how
    many more there were since.

    Args:
        stage: the stage's name.
        runner: its runner, as the stage names it.
    """

    def __init__(self, stage: str, runner: str) -> None:
        self.stage, self.runner = stage, runner
        self._lock = threading.Lock()  # noted in model threads, taken in the loop
        self._new: list[str] = []
        self._unsaid = 0
        self._said_at = float("-inf")

    def note(self, what: str) -> None:
        """One breach, ``what`` it was (``"returned 1 results for 2 items"``)."""
        with self._lock:
            self._new.append(what)

    def take(self) -> int:
        """The breaches noted since the last take (what the next publish counts); logs
        the first of them unless a line was logged within :data:`REPORT_EVERY_S`."""
        with self._lock:
            new, self._new = self._new, []
        if not new:
            return 0
        now = time.monotonic()
        if now - self._said_at < REPORT_EVERY_S:
            self._unsaid += len(new)
            return len(new)
        more, self._unsaid, self._said_at = self._unsaid + len(new) - 1, 0, now
        logger.error(
            "stage %s: runner %s broke the batch contract: %s (one result per item, a JSON "
            "object each); its items were isolated, at the cost of extra model calls; "
            "and %d more breaches since the last such line",
            self.stage,
            self.runner,
            new[0],
            more,
        )
        return len(new)


_noting = threading.local()
"""The :class:`Breaches` a model-thread call notes into (:func:`noting`)."""


def noting(breaches: Breaches, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in this thread, the contract breaches it makes noted in ``breaches``."""
    _noting.breaches = breaches
    try:
        return fn(*args)
    finally:
        _noting.breaches = None


def breach(what: str) -> None:
    """Note a contract breach where the current model-thread call notes them (if any)."""
    into: Breaches | None = getattr(_noting, "breaches", None)
    if into is not None:
        into.note(what)


def contract(items: list[Item], results: object) -> list[Result | BaseException]:
    """``results``, if they hold the batch contract's count (one per item); else a
    :class:`BatchContractError`, naming both counts, noted (:func:`breach`) and raised."""
    if not isinstance(results, (list, tuple)) or len(results) != len(items):
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
        breach(f"{len(items)} items, {got} results")
        raise BatchContractError(
            f"predict() got {len(items)} items and returned {got}; "
            "it must return one result per item, in order"
        )
    return list(results)


def run_isolating(model: Model, items: list[Item]) -> list[Result | BaseException]:
    """Run ``model`` on ``items``; if the batch fails, retry it split in halves.

    A failing item thus fails alone, at the cost of about log2(n) extra model calls
    for the batch it was in; the other items' results are the model's own.

    Raises nothing: an item's failure is returned in its place, whatever the model
    raised (a ``SystemExit``, ``KeyboardInterrupt`` or ``CancelledError`` too: in the
    model thread none of them is the worker's own; raised on, it would end the worker).
    """
    try:
        return contract(items, model.predict(items))
    except DeadlineExceeded as exc:
        return [exc] * len(items)  # the whole batch is out of time: no half would run
    except BaseException as exc:
        if len(items) == 1:
            return [exc]
        mid = len(items) // 2
        return run_isolating(model, items[:mid]) + run_isolating(model, items[mid:])


def plain(value: Any) -> Any:
    """``value`` with numpy's and torch's scalars and arrays (anything with ``tolist``)
    and subclasses of ``float`` and ``int`` turned into plain Python, as a model's
    results often hold them; anything else is left for :func:`wire_problem` to name."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, str | bytes | bool) or value is None:
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return plain(tolist())
    if isinstance(value, float):
        return float(value)
    if isinstance(value, int):
        return int(value)
    return value


def checked(res: Result | BaseException) -> Result | BaseException:
    """The result, or an error in its place when it is not a JSON object an envelope can
    carry (checked per item, so one bad value cannot fail the whole publish)."""
    if isinstance(res, BaseException):
        return res
    if not isinstance(res, dict):
        return TypeError(f"result is {type(res).__name__}, not an object")
    problem = wire_problem(res)
    if problem is None or problem.type == "json_type":
        try:
            orjson.dumps(res)  # a float subclass (numpy's) passes the check, not every encoder
            if problem is None:
                return res
        except TypeError:
            pass
        try:
            res = plain(res)
        except RecursionError:
            return TypeError("result is nested too deep")
        except BaseException as exc:  # a value's own tolist() failed: user code
            return exc
        problem = wire_problem(res)
        if problem is None:
            return res
    where = ".".join(map(str, problem.loc)) or "the result"
    # Usually the input's doing (1e308 doubled is infinite), so the client hears 422.
    return InvalidInput(
        f"the result cannot be sent: {where}: {problem.msg}",
        [{"loc": ["result", *problem.loc], "msg": problem.msg, "type": problem.type}],
    )
