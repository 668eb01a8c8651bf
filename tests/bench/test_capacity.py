"""bench.capacity's accounting: what it reads from Redis and how it adds it up."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench.capacity import (
    PARTITIONED,
    SINGLE,
    Calls,
    Layout,
    Load,
    Monitor,
    Point,
    commandstats,
    fit,
    monitor_command,
    partitioned,
    replace_section,
    script_own_usec,
    shares,
    size,
    sum_commandstats,
    top_level_usec,
)
from conveyor.embedded import free_port, start_redis


def test_monitor_lines_name_the_command_and_whether_a_script_ran_it() -> None:
    assert monitor_command(b'+1700000000.123456 [0 127.0.0.1:5555] "XADD" "s" "*" "a" "1"') == (
        "xadd",
        False,
    )
    assert monitor_command(b'+1700000000.123456 [0 lua] "hincrby" "h" "f" "1"') == (
        "hincrby",
        True,
    )
    assert monitor_command(b'+1700000000.1 [3 unix:/tmp/r.sock] "XINFO" "GROUPS" "s"') == (
        "xinfo|groups",
        False,
    )
    assert monitor_command(b'+1700000000.1 [0 lua] "set" "a\\"b" "1"') == ("set", True)
    assert monitor_command(b"+OK") is None


def test_commandstats_leave_out_the_reset_that_started_them() -> None:
    info = {
        "cmdstat_xadd": {"calls": 3, "usec": 12, "usec_per_call": 4.0},
        "cmdstat_config|resetstat": {"calls": 1, "usec": 80},
        "cmdstat_xinfo|groups": {"calls": 1, "usec": 2},
        "errorstat_ERR": {"count": 1},
    }
    assert commandstats(info) == {"xadd": Calls(3, 12), "xinfo|groups": Calls(1, 2)}


def test_a_scripts_commands_count_once_inside_its_call() -> None:
    commands = {"evalsha": Calls(1, 100), "xadd": Calls(2, 20), "hincrby": Calls(5, 10)}
    scripted = {"xadd": 0.5, "hincrby": 1.0, "evalsha": 0.0}
    assert top_level_usec(commands, scripted) == pytest.approx(100 + 10)
    assert script_own_usec(commands, scripted) == pytest.approx(100 - 10 - 10)


def _point(pipeline: str, requests: int, redis_cpu_us: float, gateway_us: float) -> Point:
    """A measurement whose every cost per request is given (commands: none)."""
    return Point(
        pipeline=pipeline,
        load=Load(64, 32),
        round=1,
        requests=requests,
        errors=0,
        rps=1.0,
        batch=1.0,
        redis_cpu_s=redis_cpu_us * requests / 1e6,
        commands={},
        gateway_cpu_s=gateway_us * requests / 1e6,
    )


def test_the_fit_splits_a_fixed_part_from_a_per_hop_part() -> None:
    # 10 µs per request + 30 per hop: 40 at one hop, 100 at three.
    costs = fit(_point("cap1", 1000, 40, 120), _point("cap3", 500, 100, 120))
    assert costs["redis_cpu"] == pytest.approx((10, 30))
    assert costs["gateway"] == pytest.approx((120, 0))


def test_sizing_rounds_every_process_count_up() -> None:
    cost = {"redis_cpu": 35.0, "redis_cmd": 20.0, "gateway": 130.0, "workers": 70.0}
    plan = size(cost, target=200_000, headroom=0.7)
    assert plan.per_shard == pytest.approx(20_000)  # 700,000 busy µs a second / 35
    assert (plan.shards, plan.gateways, plan.workers) == (10, 38, 20)


def test_a_clusters_commandstats_add_up_over_its_nodes() -> None:
    nodes = [
        {"evalsha": Calls(10, 900), "xadd": Calls(4, 8)},
        {"evalsha": Calls(12, 1000)},
        {"command|getkeys": Calls(30, 20)},
    ]
    assert sum_commandstats(nodes) == {
        "evalsha": Calls(22, 1900),
        "xadd": Calls(4, 8),
        "command|getkeys": Calls(30, 20),
    }
    assert sum_commandstats([]) == {}


def test_each_nodes_share_of_the_cpu() -> None:
    assert shares([2.0, 1.0, 1.0]) == pytest.approx([0.5, 0.25, 0.25])
    assert shares([0.0, 0.0]) == [0.0, 0.0]


def test_layouts_say_where_the_streams_live() -> None:
    assert str(SINGLE) == "P=1 on one redis-server"
    assert str(Layout(6, 3)) == "P=6 on 3 shards"


def test_a_section_is_replaced_in_place_and_the_rest_kept() -> None:
    text = "# Title\n\n## A\n\nold a\n\n## B\n\nold b\n"
    assert replace_section(text, "A", "## A\n\nnew a\n") == (
        "# Title\n\n## A\n\nnew a\n\n## B\n\nold b\n"
    )
    assert replace_section(text, "B", "## B\n\nnew b\n") == (
        "# Title\n\n## A\n\nold a\n\n## B\n\nnew b\n"
    )
    assert replace_section(text, "C", "## C\n\nc\n") == text + "\n## C\n\nc\n"
    assert replace_section("", "C", "## C\n") == "## C\n"


def _hop_points(
    layout: Layout, round_no: int, per_hop_us: float, nodes: list[float]
) -> list[Point]:
    """The one- and three-hop chains in ``layout``: 10 µs of Redis CPU per request plus
    ``per_hop_us`` per hop, split over the nodes in the proportions ``nodes``."""
    out = []
    for name, hops in (("cap1", 1), ("cap3", 3)):
        cpu_s = (10 + hops * per_hop_us) * 1000 / 1e6  # 1000 requests
        out.append(
            Point(
                pipeline=name,
                load=Load(64, 32),
                round=round_no,
                requests=1000,
                errors=0,
                rps=1.0,
                batch=8.0,
                redis_cpu_s=cpu_s,
                commands={},
                layout=layout,
                shard_cpu_s=[cpu_s * n / sum(nodes) for n in nodes],
                shard_calls=[int(100 * n) for n in nodes],
            )
        )
    return out


def test_the_partitioned_section_compares_per_hop_cost_with_one_server() -> None:
    parted = Layout(3, 3)
    points = [
        *_hop_points(SINGLE, 1, 20, [1]),
        *_hop_points(parted, 1, 30, [2, 1, 1]),
        *_hop_points(SINGLE, 2, 20, [1]),
        *_hop_points(parted, 2, 50, [2, 1, 1]),
    ]
    section = partitioned(points, [SINGLE, parted], "python -m bench.capacity", 1.0, (0.0, 0.0))
    assert section.startswith(f"## {PARTITIONED}\n")
    row = next(line for line in section.splitlines() if line.startswith("| 64 | 32 | P=3"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4] == "40 (30-50, ±25%)"  # µs of Redis CPU per item-hop, over rounds
    assert cells[5] == "2.00 (1.50, 2.50)"  # against one server's 20, and each round's
    assert cells[9] == "50/25/25% (calls 50/25/25%)"


def test_loads_read_clients_and_batch_bound() -> None:
    assert Load.parse("64x1") == Load(64, 1)
    assert Load.parse("256") == Load(256, 32)
    assert str(Load(1, 32)) == "1 client, max batch 32"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, redis.Redis]]:
    """A redis-server of this test alone: its command counts are this test's."""
    port = free_port()
    proc = start_redis(port, tmp_path)
    client = redis.Redis(port=port)
    try:
        yield port, client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_counts_a_scripts_commands_twice_and_monitor_tells_which(
    server: tuple[int, redis.Redis],
) -> None:
    """What the accounting rests on, on this Redis: commandstats count a command a script
    ran under its own name too, and MONITOR names the script as its source."""
    port, client = server
    monitor = Monitor("127.0.0.1", port)
    client.config_resetstat()
    client.eval("redis.call('XADD', KEYS[1], '*', 'a', '1'); return 1", 1, "s")
    client.xadd("s", {"a": "2"})
    give_up = time.monotonic() + 10
    while sum(monitor.seen.values()) < 4 and time.monotonic() < give_up:
        time.sleep(0.01)  # MONITOR's lines arrive on their own connection
    shares = monitor.stop()
    assert shares["xadd"] == pytest.approx(0.5)
    stats = commandstats(client.info("commandstats"))
    assert stats["xadd"].calls == 2
    assert stats["eval"].calls == 1
