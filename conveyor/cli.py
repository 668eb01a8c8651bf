"""The ``conveyor`` command: ``up``, ``gateway``, ``worker``, ``status``, ``graph``, ``dlq``,
``keda``, ``init`` (:mod:`conveyor.init`).

``up`` supervises separate processes (an embedded redis-server, the gateway(s), the
workers) exactly as a deployment runs them (:mod:`conveyor.stack`); ``gateway`` and
``worker`` run one process each (``gateway`` with ``CONVEYOR_GATEWAYS`` above 1: that
many gateway processes on one port, supervised). Both start them by module name, so
neither imports the gateway or the workers.

Every command takes ``--app module:attribute`` (else ``CONVEYOR_APP``) the same way
(:mod:`conveyor.appflag`): ``conveyor worker STAGE --app mymodule:pipeline``, run in the
folder of ``mymodule.py``, serves that app's stage beside the workers ``up`` started.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import runpy
import sys
from collections.abc import Callable
from dataclasses import fields
from importlib import metadata
from pathlib import Path

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor import init as scaffold
from conveyor import stack
from conveyor.appflag import add_app_argument, use_app
from conveyor.deploy import cli as deploy_files
from conveyor.dlq import dlq_command
from conveyor.extras import require_serve
from conveyor.keda import TriggerOptions, triggers
from pipelines.errors import ConveyorError
from pipelines.keys import LANES
from pipelines.registry import load_registry
from pipelines.settings import DEFAULT_REDIS_URL, CommonSettings, load_settings, redact_url
from runtime.redisio import connect
from runtime.status import StageStatus, known_stages, stage_status

GATEWAYS_HELP = (
    "gateway processes on the one port (SO_REUSEPORT: the kernel spreads connections); "
    "default CONVEYOR_GATEWAYS, else 1"
)


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


def status_table(statuses: list[StageStatus]) -> str:
    """``conveyor status``'s table: a row per stage, its totals (both lanes), its live
    workers (their heartbeats) of its consumers, then each lane's ``lag/pending``, then
    each consumer, ``name=alive`` or ``name=gone``, and Redis's idle time."""
    lanes = "".join(f"{lane:>13}" for lane in LANES)
    rows = [f"{'stage':<24}{'length':>8}{'lag':>8}{'pending':>9}{'live/all':>11}{lanes}  workers"]
    for st in statuses:
        idle = (
            ", ".join(
                f"{c.name}={'alive' if c.alive else 'gone'} (idle {c.idle_ms}ms)"
                for c in st.consumers
            )
            or "-"
        )
        parts = "".join(f"{f'{st.lane(lane).lag}/{st.lane(lane).pending}':>13}" for lane in LANES)
        rows.append(
            f"{st.stage:<24}{st.length:>8}{st.lag:>8}{st.pending:>9}"
            f"{f'{st.workers}/{len(st.consumers)}':>11}"
            f"{parts}  {idle}"
        )
    return "\n".join(rows)


async def _status_async() -> int:
    settings = load_settings(CommonSettings)
    client = connect(settings)
    try:
        configured = load_registry(settings.app, settings.pipelines).stages
        # An app's own stages only; without one, the built-ins and every stage that ever
        # had a worker in this namespace.
        known = (
            sorted(configured)
            if settings.app
            else await known_stages(client, settings.keys, configured)
        )
        statuses = [await stage_status(client, settings.keys, name) for name in known]
        if settings.partitions > 1:
            print(f"{settings.partitions} partitions; each row sums them")
        print(status_table(statuses))
    finally:
        await client.aclose()
    return 0


def _version() -> str:
    """The installed distribution's version (a source tree never installed has none)."""
    try:
        return metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``conveyor`` console script."""
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    parser.add_argument("--version", action="version", version=f"conveyor {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="embedded redis (unless CONVEYOR_REDIS_URL), gateway, workers")
    # Unset: the gateway's settings (CONVEYOR_HOST, CONVEYOR_PORT), checked as it checks them.
    up.add_argument("--host")
    port = _int_in(0, 65535)
    up.add_argument("--port", type=port)
    up.add_argument(
        "--pipelines",
        help="comma-separated pipelines to serve (default: every built-in but echo, "
        "or every pipeline of --app)",
    )
    add_app_argument(up)
    up.add_argument("--gateways", type=_int_in(1, 256), help=GATEWAYS_HELP)
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
    up.add_argument(
        "--ephemeral",
        action="store_true",
        help="the embedded redis keeps nothing (default: its append-only file in "
        "CONVEYOR_DATA_DIR, .conveyor/, so a stopped or killed up resumes its work)",
    )
    up.add_argument(
        "--reload",
        action="store_true",
        help="watch the app folder's .py files; restart the workers (and the gateway, "
        "when routes change) that run what changed",
    )
    init = sub.add_parser("init", help="write a working app folder to start from")
    init.add_argument("folder", nargs="?", default=".", help="where (default: here)")
    init.add_argument("--force", action="store_true", help="overwrite files that exist")
    graph = sub.add_parser("graph", help="print a pipeline's graph")
    graph.add_argument("name")
    add_app_argument(graph)
    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    gw.add_argument("--host")
    gw.add_argument("--port", type=port)
    gw.add_argument("--gateways", type=_int_in(1, 256), help=GATEWAYS_HELP)
    add_app_argument(gw)
    wk = sub.add_parser("worker", help="run a worker for STAGE (or several: a,b)")
    wk.add_argument("stage")
    add_app_argument(wk)
    status = sub.add_parser(
        "status",
        help="per stage: length, lag, pending, consumers, each lane's lag/pending, idle",
    )
    add_app_argument(status)
    keda = sub.add_parser(
        "keda", help="a stage's KEDA triggers: lag and pending of every lane and partition"
    )
    keda.add_argument("stage")
    keda.add_argument(
        "--address",
        default="redis.conveyor.svc.cluster.local:6379",
        help="Redis host:port as KEDA reaches it (a cluster: node,node,...)",
    )
    keda.add_argument(
        "--target",
        type=_int_in(1),
        default=64,
        help="entries per worker (max_batch_size x max_concurrent_batches)",
    )
    keda.add_argument("--auth", default="conveyor-redis-keda", help="TriggerAuthentication")
    add_app_argument(keda)
    dlq = sub.add_parser("dlq", help="dead letters of a stage: list, replay or purge")
    dlq.add_argument("action", choices=["list", "replay", "purge"])
    dlq.add_argument("stage")
    dlq.add_argument("--id", help="only this dead-letter entry (its id in each partition)")
    dlq.add_argument(
        "--timeout",
        type=_seconds,
        default=300.0,
        help="deadline of a replayed request, seconds from now",
    )
    dlq.add_argument(
        "--force",
        action="store_true",
        help="replay even when no worker serves the stage (the letters wait for one)",
    )
    add_app_argument(dlq)
    deploy_files.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        # --app (add_app_argument) names the app for this command and every process it
        # starts; CONVEYOR_APP from here on.
        app = use_app(getattr(args, "app", None))
        require_serve(args.command)  # up, gateway, worker: the `serve` extra, or one line
        if args.command == "up":
            # Each of up's flags is named as the option it sets.
            given = {f.name: getattr(args, f.name) for f in fields(stack.UpOptions)}
            sys.exit(stack.up(stack.UpOptions(**given | {"app": app})))
        elif args.command == "gateway":
            flags = (
                ("CONVEYOR_HOST", args.host),
                ("CONVEYOR_PORT", args.port),
                ("CONVEYOR_GATEWAYS", args.gateways),
            )
            env = {k: str(v) for k, v in flags if v is not None}
            os.environ.update(env)
            if stack.gateway_count() > 1:
                sys.exit(stack.gateways(dict(os.environ)))
            _run_module("gateway", [], env)
        elif args.command == "worker":
            _run_module("workers", [args.stage], {})
        elif args.command == "init":
            written = scaffold.init(Path(args.folder), force=args.force)
            print(scaffold.next_steps(written[0].parent))
        elif args.command == "graph":
            print(load_registry(app, args.name).pipeline(args.name).describe())
        elif args.command == "keda":
            settings = load_settings(CommonSettings)
            # The stages its workers would serve: triggers on any other watch nothing.
            load_registry(settings.app, settings.pipelines).stage(args.stage)
            where = TriggerOptions(args.address, args.target, args.auth, settings.cluster)
            print(triggers(settings.keys, args.stage, where), end="")
        elif args.command == "deploy":
            deploy_files.run(args)
        elif args.command == "dlq":
            done = dlq_command(args.action, args.stage, args.id, args.timeout, args.force)
            sys.exit(asyncio.run(done))
        else:
            sys.exit(asyncio.run(_status_async()))
    except ConveyorError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        sys.exit(2)
    except ResponseError as exc:  # a command Redis refused: its reason is the message
        print(f"conveyor: Redis refused the command: {exc}", file=sys.stderr)
        sys.exit(2)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        configured = os.environ.get("CONVEYOR_REDIS_URL")
        url = redact_url(configured) if configured else f"{DEFAULT_REDIS_URL} (the default)"
        print(
            f"conveyor: cannot reach Redis at {url}: {str(exc).rstrip('.')}. Set "
            "CONVEYOR_REDIS_URL to a running Redis (`conveyor up` prints its embedded "
            "one's as CONVEYOR_REDIS_URL=...).",
            file=sys.stderr,
        )
        sys.exit(2)
