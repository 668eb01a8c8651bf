"""``python -m bench.generate``: its smoke run (``--quick``, as CI runs it) drives both
modes on real stacks with the same requests and reports sane figures; its arrivals are
seeded and long-tailed. Speed is never asserted."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from bench.generate import MODES, QUICK, arrivals

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(
    r"^\| (static|continuous) \| ([\d.]+) \| (\d+) \| (\d+) \| ([\d,]+) \| ([\d,]+) "
    r"\| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|",
    re.MULTILINE,
)
"""A row of the table: mode, rate, requests, errors, tokens, tokens/s, TTFT p50/p99 ms,
latency p50/p99 ms."""


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.timeout(330)
def test_quick_run_measures_both_modes_on_real_stacks(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "GENERATE.md"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "CONVEYOR_CACHE_DIR": str(cache_dir),
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench.generate", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = out.read_text()
    assert text == done.stdout  # --out writes what it prints
    rows = {(m[1], float(m[2])): [_number(g) for g in m.groups()[2:]] for m in ROW.finditer(text)}
    assert set(rows) == {(mode, rate) for mode in MODES for rate in QUICK.rates}, text
    for (mode, rate), (requests, errors, tokens, per_s, *times) in rows.items():
        ttft50, ttft99, latency50, latency99 = times
        assert requests >= 1, (mode, rate, text)
        assert errors == 0, (mode, rate, text)
        assert tokens > 0, (mode, rate, text)
        assert per_s > 0, (mode, rate, text)
        assert ttft50 <= latency50, (mode, rate, text)
        assert ttft99 <= latency99, (mode, rate, text)
    for rate in QUICK.rates:
        # The same requests for both modes: as many, asking for as many tokens (the tiny
        # model ends none of them early, and greedy answers are the same in both modes).
        static, continuous = rows["static", rate], rows["continuous", rate]
        assert static[0] == continuous[0], text
        assert static[2] == continuous[2], text
    # Each continuous row compares itself with static: three ratios, figures or '-'.
    assert re.search(r"^\| continuous \|.*\| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", text, re.M), text
    assert "CONVEYOR_DECODING" in text  # says whether the worker knows the setting


def test_arrivals_are_seeded_poisson_and_long_tailed() -> None:
    first = arrivals(4.0, 200.0, seed=7, tokens=(8, 400))
    assert first == arrivals(4.0, 200.0, seed=7, tokens=(8, 400))
    assert first != arrivals(4.0, 200.0, seed=8, tokens=(8, 400))
    assert first[0].at == 0
    assert all(a.at < b.at for a, b in pairwise(first))
    assert 0.8 * 800 < len(first) < 1.2 * 800  # about rate x duration
    asked = [a.max_new_tokens for a in first]
    assert min(asked) >= 8
    assert max(asked) <= 400
    # Most short, a few long: log-uniform's median is the geometric mean (about 57).
    assert 40 < statistics.median(asked) < 75 < statistics.mean(asked)
    assert sum(n > 270 for n in asked) < 0.2 * len(asked)
    assert len(arrivals(0.01, 1.0, seed=7, tokens=(8, 8))) == 1  # never empty
