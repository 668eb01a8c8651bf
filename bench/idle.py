"""What idling costs the model itself: one item back to back, and after a pause.

``python -m bench.idle`` times ``embed``'s single-item ``predict`` in a fresh process per
OpenMP wait policy (``PASSIVE`` alone: idle threads sleep at once; ``PASSIVE`` with
``GOMP_SPINCOUNT``: they look for work a little first, conveyor's default; ``ACTIVE``: they
spin, ``CONVEYOR_SPIN_WAIT=true``; unset: libgomp's own default, a longer spin, which is
what the benchmark's in-process loop runs under) and torch thread count,
called back to back and after ``--gap-ms`` of sleep, the way a served request at
concurrency 1 finds the worker. It prints a Markdown table: the c=1 gap in RESULTS.md is
partly this, a cost a back-to-back in-process loop never pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from workers.settings import WorkerSettings

POLICIES: tuple[tuple[str, str], ...] = (
    ("PASSIVE", ""),
    ("PASSIVE", str(WorkerSettings.model_fields["openmp_spin_count"].default)),
    ("ACTIVE", ""),
    ("", ""),
)
"""(OMP_WAIT_POLICY, GOMP_SPINCOUNT); "" leaves the variable unset."""


def measure(workload: str, threads: int, gap_s: float, calls: int) -> dict[str, float]:
    """Median ms of one single-item ``predict``, back to back and after ``gap_s`` idle."""
    import torch

    from bench.workloads import items, load_model

    torch.set_num_threads(threads)
    model = load_model(workload)
    corpus = items(64)
    for item in corpus[:20]:  # warm-up: first calls allocate
        model.predict([item])
    out = {}
    for name, pause in (("busy", 0.0), ("idle", gap_s)):
        times = []
        for i in range(calls):
            if pause:
                time.sleep(pause)  # the idle gap is what is measured, not a wait for an event
            started = time.perf_counter()
            model.predict([corpus[i % len(corpus)]])
            times.append(time.perf_counter() - started)
        out[name] = 1000 * statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run each policy and thread count in its own process; print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__)
    parser.add_argument("--workload", default="embed")
    parser.add_argument("--threads", default="1,2", help="torch threads, comma-separated")
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "threads": measure and print
    args = parser.parse_args(argv)
    if args.child:
        result = measure(args.workload, int(args.child), args.gap_ms / 1000, args.calls)
        print(json.dumps(result))
        return
    print(
        f"{args.workload}: median ms of one single-item call, back to back and after "
        f"{args.gap_ms:g} ms idle, per OpenMP wait policy and torch thread count\n"
    )
    print(
        "| OMP_WAIT_POLICY | GOMP_SPINCOUNT | torch threads | back to back | after idle | "
        "idle costs |"
    )
    print("|---|---|---|---|---|---|")
    flags = ["--workload", args.workload, "--gap-ms", str(args.gap_ms), "--calls", str(args.calls)]
    for threads in (int(t) for t in args.threads.split(",")):
        for policy, spin_count in POLICIES:
            env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
            for name, value in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spin_count)):
                env.pop(name, None)
                if value:
                    env[name] = value
            command = [sys.executable, "-m", "bench.idle", "--child", str(threads), *flags]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"| {policy or 'unset (libgomp default)'} | {spin_count or 'unset'} | "
                f"{threads} | {r['busy']:.2f} | {r['idle']:.2f} | "
                f"{r['idle'] - r['busy']:+.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
