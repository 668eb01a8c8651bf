"""``bench/GPU.md`` from one ``python -m bench.gpu`` run: the targets of issue 24 with
PASS/MISS, the in-process and served tables, the machine."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from bench.gpu_model import Variant
from bench.gpu_served import Served, Session, Window
from bench.report import LENGTH_AWARE_GAIN, Target, machine

FIRST_FLOOR = 0.8
"""The first window after ready against the steady state (no cold shapes left)."""
SERVED_RATIO = 0.9
"""Served embed at the most clients against the in-process runner at its best bucket."""
SERVED_BEFORE = 1206.0
"""Served embed at 256 clients on an H100 before issue 24 (req/s)."""
SERVED_GAIN = 3.0
"""... and the multiple of it asked for."""
EAGER_BEFORE = 5400.0
"""In-process eager MiniLM at batch 128 on an H100 before issue 24 (sentences/s)."""
IN_PROCESS_GAIN = 2.0
"""The in-process runner with buckets (and graphs where they win) against it."""
COSINE_FLOOR = 0.9999
"""The least cosine of a device answer to the CPU float32 one."""
GATEWAYS_GAIN = 2.5
"""Echo with several gateways against one, at the most clients."""


@dataclass
class Report:
    """Everything one run measured.

    Attributes:
        command: the command line.
        device: where the models ran.
        first_s: the window after ready.
        max_batch: the served stages' max batch.
        gateways: the gateways echo is measured with against one.
        quick: a smoke run.
        variants: the in-process runner's variants.
        sessions: the served systems, in the order they ran.
        rows: the served measurements.
        gateways_note: why echo with several gateways was not measured ("" where it was).
        started: when the run began (local time).
        wall_s: how long it took.
        load_avg: the 1-minute load average at the start and at the end.
    """

    command: str
    device: str
    first_s: float
    max_batch: int
    gateways: int
    quick: bool = False
    variants: list[Variant] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    rows: list[Served] = field(default_factory=list)
    gateways_note: str = ""
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M %Z"))
    wall_s: float = 0.0
    load_avg: tuple[float, float] = (0.0, 0.0)

    @property
    def top(self) -> int:
        """The most clients measured."""
        return max((r.clients for r in self.rows), default=0)

    def row(self, system: str, workload: str, gateways: int = 1) -> Window | None:
        """The steady window of (system, workload) at the most clients, if measured."""
        for r in self.rows:
            if (r.system, r.workload, r.gateways, r.clients) == (
                system,
                workload,
                gateways,
                self.top,
            ):
                return r.steady
        return None

    def variant(self, name: str) -> Variant | None:
        """The in-process variant ``name``, if measured."""
        return next((v for v in self.variants if v.name == name and not v.skipped), None)


def served_runner(report: Report) -> Variant | None:
    """The in-process variant that runs as the served worker does: on cuda bucketed (with
    graphs where the in-process runner captured them and the served embed worker replayed
    them), on the CPU eager (buckets default off there)."""
    if not report.device.startswith("cuda"):
        return report.variant("eager")
    embed = next((r for r in report.rows if r.workload == "embed"), None)
    replayed = embed is not None and embed.graphs.startswith("replayed")
    graphs = report.variant("CUDA graphs") if replayed else None
    return graphs or report.variant("bucketed")


def targets(report: Report) -> list[Target]:
    """The issue's targets, each with what this run measured."""
    out = [
        _at_least(
            f"first {report.first_s:g} s after ready / steady: {_label(r)}",
            r.first.throughput,
            r.steady.throughput,
            FIRST_FLOOR,
            "req/s",
        )
        for r in report.rows
        if r.first is not None
    ]
    embed, runner = report.row("conveyor", "embed"), served_runner(report)
    if embed is not None and runner is not None:
        fits = [rate for batch, rate in runner.rates.items() if batch <= report.max_batch]
        best = max(fits, default=float("nan"))
        name = (
            f"served embed at {report.top} clients / in-process {runner.name} at its best "
            f"batch up to {report.max_batch}"
        )
        out.append(_at_least(name, embed.throughput, best, SERVED_RATIO, "/s"))
        name = f"served embed at {report.top} clients / {SERVED_BEFORE:,.0f} req/s (H100, before)"
        out.append(_at_least(name, embed.throughput, SERVED_BEFORE, SERVED_GAIN, "req/s"))
    aware, items = report.row("conveyor", "mixed"), report.row("conveyor-items", "mixed")
    if aware is not None and items is not None:
        name = f"mixed at {report.top} clients: length-aware / item-count"
        out.append(_at_least(name, aware.throughput, items.throughput, LENGTH_AWARE_GAIN, "req/s"))
    out += _in_process(report)
    one, several = report.row("conveyor", "echo"), report.row("conveyor", "echo", report.gateways)
    name = f"echo at {report.top} clients: {report.gateways} gateways / 1"
    if one is not None and several is not None:
        out.append(_at_least(name, several.throughput, one.throughput, GATEWAYS_GAIN, "req/s"))
    elif report.gateways_note:
        out.append(Target(name, report.gateways_note, f">= {GATEWAYS_GAIN:.2f}x", False))
    return out


def _in_process(report: Report) -> list[Target]:
    """The in-process runner at its largest batch, buckets (graphs where they win) against
    the eager rate before issue 24, its answers against the CPU's."""
    tuned = [v for v in (report.variant("bucketed"), report.variant("CUDA graphs")) if v]
    if not tuned:
        return []
    top = max(tuned[0].rates)
    best = max(tuned, key=lambda v: v.rates.get(top, 0.0))
    eager = report.variant("eager")
    name = f"in-process {best.name} at batch {top} / {EAGER_BEFORE:,.0f}/s (H100 eager, before)"
    target = _at_least(name, best.rates[top], EAGER_BEFORE, IN_PROCESS_GAIN, "/s")
    if eager is not None and top in eager.rates:
        target.measured += f"; {best.rates[top] / eager.rates[top]:.2f}x this run's eager"
    cosine = best.worst_cosine if best.worst_cosine is not None else float("nan")
    return [
        target,
        Target(
            f"in-process {best.name}: worst cosine to the CPU float32 answer",
            f"{cosine:.6f}",
            f">= {COSINE_FLOOR}",
            cosine >= COSINE_FLOOR,
        ),
    ]


def _at_least(name: str, value: float, base: float, floor: float, unit: str) -> Target:
    ratio = value / base if base > 0 else float("nan")
    measured = f"{value:,.1f} / {base:,.1f} {unit} = {ratio:.2f}x"
    return Target(name, measured, f">= {floor:.2f}x", ratio >= floor)


def _label(r: Served) -> str:
    gateways = f", {r.gateways} gateways" if r.gateways > 1 else ""
    return f"{r.system} {r.workload}, {r.clients} clients{gateways}"


def _verdict(t: Target) -> str:
    return "-" if t.measured.startswith("not measured") else "PASS" if t.passed else "MISS"


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _window_cells(w: Window) -> str:
    util = "-" if w.gpu_util is None else f"{w.gpu_util:.0%}"
    return (
        f"{w.throughput:,.1f} | {_num(w.pct(0.5))} | {_num(w.pct(0.99))} | "
        f"{w.errors}/{w.ok + w.errors} | {w.cpu_ms:.2f} | {w.busy:.0%} | {util}"
    )


def markdown(report: Report) -> str:
    """The whole ``GPU.md``."""
    batches = sorted({b for v in report.variants for b in v.rates})
    lines = [
        "# conveyor on an accelerator (`python -m bench.gpu`)",
        "",
        f"`{report.command}`, {report.started}, {report.wall_s:.0f} s, device "
        f"`{report.device}`, served max batch {report.max_batch}.",
    ]
    if report.quick or not report.device.startswith("cuda"):
        lines += [
            "",
            "**A smoke run** (quick, or not on a GPU): it shows the bench works; the goals "
            "are an H100's, and its figures are not the ones to read.",
        ]
    lines += ["", "## Targets", "", "| target | measured | goal | |", "|---|---|---|---|"]
    lines += [f"| {t.name} | {t.measured} | {t.goal} | {_verdict(t)} |" for t in targets(report)]
    lines += [
        "",
        "## In-process: the embed runner alone",
        "",
        "The built-in `embed` stage's runner (MiniLM, `workers.models.hf:Embedder`), built "
        "as a worker builds it (`build_model`, then `prepare_shapes`: buckets given and "
        "warmed) in this process, timed in sentences/s on the bench's uniform sentences "
        "(4 batches per size cycled, each run once first); cosine against the CPU float32 "
        f"runner on the same {max(batches, default=0)} texts. Each rate is the better of a "
        "serial loop and an overlapped one (batch n+1 prepared in a host thread while n "
        "runs, as the worker does), the loop column says which, per batch size; GPU busy is "
        "the device's share of that loop's time from CUDA events around each launch (`-`: "
        "not cuda). A CUDA graphs row has figures only where its graphs were captured and "
        "replayed (replays counted); else it says why not.",
        "",
        "| runner | dtype | shapes warmed | prepare s | "
        + " | ".join(f"batch {b}" for b in batches)
        + " | worst cosine | loop | GPU busy |",
        "|---|---|---|---|" + "---|" * len(batches) + "---|---|---|",
    ]
    for v in report.variants:
        if v.skipped:
            lines.append(f"| {v.name} | {v.skipped} |" + " |" * (len(batches) + 5))
            continue
        rates = " | ".join(_num(v.rates.get(b), ",.1f") for b in batches)
        loops = " / ".join(v.loops.get(b, "-") for b in batches)
        busy = " / ".join(
            "-" if b not in v.device_busy else f"{v.device_busy[b]:.0%}" for b in batches
        )
        replays = f" ({v.replays:,} replays)" if v.replays else ""
        lines.append(
            f"| {v.name}{replays} | {v.dtype} | {v.shapes} | {v.warm_s:.2f} | {rates} | "
            f"{_num(v.worst_cosine, '.6f')} | {loops} | {busy} |"
        )
    lines += _served(report)
    lines += ["", "## Machine", "", *machine()]
    lines.append(
        f"- Load average (1 min): {report.load_avg[0]:.2f} at the start, "
        f"{report.load_avg[1]:.2f} at the end."
    )
    return "\n".join(lines) + "\n"


def _served(report: Report) -> list[str]:
    lines = [
        "",
        "## Served",
        "",
        "Each system started fresh (redis-server, gateway(s), one worker per stage; "
        "`bench/systems.py`), then driven by closed-loop clients (`bench/loadgen.py`). "
        "`conveyor-items` is the same with `CONVEYOR_MAX_BATCH_TOKENS=0` (batches by item "
        "count). CPU is all the system's processes, Redis included, per request answered; "
        "model busy is the stage's model time over wall time "
        "(`conveyor_stage_run_seconds_sum`, added as each batch is published: a window "
        "can be off by one batch); GPU util is NVML's, sampled (`-`: not read).",
        "",
        f"### From ready: the first {report.first_s:g} s against the steady state after",
        "",
        "| system | workload | clients | first req/s | steady req/s | ratio | first p99 ms | "
        "steady p99 ms | first model busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        if r.first is None:
            continue
        f, s = r.first, r.steady
        ratio = f.throughput / s.throughput if s.throughput else float("nan")
        lines.append(
            f"| {r.system} ({r.gateways} gw) | {r.workload} | {r.clients} | "
            f"{f.throughput:,.1f} | {s.throughput:,.1f} | {_num(ratio, '.2f')} | "
            f"{_num(f.pct(0.99))} | {_num(s.pct(0.99))} | {f.busy:.0%} |"
        )
    lines += [
        "",
        "### Every measurement (steady state)",
        "",
        "| system | gateways | workload | clients | req/s | p50 ms | p99 ms | errors | "
        "CPU ms/req | model busy | GPU util |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(report.rows, key=lambda r: (r.workload, r.system, r.gateways, r.clients))
    lines += [
        f"| {r.system} | {r.gateways} | {r.workload} | {r.clients} | {_window_cells(r.steady)} |"
        for r in order
    ]
    graphs = {(r.system, r.gateways, r.workload): r.graphs for r in order if r.graphs}
    if graphs:
        lines += ["", "CUDA graphs in the served workers (from their logs):", ""]
        lines += [f"- {s} ({g} gw) {w}: {said}" for (s, g, w), said in graphs.items()]
    if report.gateways_note:
        lines += ["", f"Echo with several gateways: {report.gateways_note}."]
    return lines
