"""``python -m gateway``: serve the HTTP gateway (:mod:`gateway.serve`).

What the gateway runs on (uvicorn, FastAPI, redis-py, pydantic...) is imported only once
this module runs, so a process that cannot import it ends with one line and exit status
2, as a bad setting does, not with a traceback that ``conveyor up`` would restart into
a crash loop: a missing package, or a user module in the folder on its import path
named like one of them (``uvicorn.py``).
"""

from __future__ import annotations

from pipelines.errors import ConfigError, one_line
from pipelines.registry import check_app_dir
from runtime.exits import exit_on_config_error


def main() -> None:
    """Import the gateway and serve it (:func:`gateway.serve.main`)."""
    with exit_on_config_error():
        try:
            from gateway.serve import main as serve
        except Exception as exc:
            check_app_dir()  # a module of the user's hiding one: named, with what to do
            if not isinstance(exc, ImportError):
                raise  # nothing hides one: a bug, or the machine (a traceback, restarted)
            raise ConfigError(
                f"the gateway cannot import what it runs on: {one_line(exc)}; "
                "install conveyor's dependencies where it runs"
            ) from exc
    serve()


if __name__ == "__main__":
    main()
