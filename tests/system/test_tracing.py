"""OpenTelemetry: one connected trace per request across the gateway and every stage.

Real processes (``python -m gateway``, ``python -m workers`` serving the three steps of
tests/support/faultapp.py's ``chain3``) export over OTLP/HTTP, as the SDK does, to a receiver on
loopback (tests/support/otlp.py).
"""

from __future__ import annotations

import itertools
import secrets
from pathlib import Path

import httpx

from runtime.tracing import wanted
from tests.helpers import REPO, GatewayProcess
from tests.support.faultapp import spawn
from tests.support.otlp import Received, Receiver, receiver, waterfall

ARTIFACTS = REPO / "test-artifacts"
STEPS = ("chain3.a", "chain3.b", "chain3.c")
PER_STAGE = ("queue", "batch", "run", "publish")
GATEWAY = ("admission", "enqueue", "reply")


def test_tracing_is_off_unless_the_environment_configures_it() -> None:
    assert wanted({}) is None
    assert wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == "otlp"
    assert wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == "otlp"
    assert wanted({"OTEL_TRACES_EXPORTER": "console"}) == "console"
    assert wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}) is None
    assert wanted({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}) is None


def wait_for_spans(
    got: Receiver, trace_id: str, names: set[str], limit_s: float = 30
) -> list[Received]:
    """The trace's spans once they include every one of ``names``."""

    def arrived() -> bool:
        return names <= {s.name for s in got.of_trace(trace_id)}

    received = got.wait(arrived, limit_s)
    assert received, sorted(s.name for s in got.of_trace(trace_id))
    return got.of_trace(trace_id)


def test_a_three_step_request_is_one_connected_trace_whose_spans_add_up(
    redis_url: str, tmp_path: Path
) -> None:
    with receiver() as got:
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": got.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        app = {"CONVEYOR_APP": "tests.support.faultapp:pipelines", "CONVEYOR_PIPELINES": "chain3"}
        log = tmp_path / "gateway.log"
        with GatewayProcess(redis_url, log, **app, **otel) as gateway:
            ns = gateway.env["CONVEYOR_NAMESPACE"]
            worker_log = tmp_path / "worker.log"
            worker = spawn(
                "workers",
                ",".join(STEPS),
                log=worker_log,
                CONVEYOR_REDIS_URL=redis_url,
                CONVEYOR_NAMESPACE=ns,
                CONVEYOR_PIPELINES="chain3",
                CONVEYOR_TEST_STEP_S="0.05",
                CONVEYOR_LOG_LEVEL="DEBUG",  # the batch lines, with their trace ids
                **otel,
            )
            try:
                # Once untraced, so the traced request finds the worker reading.
                warm = httpx.post(f"{gateway.base}/v1/chain3", json={"value": 1}, timeout=60)
                assert warm.status_code == 200, warm.text
                client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
                traceparent = f"00-{client_trace}-{client_span}-01"
                resp = httpx.post(
                    f"{gateway.base}/v1/chain3",
                    json={"value": 7},
                    headers={"traceparent": traceparent},
                    timeout=60,
                )
                assert resp.status_code == 200, resp.text
                assert resp.json() == {"value": 7}
                # The answer names the gateway's span in the client's trace.
                _, trace_id, root_id, _ = resp.headers["traceparent"].split("-")
                assert trace_id == client_trace
                # A malformed traceparent is ignored: the request is served in a new trace.
                for bad in ("garbage", f"00-{'0' * 32}-{client_span}-01", "00-" + "z" * 52):
                    other = httpx.post(
                        f"{gateway.base}/v1/chain3",
                        json={"value": 1},
                        headers={"traceparent": bad},
                        timeout=60,
                    )
                    assert other.status_code == 200, (bad, other.text)
                    fresh = other.headers["traceparent"].split("-")[1]
                    assert fresh not in (client_trace, "0" * 32), bad
                wanted_names = {f"{s} {p}" for s in STEPS for p in PER_STAGE} | set(GATEWAY)
                spans = wait_for_spans(got, trace_id, wanted_names)
                gateway_log, worker_text = gateway.log(), worker_log.read_text()
            finally:
                worker.terminate()
                worker.wait(timeout=20)
        batches = {s.span_id: s for s in got.spans if s.trace_id != trace_id}

    by_id = {s.span_id: s for s in spans}
    root = by_id[root_id]
    assert root.parent_id == client_span  # continues the client's trace
    assert root.service == "conveyor-gateway"
    assert root.name == "POST /v1/chain3"
    assert root.attributes["http.route"] == "/v1/chain3"
    # Connected: every span hangs off the root, but each model run, under its batch span.
    for s in spans:
        if s is root:
            continue
        if s.name.endswith(" run"):
            assert by_id[s.parent_id].name == s.name.replace(" run", " batch"), s
        else:
            assert s.parent_id == root_id or by_id[s.parent_id].parent_id == root_id, s
    services = {s.name: s.service for s in spans}
    assert services["admission"] == services["reply"] == "conveyor-gateway"
    assert services["chain3.b run"] == "conveyor-worker"
    # Each request's batch span links to the span of the batch it ran in, with its size.
    for step in STEPS:
        (joined,) = [s for s in spans if s.name == f"{step} batch"]
        assert joined.attributes["conveyor.batch.size"] == 1
        ((linked_trace, linked_span),) = joined.links
        assert batches[linked_span].name == f"{step} batch"
        assert batches[linked_span].attributes["conveyor.batch.size"] == 1
        assert batches[linked_span].trace_id == linked_trace
    # The spans tile the request's time: in order, and adding up to the root's duration.
    tiles = {s.name: s for s in spans if s.parent_id == root_id}
    expected = ["admission", "enqueue"]
    for step in STEPS:
        expected += [f"{step} queue", f"{step} batch", f"{step} publish"]
    expected.append("reply")
    for before, after in itertools.pairwise(expected):
        # In order; a stream entry's time (its id) has millisecond resolution.
        assert tiles[after].start_ns >= tiles[before].start_ns - 1_000_000, (before, after)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "trace.txt").write_text(waterfall(spans, root) + "\n")
    # Covered: no time of the root's is unaccounted. Tiles may overlap where one side waits
    # on the other (the gateway's enqueue returns after the worker has read the entry; a
    # publish ends after the next stage's entry is written, the last one even after the
    # answer), and more so under load, so what is checked is the time that no tile covers,
    # not the sum of their lengths.
    covered, reach = 0, root.start_ns
    for tile in sorted((tiles[name] for name in expected), key=lambda s: s.start_ns):
        assert tile.start_ns >= root.start_ns - 1_000_000, tile.name  # ids: ms resolution
        start, end = max(tile.start_ns, reach), min(tile.end_ns, root.end_ns)
        covered += max(0, end - start)
        reach = max(reach, end)
    gaps_ms = root.ms - covered / 1e6
    assert gaps_ms <= max(0.15 * root.ms, 15), (gaps_ms, root.ms)
    (run_b,) = [s for s in spans if s.name == "chain3.b run"]
    assert run_b.ms >= 50  # the step's own 50 ms
    # Both sides' log lines carry the trace id.
    assert f"trace={trace_id}" in gateway_log
    assert trace_id in worker_text
