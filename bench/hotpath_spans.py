"""bench.hotpath's traced interval: the spans conveyor exports, received over OTLP/HTTP, and
one request's time cut at their edges and at the times Redis ran its commands."""

from __future__ import annotations

import gzip
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from bench.hotpath_watch import LUA, Event
from bench.systems import HOST


class Span(NamedTuple):
    """One received span, times in seconds since the epoch."""

    service: str
    name: str
    trace_id: str
    parent_id: str
    start: float
    end: float
    attributes: dict[str, Any]


@contextmanager
def receiver(keep: bool = True) -> Iterator[tuple[str, list[bytes]]]:
    """An OTLP/HTTP trace endpoint on loopback and the export requests it has received,
    kept as sent: :func:`decode` reads them afterwards, off the measured path (``keep``
    false: read and dropped, as ``bench.tracing`` wants)."""
    got: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            gzipped = self.headers.get("Content-Encoding") == "gzip"
            if keep:
                got.append(gzip.decompress(body) if gzipped else body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            del format, args

    server = ThreadingHTTPServer((HOST, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


def decode(exports: Iterable[bytes]) -> list[Span]:
    """The spans of OTLP/HTTP export requests (``ExportTraceServiceRequest``)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return getattr(v, kind) if kind else None

    out = []
    for body in exports:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for rs in request.resource_spans:
            service = {a.key: value(a.value) for a in rs.resource.attributes}["service.name"]
            out += [
                Span(
                    *(str(service), s.name, s.trace_id.hex(), s.parent_span_id.hex()),
                    *(s.start_time_unix_nano / 1e9, s.end_time_unix_nano / 1e9),
                    {a.key: value(a.value) for a in s.attributes},
                )
                for scope in rs.scope_spans
                for s in scope.spans
            ]
    return out


STEPS = (
    ("parse", "HTTP request read, headers and body validated: root span start → admission"),
    ("admission", "the `admission` span"),
    ("enqueue", "admitted → its XADD runs in Redis"),
    (
        "wait for the worker's read, and the window",
        "XADD → the batch closed (`batch` span's start); at one client the adaptive window "
        "closes on the read that brought the entry",
    ),
    ("claim and cancel check", "closed → its cancel check (with the claim) runs in Redis"),
    ("to the model", "check → the model starts (its answer read, the hand-off to the thread)"),
    ("model", "the `run` span"),
    ("publish", "model done → the batch's EVALSHA runs in Redis"),
    ("reply read", "EVALSHA → the handler has the reply (`reply` span's end)"),
    ("answer", "the response written: `reply` end → root span end"),
)
"""The pieces a traced request's time is cut into, each with its two edges."""


def server_times(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    """Per request id, when Redis first ran its XADD to a stage (``xadd``), its batch's
    cancel check (``check``: the worker asks before the model runs) and its batch's
    script call (``script``)."""
    out: dict[str, dict[str, float]] = {"xadd": {}, "check": {}, "script": {}}
    for e in events:
        if e.client == LUA or (e.command == "xadd" and ":stage:" not in e.key):
            continue  # a script's, or a reply
        which = {"xadd": "xadd", "evalsha": "script", "eval": "script"}.get(e.command, "check")
        for rid in e.ids:
            out[which].setdefault(rid, e.at)
    return out


def breakdown(
    spans: Iterable[Span], stage: str, times: Mapping[str, Mapping[str, float]]
) -> dict[str, list[float]]:
    """Each :data:`STEPS` piece of every complete traced request, in ms, from its gateway
    spans (root, ``admission``, ``reply``), its stage's ``batch`` and ``run`` spans and its
    :func:`server_times`; and ``total``, its root span. A request missing any is left out."""
    traces: dict[str, dict[str, Span]] = defaultdict(dict)
    for s in spans:
        name = "root" if s.service.endswith("gateway") and not s.parent_id else s.name
        if name == f"{stage} batch" and "conveyor.request_id" not in s.attributes:
            continue  # the batch's own span, in a trace of its own
        traces[s.trace_id][name] = s
    out: dict[str, list[float]] = {name: [] for name, _ in STEPS}
    out["total"] = []
    for t in traces.values():
        try:
            root, admission, reply = t["root"], t["admission"], t["reply"]
            batch, run = t[f"{stage} batch"], t[f"{stage} run"]
            rid = str(batch.attributes["conveyor.request_id"])
            edges = [root.start, admission.start, admission.end, times["xadd"][rid]]
            edges += [batch.start, times["check"][rid], run.start, run.end]
            edges += [times["script"][rid], reply.end, root.end]
        except KeyError:
            continue
        for (name, _), begin, end in zip(STEPS, edges, edges[1:], strict=False):
            out[name].append(1000 * (end - begin))
        out["total"].append(1000 * (root.end - root.start))
    return out
