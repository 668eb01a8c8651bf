"""How a worker process tells torch's OpenMP runtime to wait (read once, at torch's load)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers.__main__ import configure_openmp
from workers.settings import WorkerSettings


def test_idle_threads_sleep_after_a_short_spin_by_default() -> None:
    environ: dict[str, str] = {}
    configure_openmp(WorkerSettings(), environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def test_spin_wait_spins_and_the_environment_wins() -> None:
    environ: dict[str, str] = {}
    configure_openmp(WorkerSettings(spin_wait=True), environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    environ = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"}
    configure_openmp(WorkerSettings(openmp_spin_count=0), environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"}


def test_the_spin_count_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_OPENMP_SPIN_COUNT", "0")
    environ: dict[str, str] = {}
    configure_openmp(WorkerSettings(), environ)
    assert environ["GOMP_SPINCOUNT"] == "0"
    monkeypatch.setenv("CONVEYOR_OPENMP_SPIN_COUNT", "-1")
    with pytest.raises(ValueError, match="openmp_spin_count"):
        WorkerSettings()


def test_torch_runs_under_what_was_set() -> None:
    # The runtime reads these when torch loads it: set first, a parallel op still works.
    code = (
        "import os\n"
        "from workers.__main__ import configure_openmp\n"
        "from workers.settings import WorkerSettings\n"
        "configure_openmp(WorkerSettings(), os.environ)\n"
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "x = torch.ones(512, 512)\n"
        "print(os.environ['GOMP_SPINCOUNT'], float((x @ x).sum()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["10000", str(512.0 * 512 * 512)]
