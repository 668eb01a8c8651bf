"""bench.hotpath's section of ``bench/RESULTS.md``: what one load counted, and the tables."""

from __future__ import annotations

import argparse
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench.capacity import Calls, replace_section, script_own_usec, top_level_usec
from bench.hotpath_spans import STEPS
from bench.hotpath_watch import PROCESSES, Watched
from bench.loadgen import LoadResult

TITLE = "The hot path: Redis work and latency per request"
COMMAND = "HF_HUB_OFFLINE=1 .venv/bin/python -m bench.hotpath"
PACKAGES = ("conveyor", "gateway", "workers", "runtime", "pipelines")
"""The product's code (whose uncommitted changes the report names)."""

SETTLE_S = 1.5
"""Idle time after a loop: a worker holds its batches' counts back (``stats_flush_s``)
and sends them once idle, after a read that waited ``block_ms`` (1 s) for nothing."""


@dataclass
class Counted:
    """One load, counted.

    Attributes:
        clients: clients of the closed loop.
        result: the closed loop's outcome.
        items: items the stage ran (its stats hash).
        batches: batches it ran them in.
        commands: ``INFO commandstats`` over the loop.
        redis_cpu_s: redis-server's CPU seconds (``INFO cpu``, user + sys).
        reads: socket reads Redis made (``INFO stats`` ``total_reads_processed``): one per
            round trip of any client (more for one over 16 KiB).
        gateway_cpu_s: the gateway's CPU seconds.
        worker_cpu_s: the worker's.
    """

    clients: int
    result: LoadResult
    items: float
    batches: float
    commands: dict[str, Calls]
    redis_cpu_s: float
    reads: int
    gateway_cpu_s: float
    worker_cpu_s: float

    @property
    def requests(self) -> int:
        """Requests answered 200 (at least 1: a divisor)."""
        return max(1, self.result.statuses.get(200, 0))


@dataclass
class Measured:
    """Everything measured of one workload: per load counted and watched; traced."""

    counted: list[Counted]
    watched: list[Watched]
    pieces: dict[str, list[float]]
    traced: LoadResult


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if x else ""


def command_rows(c: Counted, w: Watched) -> list[str]:
    """Per command: calls per request and per batch (counted), per request by who sent it
    (watched), µs per call and per request (counted); most calls first; then the whole.
    A script's µs per call include those of the commands it ran."""
    n, b, wn = c.requests, max(1.0, c.batches), max(1, w.requests)
    rows = []
    for name, calls in sorted(c.commands.items(), key=lambda kv: (-kv[1].calls, kv[0])):
        by = [w.commands[role, name] / wn for role in ("gateway", "worker", "in scripts")]
        rows.append(
            f"| {name.upper()} | {calls.calls / n:.2f} | {calls.calls / b:.2f} | "
            f"{' | '.join(_f(x) for x in by)} | {calls.usec / max(1, calls.calls):.1f} | "
            f"{calls.usec / n:.1f} |"
        )
    total = sum(x.calls for x in c.commands.values())
    sent = total - sum(x.calls * w.scripted.get(k, 0.0) for k, x in c.commands.items())
    return [
        *rows,
        f"| **all** ({sent / n:.2f} sent by clients) | **{total / n:.2f}** | "
        f"**{total / b:.1f}** | | | | | **{sum(x.usec for x in c.commands.values()) / n:.1f}** |",
    ]


FIGURES: tuple[tuple[str, int], ...] = (
    ("clients", 0),
    ("requests", 0),
    ("req/s", 0),
    ("p50 ms", 2),
    ("p99 ms", 2),
    ("mean batch", 1),
    ("Redis commands", 2),
    ("Redis CPU µs", 0),
    ("command µs, top level", 1),
    ("of which scripts' own", 1),
    ("gateway CPU µs", 0),
    ("worker CPU µs", 0),
    ("gateway round trips", 2),
    ("worker round trips", 2),
)
"""The figures of one counted and watched load, per request (``--json``; the table of
each workload's section has all but the round trips), with the digits they are shown to."""

TABLE = FIGURES[:12]
"""The columns of a section's per-request table, with their digits."""


def per_request(c: Counted, w: Watched) -> dict[str, float]:
    """:data:`FIGURES` of one load: ``c`` counted, ``w`` watched."""
    n = c.requests
    trips = dict.fromkeys(("gateway", "worker"), 0)
    for (role, _), count in w.trips.items():
        if role in trips:
            trips[role] += count
    return {
        "clients": c.clients,
        "requests": n,
        "req/s": c.result.throughput,
        "p50 ms": c.result.pct(0.5),
        "p99 ms": c.result.pct(0.99),
        "mean batch": c.items / max(1.0, c.batches),
        "Redis commands": sum(x.calls for x in c.commands.values()) / n,
        "Redis CPU µs": 1e6 * c.redis_cpu_s / n,
        "command µs, top level": top_level_usec(c.commands, w.nested) / n,
        "of which scripts' own": script_own_usec(c.commands, w.scripted) / n,
        "gateway CPU µs": 1e6 * c.gateway_cpu_s / n,
        "worker CPU µs": 1e6 * c.worker_cpu_s / n,
        **{f"{role} round trips": n_trips / max(1, w.requests) for role, n_trips in trips.items()},
    }


def section(
    measured: Mapping[str, Measured],
    args: argparse.Namespace,
    machine: Sequence[str],
    code: str,
    took: float,
    load_avg: tuple[float, float],
) -> str:
    """The :data:`TITLE` section of ``RESULTS.md``."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join([COMMAND, *args.argv])
    lines = [
        f"## {TITLE}",
        "",
        f"Written by `{command}` on {stamp} in {took:.0f} s; load average (1 min) "
        f"{load_avg[0]:.2f} at the start, {load_avg[1]:.2f} at the end. Rerun it to refresh "
        "this section (a full `python -m bench` rewrites the whole file).",
        "",
        *machine,
        code,
        "- Redis, the gateway, the worker and the load generator share these cores with "
        "whatever else runs here: times are noisy, compare ratios within one run. Counts "
        "(commands, round trips) do not depend on the machine, except where they follow the "
        "batch size or the clock (background reads per request fall as requests/s rise).",
        "",
        "conveyor as `bench.capacity` starts it (redis-server, the gateway, one worker, "
        "batches of up to 32), loaded through HTTP by the bench's closed loop. Every interval "
        f"is one whole closed loop after a 1 s warm-up loop, with {SETTLE_S:g} s idle before "
        "and after it (what a worker holds back goes out when it idles). **Counted** (no "
        f"`MONITOR`; up to {args.seconds:g} s): `CONFIG RESETSTAT` before; `INFO "
        "commandstats`, `INFO cpu` and `INFO stats` after; gateway and worker CPU from /proc; "
        "batches from the stage's stats hash. Redis 7 counts a command a script runs under "
        "its own name as well as in `EVALSHA`: the calls include them, and their µs are "
        "inside `EVALSHA`'s too; so are a MULTI/EXEC's inside `EXEC`'s. The top level counts "
        "each µs once: a command's share that a script or a MULTI/EXEC ran (watched) is left "
        "to its `EVALSHA` or `EXEC`. "
        f"**Watched** (up to {args.watch_seconds:g} s under `MONITOR`): every client "
        "connection given to its process through /proc. **Round trips are approximate:** "
        f"a connection's commands that reach Redis within {args.gap_ms:g} ms of each other "
        "with no other connection's command between count as one round trip (a pipeline or "
        "a MULTI/EXEC runs that way; two round trips in a row would need the client to read "
        "the reply and write again that fast while nothing else ran). Redis's own count of "
        "socket reads (counted interval) is the check on their sum.",
    ]
    for workload, m in measured.items():
        pairs = list(zip(m.counted, m.watched, strict=True))
        lines += [
            "",
            f"### {workload}: per request",
            "",
            "| " + " | ".join(name for name, _ in TABLE) + " |",
            "|" + "---|" * len(TABLE),
        ]
        for c, w in pairs:
            f = per_request(c, w)
            lines.append("| " + " | ".join(f"{f[name]:.{d}f}" for name, d in TABLE) + " |")
        for c, w in pairs:
            lines += [
                "",
                f"### {workload}, {c.clients} client{'s' * (c.clients > 1)}: Redis commands "
                f"by name (per request; who sent them from the watched interval: "
                f"{w.requests} requests, {w.batches} batches)",
                "",
                "| command | calls/request | calls/batch | gateway | worker | in scripts "
                "| µs/call | µs/request |",
                "|---|---|---|---|---|---|---|---|",
                *command_rows(c, w),
            ]
        lines += [
            "",
            f"### {workload}: round trips to Redis per request, by process",
            "",
            "| clients | process | connections | round trips/request | round trips/batch "
            "| commands/round trip |",
            "|---|---|---|---|---|---|",
        ]
        for c, w in pairs:
            for role in (*PROCESSES, "all"):
                chosen = PROCESSES if role == "all" else (role,)
                trips = sum(n for (r, _), n in w.trips.items() if r in chosen)
                sent = sum(n for (r, _), n in w.commands.items() if r in chosen)
                if trips:
                    lines.append(
                        f"| {c.clients} | {role} | {sum(w.connections[r] for r in chosen)} | "
                        f"{trips / max(1, w.requests):.2f} | {trips / max(1, w.batches):.2f} | "
                        f"{sent / trips:.2f} |"
                    )
            lines.append(
                f"| {c.clients} | all: Redis's socket reads (counted) | | "
                f"{c.reads / c.requests:.2f} | {c.reads / max(1.0, c.batches):.2f} | |"
            )
        lines += [
            "",
            f"### {workload}: what the round trips are (watched; n: several of one command)",
            "",
            "| clients | process | round trip | per request | commands in each (mean) |",
            "|---|---|---|---|---|",
        ]
        for c, w in pairs:
            for (role, name), n in sorted(w.trips.items(), key=lambda kv: (kv[0][0], -kv[1])):
                if n / max(1, w.requests) >= 0.005:
                    lines.append(
                        f"| {c.clients} | {role} | {name} | {n / max(1, w.requests):.3f} | "
                        f"{w.trip_commands[role, name] / n:.1f} |"
                    )
        medians = {k: statistics.median(v) if v else float("nan") for k, v in m.pieces.items()}
        whole = sum(medians[name] for name, _ in STEPS)
        untraced = [c.result.pct(0.5) for c in m.counted if c.clients == 1]
        lines += [
            "",
            f"### {workload}: where one request's time goes, 1 client (median of "
            f"{len(m.pieces['total'])} traced requests)",
            "",
            "Cut at the edges of the spans conveyor exports (`runtime/tracing.py`, "
            "`workers/spans.py`, `gateway/traces.py`; FastAPI's root span) and at the times "
            "Redis ran the request's commands (`MONITOR`); conveyor's spans are on the Redis "
            "clock, the root span on the gateway's (one machine: they agree to within a "
            "loopback round trip). Tracing and `MONITOR` add work to every step: compare the "
            "traced and untraced latency below, and read the shares.",
            "",
            "| step | from → to | median ms | share of the sum |",
            "|---|---|---|---|",
            *(
                f"| {name} | {edges} | {medians[name]:.2f} | {100 * medians[name] / whole:.0f}% |"
                for name, edges in STEPS
            ),
            f"| sum of the medians | | {whole:.2f} | |",
            f"| the root span (median) | | {medians['total']:.2f} | |",
            f"| at the client, traced (p50) | | {m.traced.pct(0.5):.2f} | |",
            f"| at the client, untraced (p50, counted) | | "
            f"{untraced[0] if untraced else float('nan'):.2f} | |",
        ]
    return "\n".join(lines) + "\n"


def tree() -> str:
    """Which code runs: the checkout's commit and its uncommitted product files."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return f"- Code: {root} (not a git checkout)"
    changed = git("status", "--porcelain", "--", *PACKAGES).splitlines()
    names = ", ".join(line[3:] for line in changed[:12]) + (", ..." if len(changed) > 12 else "")
    return f"- Code: commit {head}" + (
        f", with uncommitted changes to {len(changed)} files ({names})" if changed else ""
    )


def place_section(text: str, title: str, body: str, before: str = "What runs") -> str:
    """``text`` with its ``## title`` section replaced by ``body``; where it has none,
    ``body`` goes before the ``## before`` section (else at the end)."""
    anchor = f"## {before}\n"
    if f"## {title}\n" in text.splitlines(keepends=True) or anchor not in text:
        return replace_section(text, title, body)
    head, _, tail = text.partition(anchor)
    return head + body + "\n" + anchor + tail
