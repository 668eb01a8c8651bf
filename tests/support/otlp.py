"""A small OTLP/HTTP trace receiver on loopback: what a collector would receive.

It speaks the protocol the OpenTelemetry SDK's exporter speaks (``POST /v1/traces``, an
``ExportTraceServiceRequest`` in protobuf, gzip or not) and keeps every span it is sent,
decoded with the protocol's own generated classes (``opentelemetry-proto``).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    """One span as the receiver got it.

    Attributes:
        service: its resource's ``service.name``.
        name: the span's name.
        trace_id: 32 hex digits.
        span_id: 16 hex digits.
        parent_id: its parent's span id ("" for a root).
        start_ns: start, ns since the epoch.
        end_ns: end, ns since the epoch.
        attributes: its attributes (string, int, float or bool values).
        links: (trace id, span id) of each span it links to.
    """

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]

    @property
    def ms(self) -> float:
        """Its duration in milliseconds."""
        return (self.end_ns - self.start_ns) / 1e6


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class Receiver:
    """The spans received so far (thread-safe) and where to send them."""

    endpoint: str = ""
    spans: list[Received] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    """Held to read or add spans; notified when an export's spans are added."""

    def add(self, body: bytes) -> None:
        """Decode one export request and keep its spans."""
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received: list[Received] = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    span = Received(
                        service,
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                    )
                    received.append(span)
        with self.arrived:
            self.spans += received
            self.arrived.notify_all()

    def of_trace(self, trace_id: str) -> list[Received]:
        """The spans of one trace, by start time."""
        with self.arrived:
            return sorted(
                (s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns
            )

    def wait(self, done: Callable[[], bool], limit_s: float) -> bool:
        """Wait until ``done()`` holds, checked as each export arrives; whether it did
        within ``limit_s``."""
        with self.arrived:  # its lock is re-entrant: done() may read the spans
            return self.arrived.wait_for(done, timeout=limit_s)


@contextmanager
def receiver() -> Iterator[Receiver]:
    """A receiver listening on a free loopback port until the block ends."""
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            got.add(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            del format, args  # quiet: the test reads spans, not access lines

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    got.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()


def waterfall(spans: list[Received], root: Received, width: int = 48) -> str:
    """A text waterfall of one trace: each span's offset from ``root``, its duration and
    a bar on ``root``'s time line, nested spans indented under their parent."""
    by_parent: dict[str, list[Received]] = {}
    for s in spans:
        by_parent.setdefault(s.parent_id, []).append(s)
    scale = width / max(1, root.end_ns - root.start_ns)
    lines = [f"{'span':<26} {'service':<17} {'start ms':>8} {'ms':>7}  time line"]

    def add(s: Received, depth: int) -> None:
        begin = round((s.start_ns - root.start_ns) * scale)
        length = max(1, round((s.end_ns - s.start_ns) * scale))
        bar = " " * max(0, begin) + "#" * length
        offset = (s.start_ns - root.start_ns) / 1e6
        name = "  " * depth + s.name
        lines.append(f"{name:<26} {s.service:<17} {offset:>8.1f} {s.ms:>7.1f}  |{bar:<{width}}|")
        for kid in sorted(by_parent.get(s.span_id, []), key=lambda k: k.start_ns):
            add(kid, depth + 1)

    add(root, 0)
    return "\n".join(lines)
