"""The ``conveyor`` command: ``up``, ``gateway``, ``worker``, ``status``, ``graph``, ``dlq``.

``up`` supervises separate processes (an embedded redis-server, one gateway, the
workers) exactly as a deployment runs them; ``gateway`` and ``worker`` run one process
each. This module starts them by module name, so it imports neither side.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.dlq import dlq_command
from conveyor.embedded import free_port, start_redis
from pipelines.errors import ConfigError, ConveyorError
from pipelines.redisio import connect, text
from pipelines.registry import Registry, load_registry
from pipelines.settings import CommonSettings
from pipelines.stages import Stage
from pipelines.stats import stage_status


class _Stop(Exception):
    """Raised by the signal handler to end ``up``'s wait."""


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [low, high], else a usage error naming the flag
    (exit 2 before anything starts)."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            within = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is not {within}")
        return value

    return parse


def _seconds(raw: str) -> float:
    """An argparse ``type``: a finite number of seconds above 0."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a finite number of seconds above 0")
    return value


def _run_module(module: str, argv: list[str], env: dict[str, str]) -> None:
    os.environ.update(env)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def worker_groups(registry: Registry, replicas: int | None) -> list[tuple[str, int]]:
    """The worker processes ``up`` starts: (comma-separated stages, copies).

    Each model stage gets its own processes (its ``replicas``, or ``replicas`` when
    given); the function stages, light by nature, share one group.
    """
    model_stages = [s for s in registry.stages.values() if not _is_function(s)]
    groups = [(s.name, replicas or s.replicas) for s in model_stages]
    functions = [s.name for s in registry.stages.values() if _is_function(s)]
    if functions:
        groups.append((",".join(functions), replicas or 1))
    return groups


def _is_function(stage: Stage) -> bool:
    return stage.runner == "workers.models.function:FunctionRunner"


def _up(args: argparse.Namespace) -> int:
    from conveyor import autoscale

    env = dict(os.environ)
    env["CONVEYOR_HOST"] = args.host
    env["CONVEYOR_PORT"] = str(args.port)
    if args.app:
        env["CONVEYOR_APP"] = args.app
    if args.pipelines:
        env["CONVEYOR_PIPELINES"] = args.pipelines
    env.setdefault("HF_HUB_OFFLINE", "1")
    registry = load_registry(env.get("CONVEYOR_APP"), env.get("CONVEYOR_PIPELINES"))
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    autoscaler: autoscale.Autoscaler | None = None
    flags = (args.min_workers, args.max_workers, args.target_backlog)
    if not args.autoscale and any(f is not None for f in flags):
        raise ConfigError("--min-workers, --max-workers and --target-backlog need --autoscale")
    if args.autoscale:
        import logging

        scaling = autoscale.AutoscaleSettings.from_flags(
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            target_backlog=args.target_backlog,
        )
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
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
        scaled = [s for s in registry.stages.values() if args.autoscale and not _is_function(s)]
        for group, copies in worker_groups(registry, args.replicas):
            if group in {s.name for s in scaled}:
                continue  # the autoscaler starts these
            for i in range(copies):
                cmd = [py, "-m", "workers", group]
                children.append((f"worker {group}#{i}", subprocess.Popen(cmd, env=env)))
        if scaled:
            autoscaler = autoscale.Autoscaler(
                {s.name: scaling.scaler(s) for s in scaled},
                lambda stage: subprocess.Popen([py, "-m", "workers", stage], env=env),
                scaling.drain_timeout_s,
            )
        autoscaled = (
            f"; autoscaling {', '.join(s.name for s in scaled)} "
            f"({scaling.min_workers} to {scaling.max_workers} workers each)"
            if scaled
            else ""
        )
        print(
            f"conveyor: gateway on http://{args.host}:{args.port} serving "
            f"{', '.join(registry.pipelines)}; {len(children) - 1} worker process(es)"
            f"{autoscaled}; Ctrl-C stops",
            flush=True,
        )
        if autoscaler is None:
            # Sleep until any child exits (WNOWAIT leaves reaping to Popen) or a signal.
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            name = next((n for n, p in children if info and p.pid == info.si_pid), "redis-server")
            why: str | None = f"{name} exited ({info.si_status if info else '?'})"
        else:
            watched = children + ([("redis-server", redis_proc)] if redis_proc else [])
            why = asyncio.run(
                autoscaler.run(
                    CommonSettings(redis_url=env["CONVEYOR_REDIS_URL"]),
                    interval_s=scaling.interval_s,
                    watch=lambda: next((n for n, p in watched if p.poll() is not None), None),
                )
            )
        if why is not None:  # None: the autoscaler was stopped by Ctrl-C or SIGTERM
            print(f"conveyor: {why}; stopping", flush=True)
            code = 1
    except _Stop:
        pass
    finally:
        if autoscaler is not None:
            children += autoscaler.processes()  # the draining ones too
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
        # Stages that ever had a worker, and those the configured pipelines need.
        known = {text(m) for m in await client.smembers(settings.keys.stages_set())}
        known |= set(load_registry(settings.app, settings.pipelines).stages)
        print(f"{'stage':<24}{'length':>8}{'lag':>8}{'pending':>9}{'consumers':>11}  idle")
        for name in sorted(known):
            st = await stage_status(client, settings.keys, name)
            idle = ", ".join(f"{c['name']}={c['idle_ms']}ms" for c in st.consumers) or "-"
            print(
                f"{name:<24}{st.length:>8}{st.lag:>8}{st.pending:>9}{len(st.consumers):>11}  {idle}"
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
    port = _int_in(0, 65535)
    # A string default goes through ``type`` too: a bad CONVEYOR_PORT is a usage error.
    up.add_argument("--port", type=port, default=os.environ.get("CONVEYOR_PORT", "8000"))
    up.add_argument(
        "--pipelines",
        help="comma-separated pipelines to serve (default: every built-in but echo, "
        "or every pipeline of --app)",
    )
    up.add_argument("--app", help="module:attribute of your Pipeline(s), like `serve run`")
    up.add_argument(
        "--replicas",
        type=_int_in(1, 1000),
        help="worker processes per model stage (with --autoscale: of the function stages)",
    )
    up.add_argument(
        "--autoscale",
        action="store_true",
        help="grow and shrink each model stage's workers with its backlog "
        "(further settings: CONVEYOR_AUTOSCALE_*, see conveyor/autoscale.py)",
    )
    up.add_argument(
        "--min-workers", type=_int_in(0, 1000), help="autoscale: fewest per model stage (1)"
    )
    up.add_argument(
        "--max-workers", type=_int_in(1, 1000), help="autoscale: most per model stage (4)"
    )
    up.add_argument(
        "--target-backlog",
        type=_int_in(1),
        help="autoscale: undelivered + in-flight items per worker (the stage's max batch size)",
    )
    graph = sub.add_parser("graph", help="print a pipeline's graph")
    graph.add_argument("name")
    graph.add_argument("--app", help="module:attribute of your Pipeline(s)")
    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    gw.add_argument("--host")
    gw.add_argument("--port", type=port)
    wk = sub.add_parser("worker", help="run a worker for STAGE (or several: a,b)")
    wk.add_argument("stage")
    sub.add_parser("status", help="per stage: length, lag, pending, consumers, idle")
    dlq = sub.add_parser("dlq", help="dead letters of a stage: list, replay or purge")
    dlq.add_argument("action", choices=["list", "replay", "purge"])
    dlq.add_argument("stage")
    dlq.add_argument("--id", help="only this dead-letter entry")
    dlq.add_argument("--timeout", type=_seconds, default=300.0,
                     help="deadline of a replayed request, seconds from now")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
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
        elif args.command == "graph":
            app = args.app or os.environ.get("CONVEYOR_APP")
            print(load_registry(app, args.name).pipeline(args.name).describe())
        elif args.command == "dlq":
            sys.exit(asyncio.run(dlq_command(args.action, args.stage, args.id, args.timeout)))
        else:
            sys.exit(asyncio.run(_status_async()))
    except ConveyorError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        sys.exit(2)
    except ResponseError as exc:  # a command Redis refused: its reason is the message
        print(f"conveyor: Redis refused the command: {exc}", file=sys.stderr)
        sys.exit(2)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        url = os.environ.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0 (the default)")
        print(
            f"conveyor: cannot reach Redis at {url}: {exc}. Set CONVEYOR_REDIS_URL "
            "(`conveyor up` prints the URL of its embedded Redis).",
            file=sys.stderr,
        )
        sys.exit(2)
