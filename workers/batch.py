"""The batch contract: n items in, n results out, a failing item fails alone; what a
batch did (its record) and what its results may hold to be sent. The thread the model
runs in is :mod:`workers.runner`'s."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from pipelines.envelope import wire_problem
from pipelines.errors import BatchContractError, DeadlineExceeded, InvalidInput
from pipelines.model import Item, Model, Result


class Entry(NamedTuple):
    """A stream entry as redis-py reads it (its id and its fields), and the stream (the
    stage's stream of one lane) it was read from: where it is acked, touched, counted."""

    id: bytes
    fields: dict[bytes, bytes]
    stream: str


def by_stream(entries: Iterable[Entry]) -> dict[str, list[bytes]]:
    """The ids of ``entries``, grouped by the stream each came from (in entry order)."""
    out: dict[str, list[bytes]] = {}
    for entry in entries:
        out.setdefault(entry.stream, []).append(entry.id)
    return out


def contract(items: list[Item], results: object) -> list[Result | BaseException]:
    if not isinstance(results, (list, tuple)) or len(results) != len(items):
        got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
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


@dataclass
class BatchRecord:
    """What one batch did (kept in memory for tests and introspection).

    Attributes:
        size: entries in the batch.
        oldest_ms: arrival time of its oldest entry (server ms).
        closed_at: when assembly ended (server clock, seconds).
        run_s: model time.
        outcomes: items per outcome.
        request_ids: ids of the requests, in batch order.
        trace_ids: their trace ids (logged with the batch).
        arrivals: when each request arrived (server clock, seconds), as ``request_ids``.
        ran_at: when the model finished the batch (server clock; 0: it did not run).
        tokens: the estimated tokens of the items the model ran (:mod:`workers.lengths`).
        padded_tokens: those items times the longest of them: what the model padded to.
        cold: the model met a shape it had not run before (its time is no cost sample).
    """

    size: int
    oldest_ms: int
    closed_at: float
    run_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    request_ids: list[str] = field(default_factory=list)
    trace_ids: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    ran_at: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0
    cold: bool = False


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
