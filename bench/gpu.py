"""``python -m bench.gpu``: conveyor on an accelerator, in one command; writes ``bench/GPU.md``.

Two sections, then the issue's targets with PASS/MISS (:mod:`bench.gpu_report`):

- in-process (:mod:`bench.gpu_model`): the embed runner alone, eager, bucketed and (with
  ``--graphs``) with CUDA graphs, at batch 1, 32 and 128, with the worst cosine of its
  answers to the CPU's float32 ones;
- served (:mod:`bench.gpu_served`): conveyor started fresh, echo, embed and mixed at 1, 64
  and 256 clients, the first 10 s after ready reported apart from the steady state; mixed
  also with item-count batching, echo also with several gateways (on 8 cores or more).

Under 5 minutes on one GPU. ``--device cpu --quick`` is the smoke run CI takes (about a
minute on two cores): smaller batches, fewer clients, windows of seconds; it writes
``bench/quick/GPU.md`` (not committed), as does any run that is not a full one on cuda.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_model import GRAPHS_ENV, graphs_skipped, measure
from bench.gpu_report import Report, markdown
from bench.gpu_served import Session, Timing, serve
from bench.systems import Options
from pipelines.stages import BUILTIN

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
CORES_PER_GATEWAY = 2
"""Echo with N gateways runs only on 2N cores or more: with fewer, the gateways, the worker,
Redis and the load generator share the cores, and the figure says more of the host."""


@dataclass(frozen=True)
class Scale:
    """How much one run measures.

    Attributes:
        batches: in-process batch sizes.
        batch_s: seconds per in-process batch size.
        served: the served section's clients and windows.
    """

    batches: list[int]
    batch_s: float
    served: Timing


FULL = Scale([1, 32, 128], 2.5, Timing([1, 64, 256], 10.0, 8.0, 1.0, 4.0))
QUICK = Scale([1, 4, 16], 0.5, Timing([1, 8], 2.0, 3.0, 0.5, 2.0))


def default_device() -> str:
    """``cuda`` where torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    add = p.add_argument
    add("--device", default=None, help="cuda, cuda:N or cpu (default auto: cuda if available)")
    add(
        "--quick",
        action="store_true",
        help=f"smoke run: in-process batches {QUICK.batches}, clients {QUICK.served.clients}, "
        f"windows of {QUICK.served.first_s:g}/{QUICK.served.steady_s:g} s",
    )
    add(
        "--graphs",
        action="store_true",
        help=f"also measure CUDA graphs (the worker's {GRAPHS_ENV}, where it has one)",
    )
    add(
        "--gateways",
        type=int,
        default=4,
        help="echo with this many gateways too, against one (default 4; run on "
        f"{CORES_PER_GATEWAY}x as many cores or more)",
    )
    add(
        "--max-batch",
        type=int,
        default=BUILTIN["embed"].max_batch_size,
        help="the served stages' max batch (default: the embed stage's, "
        f"{BUILTIN['embed'].max_batch_size})",
    )
    add(
        "--out",
        type=Path,
        default=None,
        help="the report (default bench/GPU.md for a full run on cuda, else bench/quick/GPU.md)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, write the report, print it."""
    p = parser()
    args = p.parse_args(argv)
    if args.gateways < 1 or args.max_batch < 1:
        p.error("--gateways and --max-batch must be at least 1")
    # SIGTERM unwinds like Ctrl-C, so every process this run started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The tokenizers' thread pool would contend with the runner's host threads, here and in
    # the served processes (which inherit it), as `conveyor up` sets it for its children.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe
    device: str = default_device() if args.device in (None, "auto") else args.device
    scale = QUICK if args.quick else FULL
    full_on_gpu = device.startswith("cuda") and not args.quick
    out: Path = args.out or HERE / ("GPU.md" if full_on_gpu else "quick/GPU.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.gpu" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    report = Report(
        command, device, scale.served.first_s, args.max_batch, args.gateways, quick=args.quick
    )
    began, load_start = time.monotonic(), os.getloadavg()[0]
    report.variants = measure(
        device, scale.batches, scale.batch_s, graphs=args.graphs, quick=args.quick
    )
    graphs = not graphs_skipped(device, args.graphs)
    options = Options(
        device=device, max_batch=args.max_batch, env={GRAPHS_ENV: "true"} if graphs else {}
    )
    report.sessions = [Session("conveyor", ("mixed", "embed", "echo"))]
    report.sessions.append(Session("conveyor-items", ("mixed",)))
    cores = len(os.sched_getaffinity(0))
    if args.gateways > 1 and cores >= CORES_PER_GATEWAY * args.gateways:
        report.sessions.append(Session("conveyor", ("echo",), args.gateways))
    elif args.gateways > 1:
        report.gateways_note = (
            f"not measured: {cores} cores, {CORES_PER_GATEWAY * args.gateways} wanted "
            f"for {args.gateways} gateways"
        )
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpu-"))
    logger.info("process logs under %s", workdir)
    report.rows = serve(report.sessions, scale.served, options, workdir)
    report.wall_s = time.monotonic() - began
    report.load_avg = (load_start, os.getloadavg()[0])
    text = markdown(report)
    out.write_text(text)
    print(text)
    print(f"\nwrote {out} in {report.wall_s:.0f} s")


if __name__ == "__main__":
    main()
