"""``GET /status``: a live page of every routed stage; ``GET /status.json``: what it polls.

The page shows per stage the lag (entries no worker has read yet) and pending entries,
in all and per priority lane, the
workers in the consumer group and how long each has been silent, the batch-size
distribution and padding efficiency, item outcomes, dead letters, queue wait and run time
percentiles over the last minute, and a throughput chart: the last minutes as the gateway
recorded them (:mod:`gateway.history`), then what the browser computes from the
cumulative item counters of successive snapshots. Everything it shows is derived from
``/metrics`` or ``conveyor status``: queue depths, counters and consumer names, never
settings or credentials.

The page is one self-contained HTML file (``status.html``, shipped as package data): no
external scripts, styles or fonts, so it works on a machine with no network.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping
from importlib.resources import files
from typing import TypedDict

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute
from redis.exceptions import ResponseError

from gateway.history import Latency
from gateway.service import Gateway
from pipelines.graph import Pipeline
from pipelines.keys import LANES
from pipelines.outcomes import Outcome
from runtime.metrics import BUCKETS, le_label
from runtime.redisio import REDIS_DOWN
from runtime.stats import CONTRACT, RESTARTS, read_stats
from runtime.status import ALIVE_STALE_MS, StageStatus, stage_status

PIPELINES_MARK = "<!--pipelines-->"


class ConsumerRow(TypedDict):
    """One worker in a stage's consumer group."""

    name: str
    pending: int
    idle_ms: int
    alive: bool


class LaneRow(TypedDict):
    """One priority lane of a stage: its :class:`~runtime.status.LaneStatus`."""

    lag: int
    pending: int


class BatchSizes(TypedDict):
    """Batch-size histogram: ``[le, count]`` per bucket, counts not cumulative."""

    buckets: list[tuple[str, int]]


class Tokens(TypedDict):
    """Estimated tokens of the items the stage's model ran (``real``) and what its
    batches padded them to (``padded``): ``real / padded`` is its padding efficiency."""

    real: int
    padded: int


class ParkedRow(TypedDict):
    """Why ``conveyor up`` parked a stage's workers and for how long more (seconds)."""

    reason: str
    left_s: float


class StageRow(TypedDict):
    """One stage's row of ``/status.json``: its :class:`~runtime.status.StageStatus`
    (the queue part) and its counters."""

    stage: str
    lag: int
    pending: int
    lanes: dict[str, LaneRow]
    consumers: list[ConsumerRow]
    parked: ParkedRow | None
    items: dict[str, int]
    dead_letters: int
    worker_restarts: int
    contract_errors: int
    batch_size: BatchSizes
    batches: int
    tokens: Tokens
    latency: Latency


def stage_row(
    status: StageStatus, stats: Mapping[str, float], dead_letters: int, latency: Latency
) -> StageRow:
    """The ``/status.json`` row of a stage.

    Args:
        status: the stage's state.
        stats: its stats hash (:func:`~runtime.stats.read_stats`).
        dead_letters: entries in its dead-letter stream.
        latency: its recent queue wait and run time (:meth:`History.latency`).
    """
    consumers: list[ConsumerRow] = [
        {"name": c.name, "pending": c.pending, "idle_ms": c.idle_ms, "alive": c.alive}
        for c in status.consumers
    ]
    bounds = (*BUCKETS["batch_size"], float("inf"))
    buckets = [(le_label(b), int(stats.get(f"h:batch_size:{le_label(b)}", 0))) for b in bounds]
    return {
        "stage": status.stage,
        "lag": status.lag,
        "pending": status.pending,
        "lanes": {
            lane: {"lag": part.lag, "pending": part.pending}
            for lane, part in ((lane, status.lane(lane)) for lane in LANES)
        },
        "consumers": consumers,
        "parked": None
        if status.parked is None
        else {
            "reason": status.parked.reason,
            "left_s": round(status.parked.left_s(time.time()), 1),
        },
        "items": {o.value: int(stats.get(o.stats_field, 0)) for o in Outcome},
        "dead_letters": dead_letters,
        "worker_restarts": int(stats.get(RESTARTS, 0)),
        "contract_errors": int(stats.get(CONTRACT, 0)),
        "batch_size": {"buckets": buckets},
        "batches": int(stats.get("batches", 0)),
        "tokens": {
            "real": int(stats.get("tokens", 0)),
            "padded": int(stats.get("padded_tokens", 0)),
        },
        "latency": latency,
    }


async def read_stage_row(gw: Gateway, stage: str) -> StageRow:
    """A stage's row, read from Redis.

    Args:
        gw: the gateway (its Redis client and key names).
        stage: the stage's name.

    Raises:
        redis.exceptions.ConnectionError: Redis cannot be reached (or any of ``REDIS_DOWN``).
    """
    status = await stage_status(gw.client, gw.keys, stage)
    stats = await read_stats(gw.client, gw.keys, stage)
    dead_letters = 0
    for part in gw.keys.each():
        dead_letters += int(await gw.client.xlen(part.dead_letters(stage)))
    return stage_row(status, stats, dead_letters, gw.history.latency(stage, stats))


def pipelines_html(pipelines: list[Pipeline], docs_url: str | None, ops: dict[str, str]) -> str:
    """The page's list of pipelines, each linked to its operation in the API docs.

    Args:
        pipelines: the routed pipelines.
        docs_url: where the API docs are served (None: docs disabled, no links).
        ops: pipeline name -> operation id of its ``POST`` route in the docs.
    """
    rows = []
    for p in pipelines:
        name = html.escape(p.name)
        op = ops.get(p.name)
        href = f"{docs_url}#/pipelines/{op}" if docs_url and op else None
        title = f'<a href="{html.escape(href)}">{name}</a>' if href else name
        steps = " \u2192 ".join(html.escape(s.name) for s in p.steps)
        summary = f" \u2014 {html.escape(p.summary)}" if p.summary else ""
        rows.append(
            f"<li>{title} <code>POST /v1/{name}</code>{summary}"
            f' <span class="muted">(steps: {steps})</span></li>'
        )
    if not rows:
        rows.append('<li class="muted">none</li>')
    if docs_url:
        rows.append(f'<li><a href="{html.escape(docs_url)}">all endpoints: API docs</a></li>')
    return "\n".join(rows)


class GatewayFigures(TypedDict):
    """This gateway's own figures in ``/status.json`` (cumulative: the page takes rates
    and percentiles over a window from successive snapshots)."""

    requests: dict[str, int]
    latency_bounds: list[float]
    latency_counts: list[int]
    redis_memory_bytes: int | None


def gateway_figures(gw: Gateway, redis_memory: int | None) -> GatewayFigures:
    """The requests this gateway answered on the API (``/v1/...``; not the page's own
    polls), by status class (``2xx``, ``4xx``, ``5xx``), and their end-to-end latency
    histogram (counts per bucket, not cumulative, the last past every bound).

    Args:
        gw: the gateway.
        redis_memory: Redis's ``used_memory`` (None: not readable, e.g. the ACL).
    """
    classes: dict[str, int] = {"2xx": 0, "4xx": 0, "5xx": 0}
    for (route, status), n in gw.metrics.counts.items():
        if route.startswith("/v1/"):
            key = f"{status // 100}xx"
            classes[key] = classes.get(key, 0) + n
    bounds = list(BUCKETS["run_seconds"])
    counts = [0] * (len(bounds) + 1)
    for route, hist in gw.metrics.latency.items():
        if route.startswith("/v1/"):
            counts = [a + int(b) for a, b in zip(counts, hist.counts, strict=True)]
    return {
        "requests": classes,
        "latency_bounds": bounds,
        "latency_counts": counts,
        "redis_memory_bytes": redis_memory,
    }


async def redis_memory(gw: Gateway) -> int | None:
    """Redis's ``used_memory`` in bytes, or None where it cannot be read (an ACL user
    without INFO, a cluster, a forged answer)."""
    try:
        info = await gw.client.info("memory")
    except (ResponseError, *REDIS_DOWN, AttributeError, TypeError):
        return None
    used = info.get("used_memory") if isinstance(info, dict) else None
    return used if isinstance(used, int) and 0 <= used < 1 << 50 else None


def _no_store(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    headers = {"Cache-Control": "no-store", **(headers or {})}
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def status_router(gw: Gateway) -> APIRouter:
    """Routes ``GET /status`` (the page) and ``GET /status.json`` (the snapshot).

    Args:
        gw: the gateway whose registry's stages are shown.
    """
    page = files("gateway").joinpath("status.html").read_text(encoding="utf-8")
    if PIPELINES_MARK not in page:
        raise RuntimeError(f"gateway/status.html lacks the {PIPELINES_MARK} placeholder")
    router = APIRouter(tags=["ops"])

    @router.get("/status.json")
    async def status_json() -> Response:
        """Every routed stage: lag, pending (in all, and per lane under ``lanes``),
        consumers, item outcomes, dead letters, batch sizes, tokens (real and padded),
        queue wait and run time percentiles over the last minute; ``history``: each
        stage's items/s over the last minutes; ``time`` is the server's clock in seconds
        (for rates); ``partitions``: how many each stage's stream is split into (every
        figure is their sum). 503 when Redis cannot be reached."""
        try:
            stages = [await read_stage_row(gw, name) for name in gw.registry.stages]
        except REDIS_DOWN:
            down = {"detail": "redis unreachable", "time": gw.clock.now()}
            return _no_store(down, 503, {"Retry-After": "1"})
        # The Redis clock, not this host's: rates stay right when successive polls are
        # answered by different gateways behind a load balancer.
        snapshot = {
            "time": gw.clock.now(),
            "stale_after_ms": ALIVE_STALE_MS,
            # Past this, a percentile only says "at least": the top histogram bound.
            "latency_top_s": {
                "queue_wait": BUCKETS["queue_wait_seconds"][-1],
                "run": BUCKETS["run_seconds"][-1],
            },
            "gateway": gateway_figures(gw, await redis_memory(gw)),
            "partitions": gw.keys.partitions,
            "stages": stages,
            "history": gw.history.rates(),
        }
        return _no_store(snapshot)

    @router.get("/status", response_class=HTMLResponse)
    async def status_page(request: Request) -> HTMLResponse:
        """A live page of every routed stage (polls ``/status.json``)."""
        ops = {
            route.name.removeprefix("post_"): route.unique_id
            for route in request.app.routes
            if isinstance(route, APIRoute) and route.name.startswith("post_")
        }
        docs_url = getattr(request.app.state, "docs_url", None)
        listed = pipelines_html(list(gw.registry.pipelines.values()), docs_url, ops)
        return HTMLResponse(page.replace(PIPELINES_MARK, listed))

    return router
