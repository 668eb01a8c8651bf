"""``.ci/install`` on a fresh Debian machine, its apt stood in for by a script: a nodejs
that bundles npm (NodeSource's) conflicts with Debian's npm package, so nodejs is asked
alone and npm only if it is still missing afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

APT = f"""#!{sys.executable}
# apt-get as a fresh Debian 12 answers it; each package "installed" is a command in this folder.
import os, sys
from pathlib import Path

here = Path(__file__).parent
args = sys.argv[1:]
with open(here / "apt.log", "a") as log:
    log.write(" ".join(args) + "\\n")
if args[0] != "install":
    sys.exit(0)
packages = [a for a in args[1:] if not a.startswith("-")]
bundled = os.environ["NODE_BUNDLES_NPM"] == "1"
if "npm" in packages and bundled:  # its nodejs, asked or installed, conflicts
    print("nodejs : Conflicts: npm", file=sys.stderr)
    sys.exit(100)
commands = {{"nodejs": ["node", "npm"] if bundled else ["node"], "npm": ["npm"]}}
for package in packages:
    for command in commands.get(package, [package]):
        made = here / command
        made.write_text("#!/bin/sh\\n")
        made.chmod(0o755)
"""

PRESENT = ["redis-server", "redis-cli", "docker-compose", "chromium", "ip"]
"""What the machine has already: only node and npm are missing."""


def install(tmp_path: Path, *, bundled: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(APT)
    (bin_dir / "apt-get").chmod(0o755)
    for command in PRESENT:
        (bin_dir / command).write_text("#!/bin/sh\n")
        (bin_dir / command).chmod(0o755)
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, str(REPO / ".ci" / "install")],
        env={"PATH": str(bin_dir), "NODE_BUNDLES_NPM": "1" if bundled else "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done, (bin_dir / "apt.log").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_a_nodejs_that_bundles_npm_is_installed_alone(tmp_path: Path) -> None:
    done, asked = install(tmp_path, bundled=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bin" / "npm").exists()
    assert "install -y -qq nodejs" in asked
    assert "npm" not in asked


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_debians_nodejs_gets_debians_npm_after_it(tmp_path: Path) -> None:
    done, asked = install(tmp_path, bundled=False)
    assert done.returncode == 0, done.stderr
    installs = [line for line in asked.splitlines() if line.startswith("install")]
    assert installs == ["install -y -qq nodejs", "install -y -qq npm"]


def test_ci_run_installs_through_it() -> None:
    assert ".ci/install" in (REPO / ".ci" / "run").read_text()
    assert os.access(REPO / ".ci" / "install", os.X_OK)
