"""bench.sitting: revisions exported with this checkout's bench, and their rounds tabled
as medians with every round and the last tree against each earlier one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.sitting import SHOWN, Rounds, collect, export, table, turned

REPO = Path(__file__).resolve().parents[2]


def load(clients: int, scale: float) -> dict[str, float]:
    """One load's figures, each ``scale`` times its index plus one."""
    return {"clients": clients, **{name: scale * (i + 1) for i, name in enumerate(SHOWN)}}


def test_rounds_are_tabled_as_medians_with_each_round_and_ratios_to_the_last() -> None:
    rounds: Rounds = {}
    for scale in (1.0, 3.0, 2.0):
        collect(rounds, "old", {"echo": [load(1, scale), load(64, scale)]})
    for scale in (1.0, 1.5, 0.5):
        collect(rounds, "new", {"echo": [load(1, scale), load(64, scale)]})
    lines = table(rounds, ["old", "new"])
    assert lines.count("### echo, 1 client") == 1
    assert lines.count("### echo, 64 clients") == 1
    rows = [line for line in lines if line.startswith("| req/s |")]
    assert len(rows) == 2  # one per load
    # req/s is the first figure: old's rounds 1, 3, 2 (median 2); new's 1, 1.5, 0.5 (1).
    assert rows[0] == "| req/s | **2** (1, 3, 2) | **1** (1, 2, 0) | 0.50x |"
    worker = next(line for line in lines if line.startswith("| worker round trips |"))
    assert worker.endswith(
        "| **20.00** (10.00, 30.00, 20.00) | **10.00** (10.00, 15.00, 5.00) | 0.50x |"
    )


def test_a_tree_without_a_load_shows_a_dash() -> None:
    rounds: Rounds = {}
    collect(rounds, "old", {"echo": [load(64, 1.0)]})
    collect(rounds, "new", {"echo": [load(1, 1.0), load(64, 2.0)]})
    lines = table(rounds, ["old", "new"])
    one = lines[lines.index("### echo, 1 client") :]
    assert next(line for line in one if line.startswith("| req/s |")) == (
        "| req/s | - | **1** (1) | - |"
    )


def test_a_revision_is_exported_with_this_checkout_s_bench(tmp_path: Path) -> None:
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:  # a tarball, or no git
        pytest.skip(f"this checkout is not a git repository git can read here: {exc}")
    commit = export("HEAD", tmp_path / "tree", REPO)
    assert commit == head
    assert (tmp_path / "tree" / "workers" / "publish.lua").exists()
    ours = {p.name for p in (REPO / "bench").iterdir() if p.name != "__pycache__"}
    theirs = {p.name for p in (tmp_path / "tree" / "bench").iterdir()}
    assert theirs == ours
    assert (tmp_path / "tree" / "bench" / "sitting.py").read_bytes() == (
        REPO / "bench" / "sitting.py"
    ).read_bytes()


def test_the_order_of_the_trees_turns_each_round() -> None:
    orders = [turned(["a", "b", "c"], n) for n in range(1, 5)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [turned(["a", "b"], n) for n in (1, 2, 3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert turned(["only"], 7) == ["only"]
