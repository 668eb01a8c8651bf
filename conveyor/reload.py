"""``conveyor up --reload``: the app folder's ``.py`` files watched, and what changed served.

Every :data:`POLL_S` the modification times and sizes of the app folder's ``.py`` files
are compared with the last look (polling: no watcher dependency, and it works on every
file system). Once a change holds still for one look (an editor's save is several
writes), the changed files are compiled here: one that does not compile is one line
naming it, and the processes running go on as they are until it is fixed. Then a fresh
interpreter imports the app (``python -m conveyor.reload``: ``up``'s own import of it is
stale) and says its shape (each pipeline's graph and input schema), its worker groups and
the file of each stage's code; an app that cannot be imported is one line, and nothing
restarts. Otherwise:

- the shape changed (a stage or a pipeline added, removed or renamed, an edge, an input
  field): the gateways restart (their routes change) and every worker restarts (each
  routes by the graph); a group no longer in the app is stopped, a new one started;
- else the workers whose stage's own module changed restart; a change to the app's module
  or to a module no stage names (a helper any stage may import) restarts every worker.

A restart is graceful (:meth:`~conveyor.supervisor.Supervisor.recycle`): SIGTERM, the
worker finishes its batch and leaves its group, then the new one starts; what is queued
meanwhile waits in Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conveyor.children import say
from conveyor.placement import Group, PlacementSettings, worker_groups
from conveyor.supervisor import Supervisor
from pipelines.errors import ConfigError
from pipelines.registry import Registry, load_registry
from pipelines.settings import load_settings
from pipelines.stages import Stage

__all__ = ["POLL_S", "AppInfo", "Reloader", "app_info", "scan"]

POLL_S = 0.5
"""How often the app folder's files are looked at."""

INSPECT_S = 120.0
"""How long the fresh interpreter may take to import the app and say what it holds."""

MAX_FILES = 5000
"""At most this many ``.py`` files are watched (a folder holding a whole tree)."""

SKIPPED = frozenset({"__pycache__", "node_modules", "site-packages", "build", "dist"})
"""Folders never watched (besides hidden ones and virtualenvs)."""

Snapshot = dict[str, tuple[int, int]]
"""Each watched file (relative path): its modification time (ns) and size."""


def _files(folder: Path) -> Iterator[Path]:
    for root, dirs, names in os.walk(folder):
        # Hidden folders (.conveyor, .git, .venv), caches, and any virtualenv: not the app.
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d not in SKIPPED
            and not (Path(root, d) / "pyvenv.cfg").exists()
        ]
        for name in names:
            if name.endswith(".py"):
                yield Path(root, name)


def scan(folder: Path) -> Snapshot:
    """The ``.py`` files under ``folder`` (see :data:`SKIPPED`), at most :data:`MAX_FILES`.

    Args:
        folder: the app folder.
    """
    seen: Snapshot = {}
    for path in _files(folder):
        try:
            st = path.stat()
        except OSError:  # removed between the listing and the look
            continue
        seen[str(path.relative_to(folder))] = (st.st_mtime_ns, st.st_size)
        if len(seen) >= MAX_FILES:
            break
    return seen


@dataclasses.dataclass(frozen=True)
class AppInfo:
    """What ``up`` serves of an app, as one interpreter imported it.

    Attributes:
        shape: a digest of each pipeline's graph and input schema, and of the stages'
            names: what the gateway's routes are made of.
        groups: the worker groups (:func:`~conveyor.placement.worker_groups`).
        files: each stage's code file, relative to the app folder (None: outside it, a
            built-in).
        app_file: the app module's file, relative to the app folder (None: outside it).
    """

    shape: str
    groups: tuple[Group, ...]
    files: dict[str, str | None]
    app_file: str | None

    def to_json(self) -> str:
        """This, as one line of JSON (what ``python -m conveyor.reload`` prints)."""
        groups = [dataclasses.asdict(g) for g in self.groups]
        body = {"shape": self.shape, "groups": groups, "files": self.files}
        return json.dumps(body | {"app_file": self.app_file})

    @classmethod
    def from_json(cls, raw: str) -> AppInfo:
        """Read what :meth:`to_json` wrote (by a child of ``up``: trusted as its own)."""
        body = json.loads(raw)
        groups = tuple(Group(**(g | {"stages": tuple(g["stages"])})) for g in body["groups"])
        return cls(body["shape"], groups, dict(body["files"]), body["app_file"])

    def changed(self, files: set[str], group: Group) -> bool:
        """Whether ``group``'s workers run code from ``files`` (see the module)."""
        own = {self.files.get(s) for s in group.stages} - {None}
        named = set(self.files.values()) - {None, self.app_file}
        return bool(files & own) or any(f not in named for f in files)


def _inside(path: str | None, folder: Path) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(folder.resolve()))
    except ValueError:
        return None


def _stage_file(stage: Stage) -> str | None:
    """The file of ``stage``'s own code: its function step's function, else its runner."""
    fn = stage.options.get("fn")
    target: Any = fn if fn is not None else stage.runner
    if isinstance(target, str):
        try:
            spec = importlib.util.find_spec(target.partition(":")[0])
        except (ImportError, ValueError):
            return None
        return spec.origin if spec is not None else None
    try:
        return inspect.getsourcefile(target)
    except TypeError:  # a built-in, or an object of no file
        return None


def app_info(registry: Registry, groups: list[Group], app: str, folder: Path) -> AppInfo:
    """What ``up`` serves of ``registry`` (see :class:`AppInfo`).

    Args:
        registry: the pipelines served.
        groups: their worker groups.
        app: ``module:attribute`` of the app.
        folder: the app folder.
    """
    parts = []
    for name, pipeline in sorted(registry.pipelines.items()):
        schema = json.dumps(pipeline.input_model.model_json_schema(), sort_keys=True)
        parts.append(f"{name}\n{pipeline.describe()}\n{schema}")
    parts.append(",".join(sorted(registry.stages)))
    shape = hashlib.sha256("\n\n".join(parts).encode()).hexdigest()
    files = {n: _inside(_stage_file(s), folder) for n, s in registry.stages.items()}
    spec = importlib.util.find_spec(app.partition(":")[0])
    app_file = _inside(spec.origin if spec is not None else None, folder)
    return AppInfo(shape, tuple(groups), files, app_file)


async def inspect_app(env: dict[str, str], replicas: int | None) -> AppInfo | str:
    """The app as a fresh interpreter with ``env`` imports it; or, where it cannot, the
    last line it said (why)."""
    argv = [sys.executable, "-m", "conveyor.reload"]
    if replicas is not None:
        argv.append(str(replicas))
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), INSPECT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"importing the app took over {INSPECT_S:g}s"
    if proc.returncode != 0:
        lines = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1].removeprefix("conveyor: ") if lines else f"exit status {proc.returncode}"
    return AppInfo.from_json(out.decode().strip().splitlines()[-1])


def _compile_error(folder: Path, name: str) -> str | None:
    """Why ``name`` (in ``folder``) does not compile, in one line; None: it does."""
    path = folder / name
    try:
        source = path.read_bytes()
    except OSError:
        return None  # removed: its importers will say so
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"{name}:{exc.lineno}: {exc.msg}"
    except ValueError as exc:  # a NUL byte
        return f"{name}: {exc}"
    return None


@dataclasses.dataclass
class Reloader:
    """Watches the app folder for :class:`Supervisor` (its :attr:`~Supervisor.reloader`:
    called at each of its looks, it looks at the files every :data:`POLL_S`).

    Args:
        folder: the app folder.
        supervisor: whose processes are restarted.
        info: the app as ``up`` started it.
        replicas: ``up --replicas`` (None: each stage's own).
    """

    folder: Path
    supervisor: Supervisor
    info: AppInfo
    replicas: int | None = None
    seen: Snapshot = dataclasses.field(default_factory=dict)
    pending: set[str] = dataclasses.field(default_factory=set)  # changed, not yet served
    stalled: bool = False  # the pending change failed: waiting for the next one
    next_look: float = 0.0

    def __post_init__(self) -> None:
        self.seen = scan(self.folder)

    async def tick(self) -> None:
        """One look, if one is due; a change that holds still is served."""
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + POLL_S
        files = scan(self.folder)
        moved = {f for f in files.keys() | self.seen.keys() if files.get(f) != self.seen.get(f)}
        self.seen = files
        if moved:  # still being written: served once it holds still for a look
            self.pending |= moved
            self.stalled = False
            return
        if self.pending and not self.stalled:
            await self.serve()
            self.next_look = time.monotonic() + POLL_S

    async def serve(self) -> None:
        """Restart what the changed files run in (see the module); one line and nothing
        restarted for a file that does not compile or an app that cannot be imported."""
        changed = sorted(self.pending)
        for name in changed:
            if (why := _compile_error(self.folder, name)) is not None:
                say(f"reload: {why}; the running processes go on until it is fixed")
                self.stalled = True  # kept, with the fix (a change of its own) to come
                return
        info = await inspect_app(self.supervisor.env, self.replicas)
        if isinstance(info, str):
            say(f"reload: {info}; the running processes go on until it is fixed")
            self.stalled = True
            return
        self.pending.clear()
        old, self.info = self.info, info
        shaped = info.shape != old.shape
        kept = {g.name for g in info.groups}
        gone = [g for g in old.groups if g.name not in kept]
        new = [g for g in info.groups if g.name not in {o.name for o in old.groups}]
        edited = set(changed)
        redo = [g for g in info.groups if g not in new and (shaped or info.changed(edited, g))]
        restarted = (["the gateway"] if shaped else []) + [f"worker {g.name}" for g in redo]
        steps = [
            f"restarting {', '.join(restarted)}" if restarted else "",
            f"starting worker {', '.join(g.name for g in new)}" if new else "",
            f"stopping worker {', '.join(g.name for g in gone)}" if gone else "",
        ]
        done = "; ".join(s for s in steps if s) or "nothing to restart (no worker runs it)"
        say(f"reload: {', '.join(changed)} changed: {done}")
        for group in gone:
            self.supervisor.retire(group.name)
        for group in new:
            try:
                self.supervisor.add_group(group)
            except ConfigError as exc:
                say(f"reload: worker {group.name} cannot start: {exc}")
        self.supervisor.recycle({g.name for g in redo}, gateways=shaped)


def main(argv: list[str] | None = None) -> None:
    """``python -m conveyor.reload [REPLICAS]``: import the app ``CONVEYOR_APP`` names, as
    ``up`` would, and print its :class:`AppInfo` as one line of JSON; a failure is one
    line on stderr and exit status 2."""
    args = sys.argv[1:] if argv is None else argv
    replicas = int(args[0]) if args else None
    app = os.environ.get("CONVEYOR_APP", "")
    folder = Path.cwd()
    try:
        registry = load_registry(app, os.environ.get("CONVEYOR_PIPELINES"))
        groups = worker_groups(registry, replicas, load_settings(PlacementSettings))
        print(app_info(registry, groups, app, folder).to_json(), flush=True)
    except ConfigError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
