"""The supported Python versions and operating systems are stated (docs/index.md,
"Supported platforms"), agree with ``pyproject.toml``, and the tests run on one of them:
CI runs this suite, so CI's interpreter and system are checked to be ones the docs name."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO

INDEX = REPO / "docs" / "index.md"
CURRENT = f"{sys.version_info.major}.{sys.version_info.minor}"


def stated() -> tuple[tuple[int, int], str]:
    """The lowest Python version the docs support and their operating-system row."""
    text = INDEX.read_text(encoding="utf-8")
    python = re.search(r"^\| Python \| (\d+)\.(\d+) or newer\b", text, re.M)
    system = re.search(r"^\| Operating system \| ([^|]+)\|", text, re.M)
    assert python, "docs/index.md states no supported Python versions"
    assert system, "docs/index.md states no supported operating system"
    return (int(python[1]), int(python[2])), system[1].strip()


def test_the_docs_state_what_pyproject_requires() -> None:
    lowest, _ = stated()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={lowest[0]}.{lowest[1]}"
    listed = [
        c.rsplit(" :: ", 1)[1]
        for c in project.get("classifiers", [])
        if c.startswith("Programming Language :: Python :: 3.")
    ]
    for version in listed:  # the classifiers, where there are any, are within it
        assert tuple(int(x) for x in version.split(".")) >= lowest, version


def test_the_tests_run_on_a_supported_python_and_system() -> None:
    lowest, system = stated()
    assert sys.version_info[:2] >= lowest, sys.version
    assert sys.platform == "linux", sys.platform
    assert "Linux" in system, system


CHECK = """
import ast, importlib.util, pathlib, sys
bad = []
for name in sys.argv[2:]:
    path = pathlib.Path(sys.argv[1]) / name
    source = path.read_text(encoding="utf-8")
    try:
        tree = compile(source, str(path), "exec", ast.PyCF_ONLY_AST)
    except SyntaxError as exc:
        bad.append(f"{name}: {exc}")
        continue
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else [])
        for module in names:
            top = module.split(".")[0]
            if top in STDLIB and importlib.util.find_spec(top) is None:
                bad.append(f"{name}: imports {top}, which this Python lacks")
print("\\n".join(bad))
"""


def other_pythons(lowest: tuple[int, int]) -> dict[str, Path]:
    """The interpreters of other supported versions this machine has (``python3.N`` on
    the PATH, or a pyenv version), by version."""
    found: dict[str, Path] = {}
    candidates = [shutil.which(f"python3.{minor}") for minor in range(lowest[1], 20)]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += [str(p) for p in sorted(pyenv.glob("3.*/bin/python3"))]
    for candidate in filter(None, candidates):
        said = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        version = said.stdout.strip()
        if said.returncode or not re.fullmatch(r"3\.\d+", version):
            continue  # a pyenv shim of a version not selected, a broken one
        if tuple(map(int, version.split("."))) >= lowest and version != CURRENT:
            found.setdefault(version, Path(candidate))
    return found


def problems(python: Path, root: Path, files: list[str]) -> str:
    """What ``python`` finds wrong with ``files`` under ``root``: a syntax it cannot parse,
    a standard module it lacks; empty: none."""
    stdlib = f"STDLIB = {sorted(sys.stdlib_module_names)!r}\n"
    done = subprocess.run(
        [str(python), "-c", stdlib + CHECK, str(root), *files],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{python}: {done.stderr}"
    return done.stdout.strip()


def test_every_other_supported_python_here_compiles_conveyor(tmp_path: Path) -> None:
    # CI's machine has one Python (Debian 12's 3.11); where more are installed, each newer
    # one must parse every module and have every standard module conveyor imports (3.12
    # dropped distutils, 3.13 cgi and others), so "3.11 or newer" is checked where it can be.
    lowest, _ = stated()
    pythons = other_pythons(lowest)
    if not pythons:
        pytest.skip(f"no supported Python but {CURRENT} on this machine")
    files = [
        str(path.relative_to(REPO))
        for package in ("conveyor", "gateway", "workers", "runtime", "pipelines")
        for path in sorted((REPO / package).rglob("*.py"))
    ]
    (tmp_path / "old.py").write_text("import distutils.core\nimport os\n")
    for version, python in sorted(pythons.items()):
        found = problems(python, REPO, files)
        assert not found, f"Python {version} ({python}):\n{found}"
        if int(version.split(".")[1]) >= 12:  # the check itself: no distutils from 3.12 on
            assert "imports distutils" in problems(python, tmp_path, ["old.py"])
