"""``conveyor --version`` says which conveyor is installed."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata


def test_version_prints_the_installed_version_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"conveyor {metadata.version('conveyor')}"
