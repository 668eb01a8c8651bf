"""Where the time goes per request: py-spy on the gateway and the worker under load.

``python -m bench.profile`` starts conveyor (as ``python -m bench`` does), drives each
scenario with a closed loop, samples the gateway and the worker with py-spy meanwhile,
and writes ``bench/PROFILE.md``: each process's CPU milliseconds per request (from
/proc), split by what the sampled code was doing (the innermost frame's package: HTTP,
FastAPI, pydantic, redis-py, the event loop, the hand-off to the model thread, conveyor's
own code, the model). Needs py-spy (the ``bench`` extra) and permission to trace the
processes it starts (root, or ``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.loadgen import closed_loop
from bench.systems import HOST, Options, cpu_seconds
from bench.systems import conveyor as start_conveyor
from bench.workloads import WORKLOADS, bodies, stage_of

logger = logging.getLogger(__name__)

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("model (torch, transformers, tokenizers)", ("torch", "transformers", "tokenizers")),
    ("HTTP (uvicorn, httptools)", ("uvicorn", "httptools", "h11")),
    ("FastAPI + Starlette", ("fastapi", "starlette")),
    ("pydantic", ("pydantic", "pydantic_core", "pydantic_settings")),
    ("redis-py", ("redis",)),
    ("conveyor gateway/", ("gateway",)),
    ("conveyor workers/", ("workers",)),
    ("conveyor pipelines/", ("pipelines",)),
    ("hand-off to the model thread", ("concurrent", "threading.py", "queue.py")),
    ("logging", ("logging",)),
    ("event loop (asyncio, uvloop)", ("asyncio", "uvloop", "selectors.py")),
]
"""What a sample is charged to, by the top-level package of its innermost frame."""


def category(stack: str) -> str:
    """The category of one py-spy raw stack (``frame;frame;...``), by its innermost frame."""
    leaf = stack.rsplit(";", 1)[-1]
    path = leaf[leaf.rfind("(") + 1 :].rsplit(":", 1)[0]
    head = path.split("/", 1)[0]
    for name, packages in CATEGORIES:
        if head in packages:
            return name
    return "other"


@dataclass
class Sampled:
    """One process's CPU in one scenario.

    Attributes:
        role: ``gateway``, ``worker`` or ``redis``.
        cpu_ms: CPU milliseconds per request (from /proc).
        shares: fraction of py-spy samples per category (empty for Redis).
        leaves: the innermost frames sampled most, with their sample counts.
    """

    role: str
    cpu_ms: float
    shares: dict[str, float] = field(default_factory=dict)
    leaves: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Scenario:
    """One workload at one concurrency, profiled.

    Attributes:
        workload: which workload.
        concurrency: closed-loop clients.
        throughput: requests per second.
        p50_ms: median latency.
        processes: per process.
    """

    workload: str
    concurrency: int
    throughput: float
    p50_ms: float
    processes: list[Sampled]


def read_raw(path: Path) -> Counter[str]:
    """py-spy's raw output: sample counts by stack."""
    counts: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                counts[stack] += int(n)
    return counts


def _record(spy: str, pid: int, seconds: float, output: Path) -> subprocess.Popen[bytes]:
    """Start py-spy sampling ``pid`` for ``seconds`` at 250 Hz into ``output`` (raw format)."""
    command = [spy, "record", "--pid", str(pid), "--duration", f"{seconds:g}", "--rate", "250"]
    command += ["--format", "raw", "--nonblocking", "--output", str(output)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile(workload: str, concurrency: int, seconds: float, workdir: Path) -> Scenario:
    """Start conveyor for ``workload``, load it, and sample its gateway and worker."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with start_conveyor([workload], Options(), workdir, log_name=f"profile-{workload}") as server:
        pids = {
            "gateway": server.procs["gateway"].pid,
            "worker": server.procs[f"worker {stage_of(workload)} 1"].pid,
            "redis": server.procs["redis"].pid,
        }
        outputs = {role: workdir / f"{workload}-c{concurrency}-{role}.txt" for role in pids}
        spies: list[subprocess.Popen[bytes]] = []
        cpu_before: dict[str, float] = {}
        lock = threading.Lock()

        def begin() -> None:  # as the measurement starts, after the warm-up
            with lock:
                for role, pid in pids.items():
                    cpu_before[role] = cpu_seconds([pid])
                    if role == "redis":
                        continue
                    spies.append(_record(spy, pid, seconds, outputs[role]))

        load = asyncio.run(
            closed_loop(
                HOST,
                server.port,
                server.path(workload),
                bodies(100_000, workload),
                concurrency,
                duration=seconds,
                warmup=1.5,
                on_measure=begin,
            )
        )
        cpu_after = {role: cpu_seconds([pid]) for role, pid in pids.items()}
        for proc in spies:
            proc.wait(timeout=seconds + 30)
    ok = max(1, load.requests - load.errors)
    processes = []
    for role in pids:
        sampled = Sampled(role, 1000 * (cpu_after[role] - cpu_before.get(role, 0.0)) / ok)
        counts = read_raw(outputs[role])
        total = sum(counts.values())
        if total:
            by: Counter[str] = Counter()
            leaves: Counter[str] = Counter()
            for stack, n in counts.items():
                by[category(stack)] += n
                leaves[stack.rsplit(";", 1)[-1]] += n
            sampled.shares = {name: n / total for name, n in by.most_common()}
            sampled.leaves = leaves.most_common(8)
        processes.append(sampled)
    return Scenario(workload, concurrency, load.throughput, load.pct(0.5), processes)


def markdown(scenarios: list[Scenario], command: str) -> str:
    """``PROFILE.md``."""
    lines = [
        "# Where the time goes per request",
        "",
        f"Written by `{command}`. Each scenario starts conveyor (redis-server, `python -m "
        "gateway`, one `python -m workers` process), loads it with a closed loop and, "
        "during the measured part, samples the gateway and the worker with py-spy "
        "(250 Hz, idle threads excluded). CPU ms per request is each process's user + "
        "system time from /proc over the requests answered; it is split by the share of "
        "samples whose innermost frame lies in each package. The load generator runs "
        "in the profiling process and is not counted.",
    ]
    for sc in scenarios:
        lines += [
            "",
            f"## {sc.workload}, {sc.concurrency} client(s): {sc.throughput:.0f} req/s, "
            f"p50 {sc.p50_ms:.1f} ms",
            "",
            "| process | CPU ms/req | of which |",
            "|---|---|---|",
        ]
        for p in sc.processes:
            split = ", ".join(
                f"{name} {share * p.cpu_ms:.2f}"
                for name, share in p.shares.items()
                if share >= 0.02
            )
            lines.append(f"| {p.role} | {p.cpu_ms:.2f} | {split or '-'} |")
        total = sum(p.cpu_ms for p in sc.processes)
        lines += [f"| all three | {total:.2f} | |", ""]
        for p in sc.processes:
            if p.leaves:
                top = "; ".join(f"`{leaf}` {n}" for leaf, n in p.leaves[:5])
                lines.append(f"- {p.role}, most sampled frames: {top}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m bench.profile``."""
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument(
        "--scenarios",
        default="echo:1,echo:64,embed:1,embed:64",
        help="workload:clients, comma-separated",
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="sampled time per scenario")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "PROFILE.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    wanted = []
    for item in args.scenarios.split(","):
        workload, _, clients = item.partition(":")
        if workload not in WORKLOADS or not clients.isdigit():
            parser.error(f"bad scenario {item!r}: want WORKLOAD:CLIENTS, WORKLOAD in {WORKLOADS}")
        wanted.append((workload, int(clients)))
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-profile-"))
    logger.info("process logs and raw profiles under %s", workdir)
    scenarios = []
    for workload, clients in wanted:
        sc = profile(workload, clients, args.seconds, workdir)
        logger.info("%s c=%d: %.0f req/s, p50 %.1f ms", workload, clients, sc.throughput, sc.p50_ms)
        scenarios.append(sc)
    command = "python -m bench.profile" + (f" {' '.join(argv)}" if argv else "")
    args.out.write_text(markdown(scenarios, command))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
