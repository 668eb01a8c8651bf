"""Turn a run's results into ``RESULTS.md`` (targets, tables, machine) and ``results.png``."""

from __future__ import annotations

import math
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bench.run import SYSTEMS, Results, Row
from conveyor.embedded import find_redis_server

LABELS = {
    "conveyor": "conveyor (gateway + worker)",
    "conveyor-items": "conveyor, item-count batching",
    "celery": "FastAPI + Celery",
    "hf-batching": "FastAPI + asyncio batching",
    "litserve": "LitServe",
    "in-process": "in-process model",
}

SERVING_RATIO = 0.95
"""Served MiniLM at the top concurrency against the in-process batch loop."""
C1_OVERHEAD_MS = 1.5
"""p50 at one client over one in-process call on one item."""
LENGTH_AWARE_GAIN = 1.3
"""mixed: length-aware over item-count batching, throughput at the top concurrency."""
UNIFORM_FLOOR = 0.97
"""embed (uniform text): length-aware over item-count batching, the same."""


@dataclass
class Target:
    """One of the issue's targets, as measured.

    Attributes:
        name: what is compared.
        measured: the figure, with what it was computed from.
        goal: the bar.
        passed: whether the figure clears the bar.
    """

    name: str
    measured: str
    goal: str
    passed: bool


DRIFT_WARN = 0.10
"""A limit that moved more than this between its two measurements flags the run."""


def drift(res: Results) -> list[str]:
    """The Machine section's line on how the in-process limits moved during the run."""
    pairs = [
        (w, b, res.limits_after[w])
        for w, b in res.limits_before.items()
        if w in res.limits_after and w != "echo"
    ]
    if not pairs:
        return []
    moves = [(w, b.throughput, a.throughput, a.throughput / b.throughput - 1) for w, b, a in pairs]
    text = "; ".join(f"{w} {b:.0f}/s before, {a:.0f}/s after ({m:+.0%})" for w, b, a, m in moves)
    line = (
        f"- Speed drift: the in-process model, measured before the served systems and again "
        f"after them: {text}. The targets hold conveyor to the faster throughput and the "
        "lower single-item latency of the two."
    )
    if any(abs(m) > DRIFT_WARN for *_, m in moves):
        line += (
            f" **The machine's speed moved more than {DRIFT_WARN:.0%} during this run: "
            "rerun before reading much into the ratios.**"
        )
    return [line]


def targets(res: Results) -> list[Target]:
    """Every target whose measurements this run took."""
    out: list[Target] = []
    top = max(res.plan.concurrencies)
    served = res.row("conveyor", "embed", top)
    limit = res.limits.get("embed")
    if served and limit:
        ratio = served.load.throughput / limit.throughput
        out.append(
            Target(
                f"embed: conveyor c={top} vs in-process batch {limit.batch}",
                f"{ratio:.2f} ({served.load.throughput:.0f} / {limit.throughput:.0f} per s)",
                f">= {SERVING_RATIO:.2f}",
                ratio >= SERVING_RATIO,
            )
        )
    ours, loop = res.row("conveyor", "echo", top), res.row("hf-batching", "echo", top)
    if ours and loop:  # issue 37: the queue against no queue, on a model that costs nothing
        ratio = ours.load.throughput / loop.load.throughput
        out.append(
            Target(
                f"echo: conveyor c={top} vs {LABELS['hf-batching']} (one process, no queue)",
                f"{ratio:.2f} ({ours.load.throughput:.0f} / {loop.load.throughput:.0f} per s; "
                f"CPU {ours.cpu_ms:.2f} / {loop.cpu_ms:.2f} ms a request)",
                ">= 1.00",
                ratio >= 1.0,
            )
        )
    for threads, lim, row in res.threads:
        ratio = row.load.throughput / lim.throughput
        out.append(
            Target(
                f"embed, torch at {threads} thread(s) in both: conveyor c={row.concurrency} "
                f"vs in-process batch {lim.batch}",
                f"{ratio:.2f} ({row.load.throughput:.0f} / {lim.throughput:.0f} per s)",
                f">= {SERVING_RATIO:.2f}",
                ratio >= SERVING_RATIO,
            )
        )
    out += _batching_modes(res, top)
    for workload, factor in (("synthetic", 5.0), ("embed", 2.0)):
        ours, theirs = res.row("conveyor", workload, top), res.row("celery", workload, top)
        if not (ours and theirs):
            continue
        ratio = ours.load.throughput / max(theirs.load.throughput, 1e-9)
        out.append(
            Target(
                f"{workload}: conveyor vs Celery throughput, c={top}",
                f"{ratio:.1f}x ({ours.load.throughput:.0f} / {theirs.load.throughput:.0f} per s)",
                f">= {factor:g}x",
                ratio >= factor,
            )
        )
        p99, theirs_p99 = ours.load.pct(0.99), theirs.load.pct(0.99)
        out.append(
            Target(
                f"{workload}: conveyor vs Celery p99, c={top}",
                f"{p99:.0f} ms vs {theirs_p99:.0f} ms",
                "no worse",
                p99 <= theirs_p99,
            )
        )
    for workload, lim in res.limits.items():
        one = res.row("conveyor", workload, 1)
        if one is None:
            continue
        p50 = one.load.pct(0.5)
        out.append(
            Target(
                f"{workload}: conveyor p50 at c=1 vs one in-process call",
                f"{p50:.1f} ms vs {lim.single_p50_ms:.1f} ms (+{p50 - lim.single_p50_ms:.1f})",
                f"<= model + {C1_OVERHEAD_MS:g} ms",
                p50 <= lim.single_p50_ms + C1_OVERHEAD_MS,
            )
        )
    base = next((r for r in res.scaling if r.workers == 1), None)
    for row in res.scaling:
        if base is None or row.workers == 1:
            continue
        ideal = row.workers * base.load.throughput
        share = row.load.throughput / ideal
        out.append(
            Target(
                f"synthetic: {row.workers} workers vs {row.workers} x one",
                f"{share:.2f} ({row.load.throughput:.0f} / {ideal:.0f} per s)",
                ">= 0.90",
                share >= 0.9,
            )
        )
    over = res.overload
    if over is not None and over.admitted:
        p99 = _p99(over.admitted)
        out.append(
            Target(
                "synthetic at 2x overload: admitted requests' p99 vs their deadline",
                f"{p99 * 1000:.0f} ms vs {over.deadline_s * 1000:.0f} ms "
                f"({len(over.admitted)} admitted, {over.late} late)",
                "<= deadline",
                p99 <= over.deadline_s and over.late == 0,
            )
        )
    if over is not None and over.refused:
        p99 = _p99(over.refused)
        out.append(
            Target(
                "synthetic at 2x overload: the surplus refused (503), p99",
                f"{p99 * 1000:.1f} ms ({len(over.refused)} refused)",
                "< 10 ms",
                p99 < 0.010,
            )
        )
    return out


def _batching_modes(res: Results, top: int) -> list[Target]:
    """conveyor's length-aware batching against its item-count batching, side by side in
    the same run: the gain on mixed text, no loss on uniform text."""
    out = []
    for workload, goal in (("mixed", LENGTH_AWARE_GAIN), ("embed", UNIFORM_FLOOR)):
        aware, items = res.row("conveyor", workload, top), res.row("conveyor-items", workload, top)
        if not (aware and items):
            continue
        ratio = aware.load.throughput / max(items.load.throughput, 1e-9)
        measured = (
            f"{ratio:.2f}x ({aware.load.throughput:.1f} / {items.load.throughput:.1f} per s; "
            f"padding {_share(aware.padding)} vs {_share(items.padding)})"
        )
        passed = ratio >= goal
        bar = f">= {goal:g}x"
        if workload == "mixed":
            p99, items_p99 = aware.load.pct(0.99), items.load.pct(0.99)
            measured += f"; p99 {_ms(p99)} vs {_ms(items_p99)} ms"
            passed = passed and p99 <= items_p99  # False where either is NaN (no answers)
            bar += ", p99 no worse"
        text = "mixed" if workload == "mixed" else "embed (uniform)"
        out.append(
            Target(
                f"{text}: conveyor length-aware vs item-count batching, throughput c={top}",
                measured,
                bar,
                passed,
            )
        )
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct_ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f} ms"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def version(package: str) -> str:
    """``package``'s installed version, or ``-``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def machine() -> list[str]:
    """Lines describing the machine and the software measured."""
    cpu = platform.processor() or platform.machine()
    mem_gib = 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass  # not Linux: fewer details
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    redis = subprocess.run(
        [find_redis_server(), "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    redis_v = next((w.split("=", 1)[1] for w in redis if w.startswith("v=")), "?")
    versions = ", ".join(
        f"{p} {version(p)}"
        for p in ("torch", "transformers", "fastapi", "uvicorn", "celery", "litserve")
    )
    return [
        f"- CPU: {cpu}, {os.cpu_count()} logical cores ({len(os.sched_getaffinity(0))} usable);"
        f" memory {mem_gib:.0f} GiB; GPU: {gpu}; torch threads per process: "
        f"{torch.get_num_threads()}",
        f"- OS: {platform.platform()}; Python {platform.python_version()}; redis-server "
        f"{redis_v}; {versions}",
    ]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _rate(value: float) -> str:
    return f"{value:.1f}" if value < 1e5 else f"{value:.2g}"


def _row(row: Row) -> str:
    load = row.load
    return (
        f"| {LABELS[row.system]} | {row.concurrency} | {load.throughput:.1f} | "
        f"{_ms(load.pct(0.5))} | {_ms(load.pct(0.99))} | {load.errors}/{load.requests} | "
        f"{row.mean_batch:.1f} | {_share(row.padding)} | {row.cpu_ms:.2f} |"
    )


def _ordered(rows: list[Row]) -> list[Row]:
    """Rows by system (in :data:`bench.run.SYSTEMS` order), then clients."""
    return sorted(rows, key=lambda r: (SYSTEMS.index(r.system), r.concurrency))


def markdown(res: Results, command: str, systems_doc: str, *, smoke: bool = False) -> str:
    """The whole ``RESULTS.md``.

    Args:
        res: the run's results.
        command: the command line that produced them.
        systems_doc: what each system is (markdown).
        smoke: a ``--quick`` run, whose figures are too short to mean anything.
    """
    plan = res.plan
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{command}` on {res.started} in {res.wall_s:.0f} s; rerun it to "
        "refresh this file and `results.png`. Load average (1 min) "
        f"{res.load_avg[0]:.2f} at the start, {res.load_avg[1]:.2f} at the end: "
        "well above 0 means other work shared the CPU and the figures are noisy.",
        "",
        *(
            [
                "**Smoke run (`--quick`)**: every measurement is a fraction of a second; it "
                "shows that everything starts, answers and stops, not how fast it is.",
                "",
            ]
            if smoke
            else []
        ),
        "## Machine",
        "",
        *machine(),
        *(
            [
                f"- Loopback round trip (raw PING to redis-server, no client library): "
                f"{res.wake.busy_us:.0f} us back to back, {res.wake.idle_us:.0f} us after "
                f"{res.wake.gap_s * 1000:.0f} ms idle. A request at c=1 crosses processes "
                "six times and, when the model takes milliseconds, finds most "
                "of them idle: the difference is paid at every crossing, which a "
                "single in-process call never pays."
            ]
            if res.wake
            else []
        ),
        *drift(res),
        "",
        "## Targets",
        "",
        "| target | measured | goal | result |",
        "|---|---|---|---|",
        *(
            f"| {t.name} | {t.measured} | {t.goal} | {'PASS' if t.passed else '**MISS**'} |"
            for t in targets(res)
        ),
        "",
        "## Throughput and latency",
        "",
        f"Closed loop: each measurement sends at most {plan.requests} requests for at most "
        f"{plan.seconds:g} s after {plan.warmup_s:g} s of warm-up. Throughput is successful "
        "requests per second; latency is per request as the client saw it; mean batch is "
        "items per model call; padding is real tokens / padded tokens of the batches the "
        "model ran (1.00: no padding; - where not counted or there is no tokenizer); CPU is "
        "what the system's own processes (Redis included) spent per request, from /proc.",
    ]
    for workload in plan.workloads:
        lines += [
            "",
            f"### {workload}",
            "",
            "| system | clients | req/s | p50 ms | p99 ms | errors | mean batch | padding | "
            "CPU ms/req |",
            "|---|---|---|---|---|---|---|---|---|",
            *(_row(r) for r in _ordered([r for r in res.rows if r.workload == workload])),
        ]
        lim = res.limits.get(workload)
        if lim:
            lines.append(
                f"| {LABELS['in-process']}, batch {lim.batch} / batch 1 | - | "
                f"{_rate(lim.throughput)} | {lim.single_p50_ms:.3g} | {lim.single_p99_ms:.3g} | "
                f"- | {lim.batch} / 1 | {_share(lim.padding)} | - |"
            )
    if res.scaling:
        base = res.scaling[0].load.throughput / res.scaling[0].workers
        lines += [
            "",
            "## Scaling: synthetic on conveyor with N worker processes",
            "",
            f"{plan.scale_clients_per_worker} clients per worker, one gateway.",
            "",
            "| workers | clients | req/s | of N x one | p50 ms | p99 ms | mean batch | "
            "CPU ms/req |",
            "|---|---|---|---|---|---|---|---|",
            *(
                f"| {r.workers} | {r.concurrency} | {r.load.throughput:.1f} | "
                f"{r.load.throughput / (base * r.workers):.2f} | {_ms(r.load.pct(0.5))} | "
                f"{_ms(r.load.pct(0.99))} | {r.mean_batch:.1f} | {r.cpu_ms:.2f} |"
                for r in res.scaling
            ),
        ]
    if res.threads:
        lines += [
            "",
            "## embed with torch held to fewer threads",
            "",
            "The tables above let torch use every core in every system, so on this machine "
            "the model, the serving path and the load generator take turns on the same "
            "cores: whatever a request costs the gateway, Redis or the client is taken "
            "from the model (and a torch thread that loses its core stalls its siblings). "
            "Here torch is held to the same thread count in both the in-process loop and "
            "conveyor's worker (`CONVEYOR_THREADS`), so the rest of the cores carry the "
            "serving path: what is compared is the queue's cost, not the cores'.",
            "",
            f"| torch threads | in-process batch {res.threads[0][1].batch}, items/s | conveyor "
            f"c={res.threads[0][2].concurrency}, req/s | ratio | p50 ms | p99 ms | mean batch |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {n} | {lim.throughput:.1f} | {r.load.throughput:.1f} | "
                f"{r.load.throughput / lim.throughput:.2f} | {_ms(r.load.pct(0.5))} | "
                f"{_ms(r.load.pct(0.99))} | {r.mean_batch:.1f} |"
                for n, lim, r in res.threads
            ),
        ]
    if res.overload is not None:
        o = res.overload
        lines += [
            "",
            "## Overload: synthetic on one conveyor worker, open loop at 2x capacity",
            "",
            f"Capacity (closed loop, {res.plan.scale_clients_per_worker} clients) "
            f"{o.capacity:.1f}/s; offered {o.offered:.1f}/s for about "
            f"{res.plan.seconds:g} s, every request with a {o.deadline_s:g} s deadline.",
            "",
            "| outcome | requests | p50 | p99 |",
            "|---|---|---|---|",
            f"| 200 admitted | {len(o.admitted)} | {_pct_ms(o.admitted, 0.5)} | "
            f"{_pct_ms(o.admitted, 0.99)} |",
            f"| 503 refused | {len(o.refused)} | {_pct_ms(o.refused, 0.5)} | "
            f"{_pct_ms(o.refused, 0.99)} |",
            f"| 504 late | {o.late} | | |",
            f"| other | {o.other} | | |",
        ]
    lines += ["", "## What runs", "", systems_doc.strip(), ""]
    return "\n".join(lines)


def plot(res: Results, path: Path) -> None:
    """Throughput and p99 against clients, per workload and system; and the scaling sweep."""
    # The bench extra installs matplotlib; without it this module still type-checks.
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    from matplotlib.ticker import ScalarFormatter  # type: ignore[import-not-found, unused-ignore]

    columns = len(res.plan.workloads) + (1 if res.scaling else 0)
    fig, axes = plt.subplots(2, columns, figsize=(4.2 * columns, 7.5), squeeze=False)
    for col, workload in enumerate(res.plan.workloads):
        top, bottom = axes[0][col], axes[1][col]
        for system in (s for s in SYSTEMS if s != "in-process"):
            rows = _ordered([r for r in res.rows if r.system == system and r.workload == workload])
            if not rows:
                continue
            xs = [r.concurrency for r in rows]
            style = {
                "label": LABELS[system],
                "color": f"C{SYSTEMS.index(system)}",
            }  # same in every panel
            top.plot(xs, [r.load.throughput for r in rows], "o-", **style)
            bottom.plot(xs, [r.load.pct(0.99) for r in rows], "o-", **style)
        lim = res.limits.get(workload)
        if lim and workload != "echo":  # echo's limit is millions per second: off the chart
            top.axhline(lim.throughput, ls="--", c="grey", label=f"in-process, batch {lim.batch}")
        top.set_title(workload)
        top.set_ylabel("requests / s")
        bottom.set_ylabel("p99 latency, ms")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(res.plan.concurrencies)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xlabel("concurrent clients")
            ax.grid(True, alpha=0.3)
        top.set_ylim(bottom=0)
        bottom.set_yscale("log")
        top.legend(fontsize=7)
    if res.scaling:
        top, bottom = axes[0][-1], axes[1][-1]
        ns = [r.workers for r in res.scaling]
        per_worker = res.scaling[0].load.throughput / res.scaling[0].workers
        top.plot(ns, [r.load.throughput for r in res.scaling], "o-", label="conveyor")
        top.plot(ns, [per_worker * n for n in ns], "--", c="grey", label="N x one worker")
        bottom.plot(ns, [r.load.pct(0.99) for r in res.scaling], "o-")
        top.set_title("synthetic: scaling out")
        top.set_ylabel("requests / s")
        bottom.set_ylabel("p99 latency, ms")
        for ax in (top, bottom):
            ax.set_xlabel("worker processes")
            ax.set_xticks(ns)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        top.legend(fontsize=7)
    fig.suptitle(f"conveyor benchmark, {res.started}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
