"""The worker as a flow: lower rooms never import higher ones to ask a question, the
stages sit side by side, and the values sit below them all (read from the modules' own
imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import workers

ROOT = Path(workers.__file__).parent


def imported(module: str) -> set[str]:
    """The modules ``workers/<module>.py`` imports (absolute ``from`` and ``import``)."""
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_window_and_the_lanes_ask_a_load_protocol_not_the_runner() -> None:
    for module in ("window", "lanes"):
        assert "workers.runner" not in imported(module), module
        assert "workers.load" in imported(module), module


def test_the_source_hands_dead_letters_to_the_loop_instead_of_publishing() -> None:
    assert "workers.publish" not in imported("source")


def test_a_batch_lives_beside_the_other_batch_types() -> None:
    assert not any(
        isinstance(node, ast.ClassDef) and node.name == "Batch"
        for node in ast.walk(ast.parse((ROOT / "intake.py").read_text()))
    )


STAGES = ("intake", "runner", "publish", "report")


def test_the_values_import_nothing_of_the_worker() -> None:
    assert not any(name.startswith("workers") for name in imported("values"))


def test_the_stages_import_neither_each_other_nor_recovery() -> None:
    for stage in STAGES:
        names = imported(stage)
        others = {f"workers.{other}" for other in (*STAGES, "recovery", "loop", "parts")}
        assert not names & (others - {f"workers.{stage}"}), stage


def test_the_runner_learns_nothing_itself() -> None:
    names = imported("runner")
    assert not names & {"workers.window", "workers.intake", "workers.claims", "workers.partials"}


def test_the_two_loops_share_one_set_of_parts_and_neither_imports_the_other() -> None:
    assert "workers.loop" not in imported("decoding")
    assert "workers.parts" in imported("decoding")
    assert "workers.parts" in imported("loop")
