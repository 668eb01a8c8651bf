"""The built-in pipelines: one per model stage, and the composed examples.

- ``embed``, ``sentiment``, ``ner``, ``summarize``, ``generate``, ``echo``: one model each.
- ``chain``: ``{"value": 5}`` → adder (+1) → multiplier (*2) → ``{"value": 12}``.
- ``broadcast``: one input to adder and multiplier at once; the answer lists both.
- ``hello``: spanish → "Hola {name}", french → "Bonjour {name}", else "Please try again.".
- ``wiki-summary``: see :mod:`pipelines.builtin.wikisummary`.

The adder and multiplier are model stages (batched, shared by ``chain`` and
``broadcast``: one stream, one worker pool) with plain-Python models.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipelines.builtin.wikisummary import wiki_summary
from pipelines.graph import Context, End, Pipeline, function, model, single
from pipelines.stages import BUILTIN, Stage


class ValueIn(BaseModel):
    """A number to work on."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # Bounded so that what the stages make of it (doubled) stays a finite JSON number.
    value: float = Field(ge=-1e300, le=1e300, description="The number.", examples=[5])


class ValueOut(BaseModel):
    """The number worked on."""

    value: float = Field(examples=[12])


class BothOut(BaseModel):
    """What each branch made of the number: the sum's, then the product's."""

    results: list[ValueOut] = Field(examples=[[{"value": 6}, {"value": 10}]])


class MessageOut(BaseModel):
    """A greeting, or what to do instead."""

    message: str = Field(examples=["Hola Ada"])


class HelloIn(BaseModel):
    """Who to greet, and in which language."""

    model_config = ConfigDict(extra="forbid", strict=True)
    language: str = Field(min_length=1, max_length=40, examples=["spanish"])
    name: str = Field(min_length=1, max_length=200, examples=["Ada"])


ADDER = Stage("adder", ValueIn, "workers.models.toy:Adder", summary="Adds one.", batch_wait_ms=2)
MULTIPLIER = Stage(
    "multiplier", ValueIn, "workers.models.toy:Multiplier", summary="Doubles.", batch_wait_ms=2
)


def _forward(payload: dict[str, Any]) -> dict[str, Any]:
    """Pass the request on unchanged."""
    return payload


def _collect(branches: dict[str, Any]) -> dict[str, Any]:
    """List the branch outputs in branch order."""
    return {"results": [branches["add"], branches["multiply"]]}


def _language(payload: dict[str, Any]) -> dict[str, Any]:
    """Normalise the language name."""
    return {"language": payload["language"].strip().lower(), "name": payload["name"]}


def _pick_language(output: dict[str, Any], ctx: Context) -> str | End:
    if output["language"] in ("spanish", "french"):
        return str(output["language"])
    return End({"message": "Please try again."})


def _spanish(payload: dict[str, Any]) -> dict[str, Any]:
    """Greet in Spanish."""
    return {"message": f"Hola {payload['name']}"}


def _french(payload: dict[str, Any]) -> dict[str, Any]:
    """Greet in French."""
    return {"message": f"Bonjour {payload['name']}"}


def builtin_pipelines() -> list[Pipeline]:
    """Every built-in pipeline."""
    return [
        *(single(stage) for stage in BUILTIN.values()),
        Pipeline(
            "chain",
            ValueIn,
            (model("add", ADDER, then="multiply"), model("multiply", MULTIPLIER)),
            summary="Adds one, then doubles.",
            output_model=ValueOut,
        ),
        Pipeline(
            "broadcast",
            ValueIn,
            (
                function("start", _forward, then=("add", "multiply")),
                model("add", ADDER, then="collect"),
                model("multiply", MULTIPLIER, then="collect"),
                function("collect", _collect, join=("add", "multiply")),
            ),
            summary="Adds one and doubles, in parallel; lists both.",
            output_model=BothOut,
        ),
        Pipeline(
            "hello",
            HelloIn,
            (
                function(
                    "detect", _language, route=_pick_language, routes_to=("spanish", "french")
                ),
                function("spanish", _spanish),
                function("french", _french),
            ),
            summary="Greets in Spanish or French.",
            output_model=MessageOut,
        ),
        wiki_summary(),
    ]


DEFAULT_UP = (
    "embed",
    "sentiment",
    "ner",
    "summarize",
    "generate",
    "chain",
    "broadcast",
    "hello",
    "wiki-summary",
)
"""What ``conveyor up`` serves without ``--pipelines``: every built-in but ``echo``."""
