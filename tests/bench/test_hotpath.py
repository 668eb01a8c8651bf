"""bench.hotpath's reading of MONITOR, /proc and spans, and how it adds them up (no load)."""

from __future__ import annotations

from collections import Counter

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.capacity import Calls, top_level_usec
from bench.hotpath import (
    LUA,
    STEPS,
    TITLE,
    Event,
    Span,
    breakdown,
    decode,
    parse_line,
    place_section,
    round_trips,
    server_times,
    shape,
    socket_ports,
    tally,
)

RID = "f258d2a608854ad29728c823cc81ca41"
XADD = (
    b'+1795875897.071058 [0 127.0.0.1:47598] "XADD" "{conveyor}:stage:echo" "*" "e" '
    b'"{\\"v\\":1,\\"id\\":\\"' + RID.encode() + b'\\",\\"pipeline\\":\\"echo\\"}"'
)


def test_monitor_lines_give_time_client_command_key_and_request_ids() -> None:
    assert parse_line(XADD) == Event(
        1795875897.071058, "127.0.0.1:47598", "xadd", "{conveyor}:stage:echo", (RID,)
    )
    script = (
        b'+1795875897.078260 [0 127.0.0.1:47586] "EVALSHA" "7347" "3" '
        b'"{conveyor}:cancelled:a1" "{conveyor}:done:a1:echo" "{conveyor}:done:b2:echo"'
    )
    assert parse_line(script) == Event(
        1795875897.07826, "127.0.0.1:47586", "evalsha", "7347", ("a1", "b2")
    )
    check = b'+1.5 [0 127.0.0.1:9] "MGET" "{conveyor}:cancelled:a1" "{conveyor}:cancelled:b2"'
    assert parse_line(check) == Event(
        1.5, "127.0.0.1:9", "mget", "{conveyor}:cancelled:a1", ("a1", "b2")
    )
    assert parse_line(b'+2.0 [0 lua] "HINCRBY" "{c}:stats:echo" "batches" "1"') == Event(
        2.0, LUA, "hincrby", "{c}:stats:echo"
    )
    xinfo = parse_line(b'+3.0 [0 127.0.0.1:1] "XINFO" "GROUPS" "s"')
    assert xinfo is not None
    assert xinfo.command == "xinfo|groups"
    assert parse_line(b'+3.0 [0 127.0.0.1:1] "TIME"') == Event(3.0, "127.0.0.1:1", "time", "")
    assert parse_line(b"+OK") is None
    assert parse_line(b"") is None


def _event(at_ms: float, client: str, command: str, key: str = "k", *ids: str) -> Event:
    return Event(at_ms / 1000, client, command, key, ids)


def test_a_pipeline_is_one_round_trip_and_a_pause_or_another_client_splits_it() -> None:
    events = [
        _event(0.00, "a", "multi"),
        _event(0.01, "a", "xlen"),
        _event(0.02, "a", "exec"),  # one MULTI/EXEC
        _event(0.50, "a", "xadd"),  # after a pause: a round trip of its own
        _event(0.51, "b", "evalsha"),
        _event(0.52, LUA, "set"),  # inside b's script call: neither a trip nor a split
        _event(0.53, "b", "xreadgroup"),
        _event(0.54, "a", "set"),
        _event(0.55, "b", "xreadgroup"),  # a's command came between: another trip
    ]
    assert round_trips(events, gap_s=0.0002) == [
        ("a", ["multi", "xlen", "exec"]),
        ("a", ["xadd"]),
        ("b", ["evalsha", "xreadgroup"]),
        ("a", ["set"]),
        ("b", ["xreadgroup"]),
    ]
    assert len(round_trips(events, gap_s=0.001)) == 4  # a looser gap joins the pause


def test_a_round_trip_is_named_by_its_commands_whatever_its_size() -> None:
    assert shape(["xadd"]) == "XADD"
    assert shape(["xadd"] * 32) == shape(["xadd"] * 3) == "n XADD"
    assert shape(["hset", "mget"]) == "HSET + MGET"
    assert shape(["set", "set", "get", "get"]) == "n SET + n GET"
    assert shape(["multi", "xlen", "xlen", "hmget", "exec"]) == "MULTI/EXEC: n XLEN, HMGET"


def test_proc_net_tcp_gives_each_sockets_local_port() -> None:
    tcp = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
        "  timeout inode\n"
        "   0: 0100007F:B9C4 0100007F:1A0B 01 00000000:00000000 00:00000000 00000000  1000"
        "        0 123456 1 0000000000000000 20 4 30 10 -1\n"
        "   1: 00000000:1A0B 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000"
        "        0 99 1 0000000000000000 100 0 0 10 0\n"
    )
    assert socket_ports(tcp) == {123456: 0xB9C4, 99: 0x1A0B}


def test_a_watched_interval_is_tallied_by_process() -> None:
    events = [
        _event(0.0, "g1", "xadd", "{c}:stage:echo", "r1"),
        _event(0.1, "g2", "xadd", "{c}:stage:echo", "r2"),
        _event(1.0, "w", "xreadgroup"),
        _event(2.0, "w", "hset"),
        _event(2.01, "w", "mget", "{c}:cancelled:r1", "r1", "r2"),
        _event(3.0, "w", "evalsha", "sha", "r1", "r2"),
        _event(3.01, LUA, "xadd", "{c}:reply:g"),
        _event(3.02, LUA, "xadd", "{c}:reply:g"),
        _event(4.0, "g1", "xread"),
        _event(5.0, "w", "evalsha", "sha"),  # held-back stats: no request, no batch
        _event(6.0, "x", "ping"),
    ]
    roles = {"g1": "gateway", "g2": "gateway", "w": "worker"}
    w = tally(events, roles, gap_s=0.0002)
    assert (w.requests, w.batches) == (2, 1)
    assert w.commands == Counter(
        {
            ("gateway", "xadd"): 2,
            ("gateway", "xread"): 1,
            ("worker", "xreadgroup"): 1,
            ("worker", "hset"): 1,
            ("worker", "mget"): 1,
            ("worker", "evalsha"): 2,
            ("in scripts", "xadd"): 2,
            ("other", "ping"): 1,
        }
    )
    assert w.trips[("worker", "HSET + MGET")] == 1
    assert w.trip_commands[("worker", "HSET + MGET")] == 2
    assert w.per_request("gateway") == 1.5  # two XADDs and a read, over two requests
    assert w.per_request("worker") == 2.0
    assert w.per_request("all") == 4.0
    assert w.connections == Counter({"gateway": 2, "worker": 1, "other": 1})
    assert w.scripted["xadd"] == pytest.approx(0.5)  # two of four XADDs ran in a script
    assert w.nested["xadd"] == pytest.approx(0.5)


def test_a_transaction_s_commands_are_counted_once_at_the_top_level() -> None:
    # EXEC's µs include the commands it runs, which commandstats counts under their own
    # names too: the top level leaves their share to EXEC, as a script's to EVALSHA.
    events = [
        _event(0.0, "g1", "multi"),
        _event(0.0001, "g1", "xadd", "{c}:stage:echo", "r1"),
        _event(0.0002, "g1", "xadd", "{c}:stage:echo", "r2"),
        _event(0.0003, "g1", "exec"),
        _event(1.0, "g1", "xadd", "{c}:stage:echo", "r3"),
        _event(2.0, "g2", "xadd", "{c}:stage:echo", "r4"),
    ]
    w = tally(events, {"g1": "gateway", "g2": "gateway"}, gap_s=0.0002)
    assert w.nested == {"multi": 0.0, "xadd": pytest.approx(0.5), "exec": 0.0}
    assert w.scripted["xadd"] == 0.0  # sent by the client: its calls count as sent
    commands = {"xadd": Calls(4, 40), "exec": Calls(1, 30), "multi": Calls(1, 1)}
    assert top_level_usec(commands, w.nested) == pytest.approx(20.0 + 30.0 + 1.0)


def _span(name: str, start: float, end: float, *, parent: str = "p", **attributes: object) -> Span:
    service = "conveyor-worker" if name.startswith("echo") else "conveyor-gateway"
    return Span(service, name, "t1", parent, start, end, dict(attributes))


def test_a_traced_request_is_cut_at_its_spans_and_its_server_times() -> None:
    ms = 0.001
    rid = {"conveyor.request_id": "r1"}
    spans = [
        _span("POST /v1/echo", 0, 10 * ms, parent=""),
        _span("admission", 0.3 * ms, 0.4 * ms),
        _span("enqueue", 0.4 * ms, 1.2 * ms, **rid),
        _span("echo queue", 0, 1.5 * ms, **rid),
        _span("echo batch", 1.5 * ms, 4.0 * ms, **rid),
        _span("echo run", 3.0 * ms, 4.0 * ms, **rid),
        _span("echo publish", 4.0 * ms, 5.5 * ms, **rid),
        _span("reply", 5 * ms, 7.5 * ms),
        Span("conveyor-worker", "echo batch", "t2", "", 1.5 * ms, 5.5 * ms, {}),  # its own
    ]
    times = server_times(
        [
            _event(0.9, "g", "xadd", "{c}:stage:echo", "r1"),
            _event(1.0, "w", "xreadgroup"),
            _event(2.0, "w", "mget", "{c}:cancelled:r1", "r1"),
            _event(4.5, "w", "evalsha", "sha", "r1"),
            _event(4.6, LUA, "xadd", "{c}:reply:g", "r1"),
            _event(4.7, "w", "xadd", "{c}:reply:g", "r9"),  # not an entry to a stage
        ]
    )
    assert times == {"xadd": {"r1": 0.0009}, "check": {"r1": 0.002}, "script": {"r1": 0.0045}}
    pieces = breakdown(spans, "echo", times)
    got = {name: round(pieces[name][0], 6) for name, _ in STEPS}
    assert list(got.values()) == [0.3, 0.1, 0.5, 0.6, 0.5, 1.0, 1.0, 0.5, 3.0, 2.5]
    assert pieces["total"] == [pytest.approx(10.0)]
    assert sum(got.values()) == pytest.approx(10.0)  # the pieces tile the root span
    assert breakdown(spans, "echo", {"xadd": {}, "check": {}, "script": {}})["total"] == []


def test_export_requests_decode_to_spans() -> None:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    name = rs.resource.attributes.add()
    name.key, name.value.string_value = "service.name", "conveyor-worker"
    s = rs.scope_spans.add().spans.add()
    s.name, s.trace_id, s.span_id = "echo run", bytes.fromhex("ab" * 16), b"\x01" * 8
    s.parent_span_id = b"\x02" * 8
    s.start_time_unix_nano, s.end_time_unix_nano = 1_500_000_000, 2_000_000_000
    attr = s.attributes.add()
    attr.key, attr.value.string_value = "conveyor.request_id", "r1"
    assert decode([request.SerializeToString()]) == [
        Span(
            "conveyor-worker",
            "echo run",
            "ab" * 16,
            "02" * 8,
            1.5,
            2.0,
            {"conveyor.request_id": "r1"},
        )
    ]


def test_the_section_is_replaced_or_put_before_what_runs() -> None:
    body = f"## {TITLE}\n\nnew\n"
    text = "# Results\n\n## Targets\n\nt\n\n## What runs\n\nw\n"
    placed = place_section(text, TITLE, body)
    assert placed == f"# Results\n\n## Targets\n\nt\n\n## {TITLE}\n\nnew\n\n## What runs\n\nw\n"
    again = place_section(placed, TITLE, f"## {TITLE}\n\nnewer\n")
    assert again == placed.replace("\nnew\n", "\nnewer\n")
    assert place_section("# R\n", TITLE, body) == f"# R\n\n## {TITLE}\n\nnew\n"
    assert place_section("", TITLE, body) == body
