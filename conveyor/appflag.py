"""How every ``conveyor`` command names the user's app: ``--app module:attribute``, else
``CONVEYOR_APP``, else the built-in pipelines.

A command that serves, inspects or describes pipelines takes the flag with
:func:`add_app_argument` and calls :func:`use_app` before it loads anything. The flag then
reaches whatever reads the settings, in this process (``worker`` and ``gateway`` run
theirs here) and in every child it starts, as ``CONVEYOR_APP``; and the module is
imported the one way :func:`pipelines.registry.load_app` imports it, from the current
folder first. So ``conveyor up --app mymodule:pipeline``, ``conveyor worker STAGE --app
mymodule:pipeline`` and ``conveyor status --app mymodule:pipeline``, run in the folder of
``mymodule.py``, all serve or show the same pipelines.
"""

from __future__ import annotations

import argparse
import os

from pipelines.errors import ConfigError

__all__ = ["APP_VARIABLE", "add_app_argument", "use_app"]

APP_VARIABLE = "CONVEYOR_APP"
"""The variable that names the app when the flag does not (every process's settings read
it: :attr:`pipelines.settings.CommonSettings.app`)."""

APP_HELP = (
    "module:attribute of your app: a Pipeline, a Stage, a list of them, or a function "
    "returning one; imported from the current folder first (default: CONVEYOR_APP, "
    "else the built-in pipelines)"
)


def add_app_argument(parser: argparse.ArgumentParser) -> None:
    """Give a subcommand the ``--app`` flag, with the same help everywhere.

    Args:
        parser: the subcommand's parser; its parsed ``args.app`` goes to :func:`use_app`.
    """
    parser.add_argument("--app", metavar="MODULE:ATTR", help=APP_HELP)


def use_app(flag: str | None) -> str | None:
    """The app this command serves: ``--app`` if given, else ``CONVEYOR_APP``, else None
    (the built-ins). A given flag is set as ``CONVEYOR_APP`` for this process's settings
    and every process it starts.

    Args:
        flag: the parsed ``--app`` (None: not given).

    Raises:
        ConfigError: one line naming the flag or the variable, for a value that is not
            ``module:attribute``.
    """
    if flag is not None:
        _check(flag, f"--app {flag!r}")
        os.environ[APP_VARIABLE] = flag
        return flag
    value = os.environ.get(APP_VARIABLE) or None
    if value is not None:
        _check(value, f"{APP_VARIABLE}={value!r}")
    return value


def _check(spec: str, named: str) -> None:
    module, _, attr = spec.partition(":")
    if not module.strip() or not attr.strip():
        raise ConfigError(
            f"{named} must look like 'module:attribute' (e.g. mymodule:pipeline, "
            "with mymodule.py in the current folder)"
        )
