"""``python -m bench.gpu``: its smoke run (``--device cpu --quick``, as CI runs it) writes
every section with figures in it, and its targets read the right rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_model import Variant
from bench.gpu_report import Report, markdown, targets
from bench.gpu_served import Served, Session, Window

ROOT = Path(__file__).resolve().parents[2]
SERVED_ROW = re.compile(
    r"^\| (conveyor|conveyor-items) \| (\d+) \| (\w+) \| (\d+) \| ([\d,.]+) \|"
    r".* \| (\d+)/(\d+) \|",
    re.MULTILINE,
)
"""A row of the served table: system, gateways, workload, clients, req/s, errors/answered."""


@pytest.mark.timeout(330)
def test_smoke_run_on_cpu_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "GPU.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = out.read_text()
    for heading in ("## Targets", "## In-process", "## Served", "### From ready", "## Machine"):
        assert heading in text
    for runner in ("eager", "bucketed"):  # dtype, shapes, prepare s, then a rate per batch
        assert re.search(
            rf"^\| {runner} \| float32 \| \d+ \| [\d.]+ \|( [\d,.]+ \|){{3}}", text, re.M
        )
    assert "| CUDA graphs | not measured" in text
    served = {(m[1], int(m[2]), m[3], int(m[4])): int(m[7]) for m in SERVED_ROW.finditer(text)}
    expected = {("conveyor", 1, w, c) for w in ("echo", "embed", "mixed") for c in (1, 8)}
    expected |= {("conveyor-items", 1, "mixed", c) for c in (1, 8)}
    several = len(os.sched_getaffinity(0)) >= 8  # echo on 4 gateways wants 8 cores
    expected |= {("conveyor", 4, "echo", c) for c in (1, 8) if several}
    assert set(served) == expected
    assert all(answered > 0 for answered in served.values()), served
    assert "first 2 s after ready / steady: conveyor mixed, 8 clients" in text
    gateways = "echo at 8 clients: 4 gateways / 1 | "
    assert (gateways + "not measured" in text) is not several


def _window(ok: int, seconds: float = 1.0) -> Window:
    return Window(seconds, ok, 0, [0.01] * ok, cpu_s=0.1, model_s=0.5)


def test_targets_compare_the_rows_they_name() -> None:
    report = Report("python -m bench.gpu", "cuda", 10.0, 32, 4)
    report.sessions = [
        Session("conveyor", ("mixed", "embed", "echo")),
        Session("conveyor-items", ("mixed",)),
        Session("conveyor", ("echo",), 4),
    ]
    report.variants = [
        Variant("eager", {1: 100.0, 32: 3000.0, 128: 5000.0}, 1.0),
        Variant("bucketed", {1: 200.0, 32: 4000.0, 128: 11000.0}, 0.99999),
        Variant("CUDA graphs", skipped="not measured (run with --graphs)"),
    ]
    report.rows = [
        Served("conveyor", 1, "mixed", 256, _window(2000), first=_window(1700)),
        Served("conveyor-items", 1, "mixed", 256, _window(1000), first=_window(500)),
        Served("conveyor", 1, "embed", 256, _window(3800)),
        Served("conveyor", 1, "embed", 1, _window(100)),
        Served("conveyor", 1, "echo", 256, _window(5000)),
        Served("conveyor", 4, "echo", 256, _window(12000)),
    ]
    verdicts = {t.name: t.passed for t in targets(report)}
    assert verdicts == {
        "first 10 s after ready / steady: conveyor mixed, 256 clients": True,  # 0.85
        "first 10 s after ready / steady: conveyor-items mixed, 256 clients": False,  # 0.5
        "served embed at 256 clients / in-process bucketed at its best batch up to 32": True,
        "served embed at 256 clients / 1,206 req/s (H100, before)": True,  # 3.15x
        "mixed at 256 clients: length-aware / item-count": True,  # 2x
        "in-process bucketed at batch 128 / 5,400/s (H100 eager, before)": True,  # 2.04x
        "in-process bucketed: worst cosine to the CPU float32 answer": True,
        "echo at 256 clients: 4 gateways / 1": False,  # 2.4x
    }
    text = markdown(report)
    assert "| CUDA graphs | not measured (run with --graphs) |" + " |" * 6 in text
    assert "2.20x this run's eager" in text
