"""``python -m bench``: start, drive and stop every system; write RESULTS.md and results.png.

Systems: conveyor (redis-server + gateway + worker processes), the same conveyor with
item-count batching only, the model in-process (the limit), FastAPI + Celery + Redis with
one task per request, one FastAPI process with an asyncio queue and a dynamic-batching
loop, and LitServe. Workloads: ``echo`` (no model), ``embed`` (the real MiniLM on uniform
sentences), ``mixed`` (the same model on texts of long-tailed length, bench/mixed.jsonl)
and ``synthetic`` (sleeps a + b·n per batch, like an accelerator). Everything binds
127.0.0.1 and is stopped when the run ends, however it ends.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from bench.report import markdown, plot, version
from bench.run import SYSTEMS, Plan, Results, run
from bench.systems import Options
from bench.workloads import WORKLOADS

HERE = Path(__file__).resolve().parent
FULL = {"requests": 3000, "seconds": 8.0, "warmup": 1.5}
QUICK = {"requests": 100, "seconds": 0.6, "warmup": 0.1}


def _list(value: str, known: tuple[str, ...]) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(known)}")
    return chosen


def _ints(value: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list") from None
    if any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"{value!r}: every number must be >= 1")
    return numbers


def _pair(value: str) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not 'a_ms,b_ms'") from None
    return a, b


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    add = p.add_argument
    add(
        "--quick",
        action="store_true",
        help="smoke run (about 2 minutes): few requests per measurement, clients 1 and 64, "
        "scaling 1 and 2 workers; writes to bench/quick/ unless --out is given",
    )
    add(
        "--systems",
        type=lambda v: _list(v, SYSTEMS),
        default=list(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    add(
        "--workloads",
        type=lambda v: _list(v, WORKLOADS),
        default=list(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)}",
    )
    add(
        "--concurrency",
        type=_ints,
        default=None,
        help="closed-loop clients, comma-separated (default 1,16,64)",
    )
    add(
        "--requests",
        type=int,
        default=None,
        help=f"most requests per measurement (default {FULL['requests']})",
    )
    add(
        "--seconds",
        type=float,
        default=None,
        help=f"most seconds per measurement (default {FULL['seconds']:g})",
    )
    add(
        "--warmup",
        type=float,
        default=None,
        help=f"seconds of unmeasured load before each measurement ({FULL['warmup']:g})",
    )
    add(
        "--scale-workers",
        type=lambda v: _ints(v) if v else [],
        default=None,
        help="conveyor worker counts for the synthetic scaling sweep (default 1,2,4,8; "
        "'' skips it)",
    )
    add(
        "--clients-per-worker",
        type=int,
        default=64,
        help="clients per worker in the scaling sweep (default 64: two full batches)",
    )
    add(
        "--batch",
        type=int,
        default=32,
        help="max batch of conveyor and of the asyncio batcher; in-process batch (32)",
    )
    add(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="batch window of the asyncio batcher (conveyor's stages use 5 ms)",
    )
    add(
        "--celery-pool",
        default="solo",
        choices=("solo", "prefork", "threads"),
        help="Celery worker pool (default solo: one process, one task at a time)",
    )
    add("--celery-concurrency", type=int, default=1, help="Celery worker concurrency (default 1)")
    add(
        "--litserve-batch-timeout-ms",
        type=float,
        default=10.0,
        help="LitServe's batch_timeout (default 10 ms; its max_batch_size is --batch)",
    )
    add("--device", default="auto", help="model device for every system: auto, cpu, cuda")
    add("--synthetic-a-ms", type=float, default=20.0, help="synthetic: ms per batch (20)")
    add("--synthetic-b-ms", type=float, default=1.0, help="synthetic: ms per item (1)")
    add(
        "--scale-cost-ms",
        type=_pair,
        default=None,
        help="synthetic's a,b in the scaling sweep (default 250,10: 8 workers' ideal "
        "450 req/s stays under half of what 2 cores can serve; 60,2 with --quick)",
    )
    add(
        "--embed-threads",
        type=lambda v: _ints(v) if v else [],
        default=[1],
        help="also measure embed with torch held to these thread counts, in-process and "
        "on conveyor at the top concurrency (default 1, as the issue's figures; '' skips)",
    )
    add(
        "--out",
        type=Path,
        default=None,
        help="where RESULTS.md and results.png go (default bench/, bench/quick/ with --quick)",
    )
    return p


def plan_from(args: argparse.Namespace) -> Plan:
    """The run the arguments ask for (``--quick`` changes only the defaults)."""
    sizes = QUICK if args.quick else FULL
    env = {
        "BENCH_SYNTHETIC_A_MS": f"{args.synthetic_a_ms:g}",
        "BENCH_SYNTHETIC_B_MS": f"{args.synthetic_b_ms:g}",
    }
    os.environ.update(env)  # this process's in-process synthetic model reads them too
    quick_scale = [1, 2] if args.quick else [1, 2, 4, 8]
    return Plan(
        systems=args.systems,
        workloads=args.workloads,
        concurrencies=args.concurrency or ([1, 64] if args.quick else [1, 16, 64]),
        requests=args.requests or int(sizes["requests"]),
        seconds=args.seconds or sizes["seconds"],
        warmup_s=args.warmup if args.warmup is not None else sizes["warmup"],
        scale_workers=quick_scale if args.scale_workers is None else args.scale_workers,
        scale_clients_per_worker=args.clients_per_worker,
        scale_cost_ms=args.scale_cost_ms or ((60.0, 2.0) if args.quick else (250.0, 10.0)),
        embed_threads=args.embed_threads,
        options=Options(
            device=args.device,
            max_batch=args.batch,
            batch_wait_ms=args.batch_wait_ms,
            celery_pool=args.celery_pool,
            celery_concurrency=args.celery_concurrency,
            litserve_batch_timeout_ms=args.litserve_batch_timeout_ms,
            env=env,
        ),
    )


def describe(res: Results) -> str:
    """What each system is, with this run's settings (markdown)."""
    o, plan = res.plan.options, res.plan
    a, b = (float(o.env.get(f"BENCH_SYNTHETIC_{k}_MS", d)) for k, d in (("A", 20), ("B", 1)))
    sa, sb = plan.scale_cost_ms
    sweep = ", ".join(map(str, plan.scale_workers)) or "none"
    most = max(plan.scale_workers, default=8)

    def ideal(a_ms: float, b_ms: float) -> float:
        return o.max_batch / ((a_ms + b_ms * o.max_batch) / 1000)

    return f"""
Every system runs the same model code (`bench/workloads.py:load_model`) on the same inputs
(`{{"text": ...}}`: sentences of 8-24 words for echo, embed and synthetic; for mixed the
3,000 texts of `bench/mixed.jsonl`, 3-300 words, median 15), device `{o.device}`, torch's
default threads. `mixed` is served by each system's `embed` model (`/v1/embed`). The load
generator (`bench/loadgen.py`) is a closed loop of keep-alive HTTP/1.1 clients in this
process; every server binds 127.0.0.1.

- **conveyor**: redis-server, `python -m gateway` and one `python -m workers STAGE`
  process per stage (`CONVEYOR_APP=bench.workloads:conveyor_pipelines`: built-in
  `echo` and `embed`, and `bench.synthetic:pipelines`); max batch {o.max_batch}, 5 ms
  window, adaptive batching on, 2 batches in flight per worker, torch's idle OpenMP
  threads sleeping instead of spinning, `embed` batching by length (its
  `max_batch_tokens`): the defaults. Mean batch from the gateway's `/metrics`
  (`conveyor_stage_batch_size_sum/_count`), padding from its
  `conveyor_stage_tokens_total{{kind="real"|"padded"}}`.
- **conveyor, item-count batching**: the same, every worker started with
  `CONVEYOR_MAX_BATCH_TOKENS=0` (batches bounded by item count only), measured on embed
  and mixed. It runs beside the default conveyor, the two measured in alternation, so
  their ratio is taken in the same minutes.
- **in-process model**: `predict` called directly in this process, at batch
  {o.max_batch} for throughput and at batch 1 for single-item latency: the ceiling.
- **FastAPI + Celery**: redis-server as broker and result backend; `celery worker
  --pool={o.celery_pool} --concurrency={o.celery_concurrency}` (one model copy: a second
  process would hold a second copy and, on CPU, split the same cores); a uvicorn FastAPI
  app (`bench/celery_app.py`) whose endpoint sends one task per request (`.delay()`)
  and waits with `AsyncResult.get` in a thread pool; the task runs the model on one
  item. Mean batch is 1 by construction.
- **FastAPI + asyncio batching**: one uvicorn process (`bench/hf_batching.py`): requests
  put (item, future) on an `asyncio.Queue`; a loop per model takes up to {o.max_batch}
  items or what arrives within {o.batch_wait_ms:g} ms of the first, runs `predict` in a
  thread, resolves the futures. Mean batch and padding from its own counters (`GET
  /stats`; tokens from the attention mask of each batch it tokenizes).
- **LitServe** {version("litserve")}: `bench/litserve_app.py`, one `LitAPI` per stage
  with `max_batch_size={o.max_batch}`, `batch_timeout={o.litserve_batch_timeout_ms / 1000:g}`
  s, one inference worker (`workers_per_device=1`) and one API server
  (`num_api_servers=1`), otherwise LitServe's defaults (multiprocessing queues through a
  manager process). Started afresh per stage (an idle inference worker polls its queue
  every millisecond). CPU counts the launcher and all its processes. Mean batch and
  padding from counters its workers keep in shared memory (`GET /stats`).

synthetic sleeps {a:g} ms + {b:g} ms per item for each batch (`time.sleep` releases the
CPU, like waiting on an accelerator). The scaling sweep starts its own conveyor (one
gateway) and adds synthetic workers ({sweep}), {plan.scale_clients_per_worker} clients per
worker, at a heavier {sa:g} ms + {sb:g} ms: {most} workers then need at most
{most * ideal(sa, sb):.0f} req/s, where at {a:g} + {b:g} ms they would need
{most * ideal(a, b):.0f} req/s, more than the serving path's CPU can carry on a small
machine (see echo): the sweep is meant to show how work spreads over workers, not the
CPU ceiling.
"""


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, write the report and the chart, print the targets."""
    args = parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every process this run started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe
    plan = plan_from(args)
    needed = ["matplotlib", *(s for s in ("celery", "litserve") if s in plan.systems)]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"python -m bench needs {', '.join(missing)}: install the bench extra, e.g. "
            "`.venv/bin/pip install torch==2.13.0 -e '.[dev,bench]'`"
        )
    out: Path = args.out or (HERE / "quick" if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    results = run(plan)
    command = "python -m bench" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    text = markdown(results, command, describe(results), smoke=args.quick)
    (out / "RESULTS.md").write_text(text)
    plot(results, out / "results.png")
    print(text)
    print(f"\nwrote {out / 'RESULTS.md'} and {out / 'results.png'}")


if __name__ == "__main__":
    main()
