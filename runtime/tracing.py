"""OpenTelemetry tracing: off unless configured, one trace per request across every process.

It is configured as the OpenTelemetry SDK defines (``OTEL_*`` environment variables): it
is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, or ``console`` to print
spans), or, with that unset, when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` turns it off. The
exporter is the SDK's OTLP/HTTP one, batched (``OTEL_BSP_*``), sampled as
``OTEL_TRACES_SAMPLER`` says; ``OTEL_SERVICE_NAME`` names the process (default:
``conveyor-gateway`` or ``conveyor-worker``). Off, nothing here runs: every caller checks
:data:`STATE.enabled` first, so a request pays one attribute read.

A request's trace starts at the gateway (a W3C ``traceparent`` header continues the
client's), whose server span (FastAPI's own, see :mod:`gateway.traces`) is the request's
root. Its context travels in the envelope (``Request.traceparent``), unchanged through
every step of a pipeline, so every process that touches the request adds spans under that
root: the gateway its admission, enqueue and reply, each stage its ``queue`` (the wait in
the stream), ``batch`` (linked to the span of the batch the request joined), ``run`` (the
model) and ``publish`` (:mod:`workers.spans`). The spans conveyor makes are timed on the
Redis clock (:class:`~runtime.redisio.RedisClock`), the clock the stream ids are on, so
the spans of one trace line up whichever machine made them (a stream id has millisecond
resolution: a ``queue`` span may start up to 1 ms early).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
"""The W3C Trace Context header (and the envelope field carrying the same value)."""

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass
class _State:
    enabled: bool = False
    tracer: Tracer | None = None


STATE = _State()
"""Whether tracing is on in this process, and its tracer (set by :func:`configure`)."""


def wanted(env: Mapping[str, str] = os.environ) -> str | None:
    """The exporter ``env`` asks for (``otlp`` or ``console``), or None: tracing off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        chosen = exporter.split(",")[0].strip()
        return chosen if chosen in ("otlp", "console") else None
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return "otlp" if any(env.get(name) for name in endpoints) else None


def configure(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on in this process if ``env`` configures it (see the module); returns
    whether it is on. Called once by each entry point (gateway, worker).

    Args:
        service: the default ``service.name`` (``OTEL_SERVICE_NAME`` wins).
        env: the environment to read.
    """
    exporter_name = wanted(env)
    if exporter_name is None:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    name = env.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    STATE.tracer = trace.get_tracer("conveyor")
    STATE.enabled = True
    logger.info("tracing on: %s exporter, service %s", exporter_name, name)
    return True


def shutdown() -> None:
    """Flush and stop the exporter (at the process's end; spans still batched go out)."""
    provider = trace.get_tracer_provider()
    stop = getattr(provider, "shutdown", None)
    if STATE.enabled and callable(stop):
        stop()


def ns(seconds: float) -> int:
    """``seconds`` since the epoch as a span timestamp (nanoseconds)."""
    return int(seconds * 1e9)


def parent(traceparent: str | None) -> Context | None:
    """The context a ``traceparent`` value names; None when there is none, it is not
    valid, or its trace is not sampled (its spans would not be recorded anyway)."""
    if not traceparent:
        return None
    context = _PROPAGATOR.extract({TRACEPARENT: traceparent})
    named = trace.get_current_span(context).get_span_context()
    return context if named.is_valid and named.trace_flags.sampled else None


def traceparent_of(span: Span) -> str:
    """The W3C ``traceparent`` value naming ``span``."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=under_span(span))
    return carrier[TRACEPARENT]


def trace_id_of(span: Span) -> str:
    """``span``'s trace id as 32 hex digits (what log lines and ``X-Trace-Id`` carry)."""
    return format(span.get_span_context().trace_id, "032x")


def tracer() -> Tracer:
    """This process's tracer (only once :func:`configure` turned tracing on)."""
    assert STATE.tracer is not None, "tracing is off"
    return STATE.tracer


def span(
    name: str,
    under: Context | None,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[Link] = (),
) -> Span:
    """Record a finished span from ``start_s`` to ``end_s`` (Redis clock) under ``under``."""
    made = tracer().start_span(
        name, context=under, start_time=ns(start_s), attributes=attributes, links=links
    )
    made.end(end_time=ns(max(start_s, end_s)))
    return made


def under_span(made: Span) -> Context:
    """A context whose current span is ``made`` (for spans nested under it)."""
    return trace.set_span_in_context(made)


def link(to: Span, **attributes: Any) -> Link:
    """A link to ``to`` (a request's span to the span of the batch it ran in)."""
    return Link(to.get_span_context(), attributes)
