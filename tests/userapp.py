"""A user's pipeline module, as ``conveyor up --app tests.userapp:pipelines`` loads it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pipelines.graph import Pipeline, function


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
