"""A user's pipeline module, as ``conveyor up --app tests.support.userapp:pipelines`` loads it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pipelines.graph import End, Pipeline, function, model
from pipelines.stages import BUILTIN


class Words(BaseModel):
    """Some text."""

    text: str


def split(payload: dict[str, Any]) -> dict[str, Any]:
    """Split into words."""
    return {"words": payload["text"].split()}


async def count(payload: dict[str, Any]) -> dict[str, Any]:
    """Count the words (an async function step)."""
    return {"count": len(payload["words"])}


pipelines = [
    Pipeline(
        "wordcount",
        Words,
        (function("split", split, then="count"), function("count", count)),
        summary="Counts words.",
    )
]


class Review(BaseModel):
    """A review to read (the README's example pipeline)."""

    text: str


def verdict(output: dict[str, Any], ctx: dict[str, Any]) -> End | tuple[str, ...]:
    """Skip negative reviews; summarize and tag the rest in parallel."""
    return End({"skipped": True}) if output["label"] == "NEGATIVE" else ("summary", "people")


review = Pipeline(
    "review",
    Review,
    (
        model("mood", BUILTIN["sentiment"], route=verdict, routes_to=("summary", "people")),
        model("summary", BUILTIN["summarize"], input=lambda ctx: ctx["input"], then="report"),
        model("people", BUILTIN["ner"], input=lambda ctx: ctx["input"], then="report"),
        function(
            "report",
            lambda branches: {**branches["summary"], **branches["people"]},
            join=("summary", "people"),
        ),
    ),
)
