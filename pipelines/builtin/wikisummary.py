"""The Wikipedia summarizer, the reference pipeline.

``{"search_term"}`` → fetch the first matching article → sentiment → NEGATIVE ends the
request with ``{"rejected": true, ...}``; otherwise summarize and ner run in parallel
and a join combines them: ``{"title", "url", "summary", "entities", "sentiment"}``.

Articles are cut to ``max_chars`` when fetched, and each model gets the head of the text
that fits its limit (the tokenizers truncate further to the model's token limit).
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.graph import Context, End, Pipeline, function, model
from pipelines.settings import load_settings
from pipelines.stages import BUILTIN

SENTIMENT_CHARS = 2_000
"""Sentiment reads the article's opening: enough for its 512-token limit."""
SUMMARY_CHARS = 20_000
"""The summarizer ranks the sentences of about the first 20k characters."""
NER_CHARS = 2_000
"""NER tags the opening (512 tokens)."""


class WikiIn(BaseModel):
    """What to look up."""

    model_config = ConfigDict(extra="forbid", strict=True)
    search_term: str = Field(min_length=1, max_length=300, examples=["Alan Turing"])


class WikiSettings(BaseSettings):
    """The fetch step's settings, read from ``CONVEYOR_WIKIPEDIA_*`` by the worker running it.

    They belong to this step, not to a process: the gateway and the other workers never
    read them.

    Attributes:
        api_url: MediaWiki API the fetch calls (unset: Wikipedia's own).
        timeout_s: the fetch gives up after this long (the ``wikipedia`` client has none).
        max_chars: longer articles are cut (at a sentence) to this length.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_WIKIPEDIA_", extra="ignore")

    api_url: str | None = None
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    max_chars: int = Field(default=100_000, ge=100)


def fetch(payload: dict[str, Any]) -> dict[str, Any]:
    """Fetch the first Wikipedia article matching the search term."""
    # Imported here: the wikipedia client (and requests, bs4) loads only in the worker that
    # runs this step, never in the gateway or the model workers that import the pipeline.
    from pipelines.builtin.wiki import fetch_article

    # Read per call (cheap next to a fetch), so tests can repoint it.
    settings = load_settings(WikiSettings)
    article = fetch_article(
        payload["search_term"],
        api_url=settings.api_url,
        timeout_s=settings.timeout_s,
        max_chars=settings.max_chars,
    )
    return article.to_dict()


def _fetch_ready() -> None:
    """Run once where the fetch step is served, at start: a bad ``CONVEYOR_WIKIPEDIA_*``
    value stops that worker naming it, and the client is loaded before the first request."""
    load_settings(WikiSettings)
    importlib.import_module("pipelines.builtin.wiki")


def _head(ctx: Context, chars: int) -> dict[str, Any]:
    return {"text": ctx["fetch"]["text"][:chars] or ctx["fetch"]["title"]}


def _judge(output: dict[str, Any], ctx: Context) -> tuple[str, ...] | End:
    if output["label"] == "NEGATIVE":
        article = ctx["fetch"]
        return End(
            {
                "rejected": True,
                "reason": f"negative sentiment (score {output['score']:.2f})",
                "title": article["title"],
                "url": article["url"],
                "sentiment": output,
            }
        )
    return ("summarize", "ner")


def _combine_input(ctx: Context) -> dict[str, Any]:
    article = ctx["fetch"]
    return {
        "title": article["title"],
        "url": article["url"],
        "summary": ctx["summarize"]["summary"],
        "entities": ctx["ner"]["entities"],
        "sentiment": ctx["sentiment"],
    }


def combine(payload: dict[str, Any]) -> dict[str, Any]:
    """Combine the summary and the entities into the response."""
    return payload


def wiki_summary() -> Pipeline:
    """The ``wiki-summary`` pipeline."""
    return Pipeline(
        "wiki-summary",
        WikiIn,
        (
            function("fetch", fetch, then="sentiment", concurrency=16, setup=_fetch_ready),
            model(
                "sentiment",
                BUILTIN["sentiment"],
                input=lambda ctx: _head(ctx, SENTIMENT_CHARS),
                route=_judge,
                routes_to=("summarize", "ner"),
            ),
            model(
                "summarize",
                BUILTIN["summarize"],
                input=lambda ctx: _head(ctx, SUMMARY_CHARS),
                then="combine",
            ),
            model("ner", BUILTIN["ner"], input=lambda ctx: _head(ctx, NER_CHARS), then="combine"),
            function("combine", combine, input=_combine_input, join=("summarize", "ner")),
        ),
        summary="Summary and entities of the Wikipedia article for a search term.",
    )
