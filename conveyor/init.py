"""``conveyor init [FOLDER]``: a working app folder to start from.

It writes a module (:data:`MODULE`, ``app.py``) holding a model class with a batched
``predict``, a function step and the pipeline of the two, a README saying what to run next,
and the ``.gitignore`` and ``.dockerignore`` that keep ``up``'s data folder (``.conveyor/``:
request payloads and results), ``.env`` files (secrets) and virtualenvs out of git and out of
an image's build context. ``conveyor up --app app:pipeline`` run in the folder serves it as
written. A file that exists already is never overwritten unless ``--force`` says so: nothing
is written then, and one line names the files.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.errors import ConfigError

__all__ = ["APP", "FILES", "MODULE", "init", "next_steps"]

MODULE = "app"
"""The module it writes (``app.py``)."""

APP = f"{MODULE}:pipeline"
"""What ``--app`` names to serve it."""

_APP_PY = '''"""A conveyor app: a model stage, then a function step.

Serve it from this folder: conveyor up --app app:pipeline --reload
(--reload restarts what runs the code you change; see README.md).
"""

from pydantic import BaseModel

from conveyor import Pipeline, Stage, function, model


class Review(BaseModel):
    """One request's input: POST /v1/review {"text": "..."}."""

    text: str


class Scorer:
    """The model: built once per worker, then given batches.

    Load weights in __init__; it may take any of model, device (resolved: "cpu",
    "cuda:0"), dtype and cache_dir, and is given only those it names.
    """

    def predict(self, items: list[dict]) -> list[dict]:
        """One batch: a list of inputs in, one result per input out, in order."""
        return [{"text": item["text"], "words": len(item["text"].split())} for item in items]


scorer = Stage("score", Review, runner="app:Scorer", max_batch_size=32, batch_wait_ms=5)


def verdict(scored: dict) -> dict:
    """A plain Python step on the model's output (sync or async)."""
    return {**scored, "long": scored["words"] > 20}


pipeline = Pipeline(
    "review",
    Review,
    (
        model("score", scorer, then="verdict"),
        function("verdict", verdict),
    ),
)
'''

_README = f"""# A conveyor app

`app.py` holds the pipeline `review`: the model stage `score` (the class `Scorer`, given
batches), then the function step `verdict`.

Next steps, in this folder:

```bash
conveyor up --app {APP} --reload
curl -s localhost:8000/v1/review -H 'content-type: application/json' -d '{{"text": "hello there"}}'
```

`--reload` restarts the workers whose code you change (and the gateway when a route
changes); a module that does not compile is one line, and the running ones go on. Put
your weights' loading in `Scorer.__init__` and your model call in `Scorer.predict`.
`conveyor deploy` writes the files that run it elsewhere.
"""

_IGNORED = """# conveyor up's data folder: the embedded Redis's requests and results
.conveyor/
# secrets
.env
.env.*
!.env.example
# virtualenvs and caches
.venv/
venv/
env/
__pycache__/
*.pyc
.mypy_cache/
.pytest_cache/
.ruff_cache/
"""

FILES = {
    f"{MODULE}.py": _APP_PY,
    "README.md": _README,
    ".gitignore": _IGNORED,
    ".dockerignore": _IGNORED + ".git/\n",
}
"""What it writes, by file name."""


def init(folder: Path, *, force: bool = False) -> list[Path]:
    """Write the app folder :data:`FILES` into ``folder`` (made if missing).

    Args:
        folder: where.
        force: overwrite files that exist.

    Returns:
        The files written.

    Raises:
        ConfigError: a file exists and ``force`` is off (nothing is written), or ``folder``
            is not a folder.
    """
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} exists and is not a folder")
    paths = [folder / name for name in FILES]
    there = [p.name for p in paths if p.exists()]
    if there and not force:
        raise ConfigError(
            f"{folder} already has {', '.join(there)}; nothing written "
            "(conveyor init --force overwrites them)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for path in paths:
        path.write_text(FILES[path.name])
    return paths


def next_steps(folder: Path) -> str:
    """The lines ``conveyor init`` prints once it wrote ``folder``."""
    where = "" if folder.resolve() == Path.cwd().resolve() else f"cd {folder} && "
    return (
        f"wrote {', '.join(FILES)} in {folder}\n"
        f"next: {where}conveyor up --app {APP} --reload   (then POST /v1/review "
        '{"text": "hello there"}; README.md says more)'
    )
