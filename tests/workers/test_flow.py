"""The worker as a flow (issue 30, item 6): lower rooms never import higher ones to ask
a question, and the source does not publish (read from the modules' own imports)."""

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
