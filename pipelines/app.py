"""Which pipelines a process serves: the built-ins, or a user's ``--app module:attr``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from pipelines.errors import ConfigError
from pipelines.graph import Pipeline, Registry


def load_app(spec: str) -> list[Pipeline]:
    """The pipelines named by ``module:attr`` (a Pipeline, an iterable of them, or a
    function returning either).

    Raises:
        ConfigError: the module or attribute is missing or holds no pipelines.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app {spec!r} must look like 'module:attribute'")
    try:
        found: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--app {spec!r}: {exc}") from exc
    if callable(found) and not isinstance(found, Pipeline):
        found = found()
    pipelines = [found] if isinstance(found, Pipeline) else list(_iterable(found, spec))
    if not pipelines or not all(isinstance(p, Pipeline) for p in pipelines):
        raise ConfigError(f"--app {spec!r} must be a Pipeline or a list of Pipelines")
    return pipelines


def _iterable(value: Any, spec: str) -> Iterable[Any]:
    if isinstance(value, Iterable):
        return value
    raise ConfigError(f"--app {spec!r} is a {type(value).__name__}, not pipelines")


def load_registry(app: str | None, names: str | None) -> Registry:
    """The registry a process serves.

    Args:
        app: ``module:attr`` of the user's pipelines; None for the built-ins.
        names: comma-separated subset to serve; None for all of the app's pipelines (for
            the built-ins: the default set, which leaves out ``echo``).
    """
    from pipelines.builtin import DEFAULT_UP, builtin_pipelines

    loader: Callable[[], list[Pipeline]] = (lambda: load_app(app)) if app else builtin_pipelines
    registry = Registry(loader())
    chosen = [n.strip() for n in (names or "").split(",") if n.strip()]
    if not chosen:
        chosen = list(registry.pipelines) if app else list(DEFAULT_UP)
    return registry.select(chosen)
