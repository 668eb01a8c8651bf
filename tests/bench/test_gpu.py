"""``python -m bench.gpu``: its smoke run (``--device cpu --quick``, as CI runs it) writes
every section with figures in it, and its targets read the right rows."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.gpu_model import CHUNKS, Variant, ceiling, embed_stage, timed
from bench.gpu_report import Report, markdown, served_runner, targets
from bench.gpu_served import Served, Session, Window, graphs_said
from bench.workloads import items
from pipelines.model import Item
from pipelines.settings import load_settings
from pipelines.stages import BUILTIN
from workers.models.simulated import OneCall, SimulatedAccelerator
from workers.runner import Runner
from workers.settings import WorkerSettings

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
    assert "| CUDA graphs | not measured (run with --graphs) |" + " |" * 8 in text
    assert "2.20x this run's eager" in text


def test_a_capture_that_failed_says_not_captured_and_no_figure() -> None:
    # On the CPU every capture fails (the model is not on cuda), as one can on a GPU: the
    # worker then runs eager, and those eager rates must not read as the graphs'.
    settings = load_settings(
        WorkerSettings, device="cpu", max_batch_size=4, buckets=True, cuda_graphs=True
    )
    corpus = items(CHUNKS * 4, "embed")
    variant = timed("CUDA graphs", embed_stage(quick=True), settings, corpus, [1, 4], 0.2)
    assert variant.skipped.startswith("not captured: ")
    assert "cuda" in variant.skipped  # the reason the capture gave
    assert not variant.rates
    report = Report("python -m bench.gpu --graphs", "cuda", 10.0, 32, 4)
    report.variants = [Variant("bucketed", {1: 200.0, 4: 700.0}, 0.99999), variant]
    text = markdown(report)
    row = next(line for line in text.splitlines() if line.startswith("| CUDA graphs"))
    assert "| CUDA graphs | not captured: " in row
    assert not re.search(r"\| [\d,.]+ \|", row)  # no rate, no cosine
    assert all("CUDA graphs" not in t.name for t in targets(report))


def test_served_rows_say_whether_their_worker_replayed_graphs() -> None:
    failed = "12:00 WARNING workers.build: stage embed: no CUDA graphs, eager forward passes: boom"
    ran = "12:09 INFO workers.runner: stage embed: 412 batches replayed CUDA graphs"
    assert graphs_said(failed + "\n", "embed") == "not captured: eager forward passes: boom"
    assert graphs_said(f"{failed}\n{ran.replace('412', '0')}\n", "embed").startswith(
        "not captured: "
    )
    assert graphs_said(ran + "\n", "embed") == "replayed 412 batches"
    assert graphs_said(ran + "\n", "mixed").startswith("not captured: ")
    report = Report("python -m bench.gpu --graphs", "cuda", 10.0, 32, 4)
    report.variants = [
        Variant("bucketed", {32: 4000.0}, 0.99999),
        Variant("CUDA graphs", {32: 9000.0}, 0.99999, replays=50),
    ]
    eager = graphs_said(failed, "embed")
    report.rows = [Served("conveyor", 1, "embed", 256, _window(3800), graphs=eager)]
    assert served_runner(report) is report.variants[0]  # compared with the eager ceiling
    assert f"- conveyor (1 gw) embed: {eager}" in markdown(report)
    report.rows[0].graphs = graphs_said(ran, "embed")
    assert served_runner(report) is report.variants[1]


def test_a_closing_runner_says_how_many_batches_replayed_graphs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Captured:
        graphs = SimpleNamespace(replays=7)

        def predict(self, items: list[object]) -> list[object]:
            return items

    runner = Runner(BUILTIN["embed"], load_settings(WorkerSettings), Captured())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="workers.runner"):
        runner.close()
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert graphs_said(said, "embed") == "replayed 7 batches"


def test_the_in_process_ceiling_is_the_better_loop() -> None:
    # Host work and device time alike: serially a batch costs both, overlapped the larger.
    sim = SimulatedAccelerator(prepare_s=0.02, device_s=0.02, first_call_s=0.0)
    corpus: list[Item] = [{"text": "a few words"}] * (CHUNKS * 8)
    _, loop, busy = ceiling(sim, corpus, 8, 0.6)
    assert loop == "overlapped"
    assert busy is None  # not cuda: no events to time
    # The worker's overlap did happen: some batch was prepared while another was on the device.
    device = [s for s in sim.spans if s.phase == "device"]
    prepares = [s for s in sim.spans if s.phase == "prepare"]
    assert any(p.start < d.end and d.start < p.end for d in device for p in prepares)
    # A runner the worker does not overlap gets the serial loop only.
    _, loop, _ = ceiling(OneCall(sim), corpus, 8, 0.2)
    assert loop == "serial"
