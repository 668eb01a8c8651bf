"""conveyor's own wheel, for an app's image: made from the installed distribution (what
``conveyor deploy`` itself runs), so the image needs nothing published by us and nothing
but the files already on this machine: no network, no build backend.

The wheel holds every file of the distribution's top-level packages (bytecode and hidden
files left out) and its metadata as installed (``METADATA``, ``entry_points.txt``), with
the ``WHEEL`` and ``RECORD`` files the wheel format asks. Its bytes depend on those files
only (fixed timestamps, sorted entries), so an unchanged conveyor gives an unchanged wheel,
and Docker's layer cache holds. An editable install's metadata is the one written when it
was installed: reinstall after changing the project's dependencies.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import zipfile
from importlib import metadata
from pathlib import Path

from pipelines.errors import ConfigError

DISTRIBUTION = "conveyor"
"""The distribution packed."""

TAG = "py3-none-any"
"""Pure Python: one wheel for every platform the image may have."""

_EPOCH = (1980, 1, 1, 0, 0, 0)
"""The earliest time a zip entry holds: every entry gets it, so the bytes never vary."""


def wheel_name() -> str:
    """The wheel's file name: ``conveyor-<version>-py3-none-any.whl``."""
    return f"{DISTRIBUTION}-{metadata.version(DISTRIBUTION)}-{TAG}.whl"


def _package_files(dist: metadata.Distribution) -> list[tuple[str, Path]]:
    """Each file of the top-level packages: (its path in the wheel, where it is here)."""
    top = (dist.read_text("top_level.txt") or "").split()
    if not top:
        raise ConfigError(f"the installed {DISTRIBUTION} lists no packages (top_level.txt)")
    files: list[tuple[str, Path]] = []
    for name in sorted(top):
        package = Path(str(dist.locate_file(name)))
        if not (package / "__init__.py").is_file():
            spec = importlib.util.find_spec(name)  # an editable install: the source tree
            if spec is None or spec.origin is None:
                raise ConfigError(f"package {name!r} of {DISTRIBUTION} is not importable")
            package = Path(spec.origin).parent
        for path in sorted(package.rglob("*")):
            rel = path.relative_to(package)
            hidden = any(part.startswith(".") or part == "__pycache__" for part in rel.parts)
            if path.is_file() and not hidden and path.suffix not in (".pyc", ".pyo"):
                files.append(((Path(name) / rel).as_posix(), path))
    return files


def _entry(archive: zipfile.ZipFile, name: str, data: bytes, executable: bool = False) -> str:
    """Add one file with a fixed time; its RECORD line."""
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o100755 if executable else 0o100644) << 16
    archive.writestr(info, data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder: Path) -> Path:
    """Write conveyor's wheel into ``folder`` (created if missing) and return its path.

    Args:
        folder: where the wheel goes (the build context's ``wheels/`` of the deploy folder).

    Raises:
        ConfigError: conveyor is not installed as a distribution (run from a bare source
            tree: ``pip install -e .`` first), or its metadata lacks a file.
    """
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"{DISTRIBUTION} is not installed (pip install it, or `pip install -e .` in its "
            "source tree): its wheel for the image is made from the installed files"
        ) from None
    meta = dist.read_text("METADATA") or dist.read_text("PKG-INFO")  # a wheel's, an egg's
    if meta is None or "Requires-Dist:" not in meta:
        raise ConfigError(f"the installed {DISTRIBUTION}'s metadata lists no requirements")
    info = f"{DISTRIBUTION}-{dist.version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / wheel_name()
    for stale in folder.glob(f"{DISTRIBUTION}-*.whl"):  # one wheel: the Dockerfile names it
        if stale != path:
            stale.unlink()
    wheel_file = (
        f"Wheel-Version: 1.0\nGenerator: conveyor deploy\nRoot-Is-Purelib: true\nTag: {TAG}\n"
    )
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w") as archive:
        record = [
            _entry(archive, name, source.read_bytes(), executable=name.endswith(".sh"))
            for name, source in _package_files(dist)
        ]
        record.append(_entry(archive, f"{info}/METADATA", meta.encode()))
        record.append(_entry(archive, f"{info}/WHEEL", wheel_file.encode()))
        for extra in ("entry_points.txt", "top_level.txt"):
            text = dist.read_text(extra)
            if text is not None:
                record.append(_entry(archive, f"{info}/{extra}", text.encode()))
        record.append(f"{info}/RECORD,,")
        _entry(archive, f"{info}/RECORD", ("\n".join(record) + "\n").encode())
    tmp.replace(path)
    return path
