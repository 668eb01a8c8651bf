"""The ``conveyor`` command: ``up``, ``gateway``, ``worker``, ``status``.

``up`` supervises separate processes (an embedded redis-server, one gateway, the
workers) exactly as a deployment runs them; ``gateway`` and ``worker`` run one process
each. This module starts them by module name, so it imports neither side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from pipelines.embedded import free_port, start_redis
from pipelines.errors import ConveyorError
from pipelines.redisio import connect, text
from pipelines.settings import CommonSettings
from pipelines.stages import BUILTIN, parse_stage_list
from pipelines.stats import stage_status


class _Stop(Exception):
    """Raised by the signal handler to end ``up``'s wait."""


def _run_module(module: str, argv: list[str], env: dict[str, str]) -> None:
    os.environ.update(env)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _up(args: argparse.Namespace) -> int:
    stages = parse_stage_list(args.pipelines)
    env = dict(os.environ)
    env["CONVEYOR_HOST"] = args.host
    env["CONVEYOR_PORT"] = str(args.port)
    env["CONVEYOR_PIPELINES"] = ",".join(s.name for s in stages)
    env.setdefault("HF_HUB_OFFLINE", "1")
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    redis_proc = None
    if not env.get("CONVEYOR_REDIS_URL"):
        port = free_port()
        workdir = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
        redis_proc = start_redis(port, workdir)
        env["CONVEYOR_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        print(f"conveyor: embedded redis on 127.0.0.1:{port} ({workdir})", flush=True)

    def _stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    code = 0
    try:
        py = sys.executable
        children.append(("gateway", subprocess.Popen([py, "-m", "gateway"], env=env)))
        for stage in stages:
            for i in range(args.replicas):
                cmd = [py, "-m", "workers", stage.name]
                children.append((f"worker {stage.name}#{i}", subprocess.Popen(cmd, env=env)))
        print(
            f"conveyor: gateway on http://{args.host}:{args.port} serving "
            f"{', '.join(s.name for s in stages)} ({args.replicas} worker(s) each); Ctrl-C stops",
            flush=True,
        )
        # Sleep until any child exits (WNOWAIT leaves reaping to Popen) or a signal.
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        name = next((n for n, p in children if info and p.pid == info.si_pid), "redis-server")
        print(f"conveyor: {name} exited ({info.si_status if info else '?'}); stopping", flush=True)
        code = 1
    except _Stop:
        pass
    finally:
        for _, proc in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _, proc in children:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
    return code


async def _status_async() -> int:
    settings = CommonSettings()
    client = connect(settings)
    try:
        known = {text(m) for m in await client.smembers(settings.keys.stages_set())}
        names = sorted(known | set(os.environ.get("CONVEYOR_PIPELINES", "").split(",")) - {""})
        print(f"{'stage':<14}{'length':>8}{'lag':>8}{'pending':>9}{'consumers':>11}  idle")
        for name in names or sorted(BUILTIN):
            st = await stage_status(client, settings.keys, name)
            idle = ", ".join(f"{c['name']}={c['idle_ms']}ms" for c in st.consumers) or "-"
            print(
                f"{name:<14}{st.length:>8}{st.lag:>8}{st.pending:>9}{len(st.consumers):>11}  {idle}"
            )
    finally:
        await client.aclose()
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``conveyor`` console script."""
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="embedded redis (unless CONVEYOR_REDIS_URL), gateway, workers")
    up.add_argument("--host", default=os.environ.get("CONVEYOR_HOST", "127.0.0.1"))
    up.add_argument("--port", type=int, default=int(os.environ.get("CONVEYOR_PORT", "8000")))
    up.add_argument(
        "--pipelines",
        default=os.environ.get("CONVEYOR_PIPELINES"),
        help="comma-separated stages (default: "
        + ",".join(s.name for s in parse_stage_list(None))
        + ")",
    )
    up.add_argument("--replicas", type=int, default=1, help="workers per stage")
    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    gw.add_argument("--host")
    gw.add_argument("--port", type=int)
    wk = sub.add_parser("worker", help="run one worker for STAGE")
    wk.add_argument("stage")
    sub.add_parser("status", help="per stage: length, lag, pending, consumers, idle")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            if args.replicas < 1:
                parser.error("--replicas must be >= 1")
            sys.exit(_up(args))
        elif args.command == "gateway":
            env = {
                k: str(v)
                for k, v in (("CONVEYOR_HOST", args.host), ("CONVEYOR_PORT", args.port))
                if v is not None
            }
            _run_module("gateway", [], env)
        elif args.command == "worker":
            _run_module("workers", [args.stage], {})
        else:
            sys.exit(asyncio.run(_status_async()))
    except ConveyorError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        sys.exit(2)
