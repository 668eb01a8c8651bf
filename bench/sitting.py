"""One sitting: several revisions of the code measured in turn by the same bench.

``python -m bench.sitting --revs 5db47d4,936328c,HEAD`` exports each revision (``git
archive``) into a directory of its own, puts this checkout's ``bench/`` in each (every tree
is measured by the same code), and runs ``python -m bench.hotpath`` on each in turn,
``--rounds`` times. The trees alternate within a round, their order turned by one each
round (:func:`turned`), so a drift in the machine's speed, and whatever running second
costs, falls on all of them. It writes one table per load: for each figure, each tree's
median and every round's value, and the last tree's median against each earlier one's.

On a shared 2-core machine one tree's rounds differ by up to 20%: a ratio from one
sitting, with its rounds, is what can be quoted; a figure from another sitting is not
comparable.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

from bench.hotpath_report import FIGURES

REPO = Path(__file__).resolve().parent.parent

SHOWN: tuple[str, ...] = (
    "req/s",
    "p50 ms",
    "mean batch",
    "Redis commands",
    "command µs, top level",
    "Redis CPU µs",
    "gateway CPU µs",
    "worker CPU µs",
    "gateway round trips",
    "worker round trips",
)
"""The figures the table shows (per request, as ``bench.hotpath --json`` writes them;
shown to the digits of :data:`bench.hotpath_report.FIGURES`)."""

DIGITS = dict(FIGURES)

Rounds = dict[str, dict[str, dict[int, dict[str, list[float]]]]]
"""Values by revision, workload, clients and figure: one a round."""


def export(rev: str, dest: Path, repo: Path = REPO) -> str:
    """Write revision ``rev`` of ``repo`` to ``dest``, with ``repo``'s own ``bench/`` in
    place of its; returns the commit's short id."""
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", commit], capture_output=True, check=True
    ).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    shutil.rmtree(dest / "bench", ignore_errors=True)
    shutil.copytree(repo / "bench", dest / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    return commit


def measure(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, list[dict[str, float]]]:
    """One round of ``bench.hotpath`` on ``tree``: its figures per workload, per load."""
    command = [sys.executable, "-m", "bench.hotpath", "--workloads", args.workloads]
    command += ["--clients", args.clients, "--seconds", f"{args.seconds:g}"]
    command += ["--watch-seconds", f"{args.watch_seconds:g}", "--traced", "0"]
    command += ["--out", str(out.with_suffix(".md")), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with out.with_suffix(".log").open("wb") as log:
        subprocess.run(command, cwd=tree, env=env, stdout=log, stderr=log, check=True)
    figures: dict[str, list[dict[str, float]]] = json.loads(out.read_text())
    return figures


def collect(rounds: Rounds, rev: str, figures: Mapping[str, Sequence[Mapping[str, float]]]) -> None:
    """Add one round of ``rev``'s ``figures`` to ``rounds``."""
    for workload, loads in figures.items():
        for load in loads:
            into = rounds.setdefault(rev, {}).setdefault(workload, {})
            values = into.setdefault(int(load["clients"]), {})
            for name in SHOWN:
                values.setdefault(name, []).append(float(load[name]))


def table(rounds: Rounds, revs: Sequence[str]) -> list[str]:
    """The sitting's tables: one per workload and load (see the module's doc)."""
    last = revs[-1]
    lines: list[str] = []
    for workload, loads in rounds[last].items():
        for clients in sorted(loads):
            head = [f"{rev} (median; rounds)" for rev in revs]
            head += [f"{last} / {rev}" for rev in revs[:-1]]
            lines += [
                "",
                f"### {workload}, {clients} client{'s' * (clients > 1)}",
                "",
                "| figure | " + " | ".join(head) + " |",
                "|---|" + "---:|" * len(head),
            ]
            for name in SHOWN:
                digits = DIGITS[name]
                medians: dict[str, float] = {}
                cells = []
                for rev in revs:
                    values = rounds.get(rev, {}).get(workload, {}).get(clients, {}).get(name, [])
                    if not values:
                        cells.append("-")
                        continue
                    medians[rev] = statistics.median(values)
                    each = ", ".join(f"{v:.{digits}f}" for v in values)
                    cells.append(f"**{medians[rev]:.{digits}f}** ({each})")
                for rev in revs[:-1]:
                    ok = rev in medians and last in medians and medians[rev]
                    cells.append(f"{medians[last] / medians[rev]:.2f}x" if ok else "-")
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def turned(revs: Sequence[str], n: int) -> list[str]:
    """The order the trees run in round ``n`` (from 1): turned by one each round, so no
    tree always runs right after another. Two trees run in a fixed order showed the
    second one's figures worse by a few percent whichever it was (2026-11-30: gateway
    CPU 1.08x, req/s 0.94x one way round; 1.01x, 1.00x the other)."""
    shift = (n - 1) % len(revs)
    return [*revs[shift:], *revs[:shift]]


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m bench.sitting``."""
    parser = argparse.ArgumentParser(prog="python -m bench.sitting", description=__doc__)
    parser.add_argument(
        "--revs", required=True, help="git revisions, comma-separated, oldest first"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each tree once a round)")
    parser.add_argument("--workloads", default="echo", help="as bench.hotpath takes them")
    parser.add_argument("--clients", default="1,64", help="as bench.hotpath takes them")
    parser.add_argument("--seconds", type=float, default=6.0, help="per counted interval")
    parser.add_argument("--watch-seconds", type=float, default=1.0, help="per MONITOR interval")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    revs = [rev.strip() for rev in args.revs.split(",") if rev.strip()]
    if not revs or args.rounds < 1:
        parser.error("--revs needs one revision or more, --rounds one or more")
    began = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rounds: Rounds = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-sitting-") as tmp:
        trees = {}
        for rev in revs:
            tree = Path(tmp) / rev.replace("/", "_")
            trees[export(rev, tree)] = tree
        for n in range(1, args.rounds + 1):
            for commit in turned(list(trees), n):
                tree = trees[commit]
                started = time.monotonic()
                figures = measure(tree, args, tree / f"round-{n}.json")
                collect(rounds, commit, figures)
                print(
                    f"round {n}: {commit} in {time.monotonic() - started:.0f} s, "
                    f"load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    command = " ".join(["python -m bench.sitting", *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join(
        [
            f"## A sitting of {', '.join(trees)} ({began})",
            "",
            f"`{command}`: each tree exported with this checkout's `bench/`, "
            f"{args.rounds} round(s), the trees in turn within each, the order turned by "
            "one each round; figures per request "
            "from `bench.hotpath` (its section in bench/RESULTS.md says what each counts).",
            *table(rounds, list(trees)),
        ]
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
