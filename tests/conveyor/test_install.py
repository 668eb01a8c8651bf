"""The CPU install the docs give (docs/client.md) resolves to torch's CPU build: no
``nvidia-*`` package, none of the GBs a machine without a GPU never uses.

It asks the real indexes (PyPI and PyTorch's CPU index), with pip's own configuration set
aside: where they cannot be reached, or answer too slowly, it skips, saying so. conveyor
itself is not on PyPI, so the checkout stands in for ``conveyor``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import REPO

DOC = REPO / "docs" / "client.md"
COMMAND = "pip install 'conveyor[serve]' torch=="
"""How the documented CPU install's line starts."""

INDEXES = ("https://pypi.org/simple/pip/", "https://download.pytorch.org/whl/cpu/torch/")
"""What the resolution needs to reach."""

RESOLVE_S = 120
"""The most the resolution may take; longer (a loaded machine, a slow index) skips."""

NETWORK = (
    "NewConnectionError",
    "Max retries",
    "ConnectTimeout",
    "ReadTimeout",
    "Temporary failure",
)
"""What pip says when it could not reach an index (not a failed resolution)."""


def documented() -> list[str]:
    """The arguments of the documented CPU install, after ``pip install``."""
    lines = [line for line in DOC.read_text().splitlines() if line.startswith(COMMAND)]
    assert len(lines) == 1, f"{DOC}: expected one line starting {COMMAND!r}"
    return shlex.split(lines[0])[2:]


def unreachable(url: str) -> str | None:
    """Why ``url`` cannot be read now (None: it can)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            answer.read(1)
    except OSError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(RESOLVE_S + 60)  # the resolution's own bound, not the suite's 120 s
def test_the_documented_cpu_install_brings_no_nvidia_package(tmp_path: Path) -> None:
    args = documented()
    assert "--extra-index-url" in args
    assert "https://download.pytorch.org/whl/cpu" in args
    for url in INDEXES:
        why = unreachable(url)
        if why is not None:
            pytest.skip(f"cannot reach {url} ({why}): the CPU install's resolution is unchecked")
    report = tmp_path / "report.json"
    # The checkout for the unpublished `conveyor`; pip's configuration (this machine's local
    # indexes, wheels and constraints) set aside, so the public indexes alone decide.
    local = [f"{REPO}[serve]" if arg == "conveyor[serve]" else arg for arg in args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if "PIP_CERT" in os.environ:
        env["PIP_CERT"] = os.environ["PIP_CERT"]
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    try:
        done = subprocess.run(
            [*pip, "--no-build-isolation", "--report", str(report), *local],
            env=env,
            capture_output=True,
            text=True,
            timeout=RESOLVE_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"the indexes did not resolve the CPU install within {RESOLVE_S} s")
    if done.returncode != 0 and any(sign in done.stderr for sign in NETWORK):
        pytest.skip(f"an index stopped answering: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    resolved = {
        item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "torch" in resolved
    assert [name for name in resolved if name.startswith("nvidia-")] == []
    if platform.system() == "Linux":
        assert resolved["torch"].endswith("+cpu"), resolved["torch"]
