"""Memory of the default stack: ``conveyor up`` started, its processes' RSS summed.

``python -m bench.rss`` starts ``conveyor up`` (the built-in pipelines unless ``--`` passes
other flags: ``python -m bench.rss -- --pipelines embed``), waits for its ``ready:`` line
(every stage's workers have loaded their models), reads every process of the stack (``up``
itself and all its descendants: redis-server, the gateway, each worker) from ``/proc``,
prints RSS and PSS per process and the totals, and stops the stack. RSS counts pages
shared between processes (the Python runtime, torch's libraries) once per process, as
``ps`` and the issue's target do; PSS divides each shared page among its sharers, so its
total is what the stack really holds.

Linux only (``/proc``). Run it on an otherwise quiet machine: the figures do not depend on
load, but loading the models takes longer on a busy one (``--timeout``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conveyor.embedded import free_port


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (depth first), read from ``/proc/*/stat``."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: list[int] = []
    todo = [pid]
    while todo:
        here = todo.pop()
        kids = sorted(p for p, pp in parent.items() if pp == here)
        out += kids
        todo += kids
    return out


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in KiB."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif line.startswith("Pss:"):
            pss = int(line.split()[1])
    return rss, pss


def command(pid: int) -> str:
    """The process's command line, shortened to what names it."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [a.decode(errors="replace") for a in argv if a]
    if words and Path(words[0]).name.startswith("python"):
        words = words[1:]
    return " ".join(words)[:70]


def measure(argv: list[str], timeout_s: float) -> int:
    """Start ``conveyor up`` with ``argv``, print its memory once ready, stop it."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    env.pop("CONVEYOR_REDIS_URL", None)  # its own embedded redis: part of the stack
    args = [sys.executable, "-m", "conveyor", "up", "--port", str(port), *argv]
    up = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert up.stdout is not None
    started = time.monotonic()
    try:
        for raw in up.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith("conveyor: "):
                print(line, flush=True)
            if "conveyor: ready:" in line:
                break
            if time.monotonic() - started > timeout_s:
                print(f"not ready after {timeout_s:g}s", file=sys.stderr)
                return 1
        else:
            print("conveyor up exited before it was ready", file=sys.stderr)
            return 1
        print(f"ready after {time.monotonic() - started:.1f}s\n")
        total_rss = total_pss = 0
        print(f"{'pid':>7} {'RSS MiB':>8} {'PSS MiB':>8}  process")
        for pid in [up.pid, *children(up.pid)]:
            try:
                rss, pss = memory_kib(pid)
                name = command(pid)
            except OSError:
                continue
            total_rss += rss
            total_pss += pss
            print(f"{pid:>7} {rss / 1024:>8.0f} {pss / 1024:>8.0f}  {name}")
        print(f"{'total':>7} {total_rss / 1024:>8.0f} {total_pss / 1024:>8.0f}")
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def main() -> None:
    """Entry point: ``python -m bench.rss [--timeout S] [-- UP_FLAGS...]``."""
    parser = argparse.ArgumentParser(prog="python -m bench.rss", description=__doc__)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to be ready")
    parser.add_argument("up_flags", nargs="*", help="flags for conveyor up (after --)")
    args = parser.parse_args()
    sys.exit(measure(args.up_flags, args.timeout))


if __name__ == "__main__":
    main()
