"""The targets ``python -m bench`` reports (bench/report.py) read the rows they name."""

from __future__ import annotations

from bench.loadgen import LoadResult
from bench.report import targets
from bench.run import Plan, Results, Row


def _row(system: str, concurrency: int, per_s: float, cpu_ms: float) -> Row:
    load = LoadResult(
        requests=int(per_s * 10),
        errors=0,
        seconds=10.0,
        latencies=[0.01] * int(per_s * 10),
        steady_ok=int(per_s * 10),
        steady_seconds=10.0,
    )
    return Row(system, "echo", concurrency, 1, load, 8.0, cpu_ms)


def _results(ours: float, theirs: float) -> Results:
    plan = Plan(["conveyor", "hf-batching"], ["echo"], [1, 64], 100, 1.0, 0.0, [], 2)
    res = Results(plan)
    res.rows = [
        _row("conveyor", 1, 10.0, 9.0),  # the lower concurrency is not the one compared
        _row("conveyor", 64, ours, 1.2),
        _row("hf-batching", 64, theirs, 0.6),
    ]
    return res


def test_echo_against_the_one_process_loop_is_a_target_at_the_top_concurrency() -> None:
    (target,) = [t for t in targets(_results(800.0, 1000.0)) if t.name.startswith("echo:")]
    assert "c=64" in target.name
    assert target.measured.startswith("0.80 (800 / 1000 per s; CPU 1.20 / 0.60 ms")
    assert not target.passed
    (target,) = [t for t in targets(_results(1100.0, 1000.0)) if t.name.startswith("echo:")]
    assert target.passed


def test_without_the_loop_measured_there_is_no_such_target() -> None:
    res = _results(800.0, 1000.0)
    res.rows = [r for r in res.rows if r.system == "conveyor"]
    assert not [t for t in targets(res) if t.name.startswith("echo:")]
