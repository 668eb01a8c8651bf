"""``conveyor up``: an embedded redis-server, the gateway(s) and the workers, supervised.

Each runs as its own process, started by module name exactly as a deployment runs it (so
this module imports neither side). :func:`up` takes the steps in order: start Redis
(unless ``CONVEYOR_REDIS_URL`` names one), the gateway processes (``--gateways N``,
``CONVEYOR_GATEWAYS``: N on one port, :mod:`gateway.__main__`), the worker groups; say
when every worker has loaded its model and reads its stage (:class:`Readiness`); then
supervise until Ctrl-C, SIGTERM or a process exiting unasked; then stop in order: the
workers first (each finishes its batches and leaves its groups), then the gateways (which
answer what they published meanwhile), then Redis. :func:`gateways` is ``conveyor gateway``'s
smaller supervisor: N gateway processes alone.

Every child runs in its own process group, so the terminal's Ctrl-C reaches ``up`` alone
and nothing is stopped out of that order (a Redis killed by the same keystroke as the
workers would leave them unable to leave their groups).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType

from conveyor.autoscale import Autoscaler, AutoscaleSettings
from conveyor.embedded import free_port, start_redis
from conveyor.placement import (
    Group,
    Placed,
    PlacementSettings,
    Placer,
    host_placer,
    worker_groups,
)
from conveyor.readiness import Readiness, check_port, gateway_url
from gateway.settings import GatewaySettings
from pipelines.errors import ConfigError
from pipelines.registry import app_dir, load_registry
from pipelines.settings import CommonSettings, load_settings
from pipelines.stages import Stage

__all__ = ["Supervisor", "UpOptions", "up", "worker_groups"]

STOP_GRACE_S = 15.0
"""A process still running this long after SIGTERM is killed."""

Process = subprocess.Popen[bytes]


@dataclass(frozen=True)
class UpOptions:
    """``conveyor up``'s flags.

    Attributes:
        host: the gateway's listen address (None: its settings', ``CONVEYOR_HOST``).
        port: the gateway's port (None: its settings', ``CONVEYOR_PORT``).
        app: ``module:attribute`` of the user's pipeline(s).
        pipelines: comma-separated pipelines to serve.
        replicas: worker processes per model stage (with ``autoscale``: of the function
            stages).
        autoscale: grow and shrink each model stage's workers with its backlog.
        min_workers: autoscale: fewest per model stage.
        max_workers: autoscale: most per model stage.
        target_backlog: autoscale: backlog per worker.
        gateways: gateway processes on the port (None: ``CONVEYOR_GATEWAYS``, 1).
    """

    host: str | None = None
    port: int | None = None
    app: str | None = None
    pipelines: str | None = None
    replicas: int | None = None
    autoscale: bool = False
    min_workers: int | None = None
    max_workers: int | None = None
    target_backlog: int | None = None
    gateways: int | None = None


class _Stop(Exception):
    """Raised by the signal handler to end ``up``'s wait."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _child_env(options: UpOptions, gateway: GatewaySettings) -> dict[str, str]:
    """This process's environment with ``up``'s flags, for every child."""
    env = dict(os.environ)
    env["CONVEYOR_HOST"] = gateway.host
    env["CONVEYOR_PORT"] = str(gateway.port)
    env["CONVEYOR_GATEWAYS"] = str(gateway.gateways)
    if options.app:
        env["CONVEYOR_APP"] = options.app
    # The user's module is imported from the folder up runs in, in every child too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (app_dir(), env.get("PYTHONPATH")) if p)
    if options.pipelines:
        env["CONVEYOR_PIPELINES"] = options.pipelines
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _autoscale_settings(options: UpOptions) -> AutoscaleSettings | None:
    """The autoscaler's settings (None without ``--autoscale``); raises
    :class:`ConfigError` for an autoscale flag without it, or a value out of range."""
    flags = (options.min_workers, options.max_workers, options.target_backlog)
    if not options.autoscale:
        if any(f is not None for f in flags):
            raise ConfigError("--min-workers, --max-workers and --target-backlog need --autoscale")
        return None
    scaling = AutoscaleSettings.from_flags(
        min_workers=options.min_workers,
        max_workers=options.max_workers,
        target_backlog=options.target_backlog,
    )
    # The autoscaler logs each decision.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return scaling


@dataclass
class Supervisor:
    """The processes of one ``up``: started one step at a time, stopped together.

    Args:
        env: every child's environment (``start_redis`` adds ``CONVEYOR_REDIS_URL``).
    """

    env: dict[str, str]
    placer: Placer | None = None  # None: every worker with ``env`` alone
    children: list[tuple[str, Process]] = field(default_factory=list)  # gateways, workers
    redis: Process | None = None
    redis_dir: Path | None = None  # the embedded Redis's files, removed once it stopped
    autoscaler: Autoscaler | None = None
    interval_s: float = 1.0  # between the autoscaler's ticks
    placed: dict[int, Placed] = field(default_factory=dict)  # by pid

    def start_redis(self) -> None:
        """An embedded redis-server on a free port, unless ``CONVEYOR_REDIS_URL`` is set."""
        if self.env.get("CONVEYOR_REDIS_URL"):
            return
        port = free_port()
        workdir = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
        self.redis = start_redis(port, workdir)
        self.redis_dir = workdir
        url = self.env["CONVEYOR_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        say(
            f"embedded redis on 127.0.0.1:{port} (files in {workdir}, removed at stop); "
            f"`CONVEYOR_REDIS_URL={url} conveyor status` reads it"
        )

    def _spawn(self, module: str, *argv: str, env: dict[str, str] | None = None) -> Process:
        # Its own process group: see the module's docstring.
        args = [sys.executable, "-m", module, *argv]
        return subprocess.Popen(args, env=self.env | (env or {}), process_group=0)

    def _spawn_placed(self, placed: Placed) -> Process:
        proc = self._spawn("workers", placed.group.name, env=placed.env())
        self.placed[proc.pid] = placed
        return proc

    def _spawn_group(self, group: Group) -> Process:
        """One more worker of ``group``, placed (the autoscaler's spawn); raises
        :class:`~conveyor.placement.PlacementError` when its GPU share does not fit."""
        if self.placer is None:
            return self._spawn("workers", group.name)
        placed = self.placer.one(group)
        say(f"worker {group.name}: {placed.describe()}")
        return self._spawn_placed(placed)

    def _release(self, proc: Process) -> None:
        placed = self.placed.pop(proc.pid, None)
        if placed is not None and self.placer is not None:
            self.placer.release(placed)

    def start_gateways(self, count: int) -> None:
        """The gateway processes: ``count`` on one port (each binds it with
        ``SO_REUSEPORT`` when ``count`` is above 1, as ``CONVEYOR_GATEWAYS`` in
        :attr:`env` says).

        Args:
            count: how many.
        """
        for i in range(count):
            name = "gateway" if count == 1 else f"gateway#{i}"
            self.children.append((name, self._spawn("gateway")))

    def gateways(self) -> list[tuple[str, Process]]:
        """Every gateway process started."""
        return [(n, p) for n, p in self.children if _is_gateway(n)]

    def start_workers(self, placed: list[Placed]) -> None:
        """The worker processes, each where it was placed (its GPUs, its threads).

        Args:
            placed: one per process, as :meth:`Placer.all` gives.
        """
        copies: dict[str, int] = {}
        for p in placed:
            i = copies[p.group.name] = copies.get(p.group.name, -1) + 1
            say(f"worker {p.group.name}#{i}: {p.describe()}")
            self.children.append((f"worker {p.group.name}#{i}", self._spawn_placed(p)))

    def start_autoscaler(
        self, groups: list[Group], stages: dict[str, Stage], scaling: AutoscaleSettings
    ) -> None:
        """An autoscaler for ``groups``; it starts their workers on its first tick, each
        placed as :meth:`start_workers` places them.

        Args:
            groups: the model stages' groups it scales.
            stages: the stages, by name.
            scaling: its settings.
        """
        self.autoscaler = Autoscaler(
            {g.name: scaling.scaler(*(stages[n] for n in g.stages)) for g in groups},
            lambda name: self._spawn_group(next(g for g in groups if g.name == name)),
            scaling.drain_timeout_s,
            released=self._release,
        )
        self.interval_s = scaling.interval_s

    def supervise(self) -> str | None:
        """Wait until a process exits unasked and say which; None: the autoscaler was
        stopped by Ctrl-C or SIGTERM (without one, those raise out of the wait)."""
        if self.autoscaler is None:
            # Sleep until any child exits (WNOWAIT leaves reaping to Popen) or a signal.
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            pid = info.si_pid if info else None
            name = next((n for n, p in self.children if p.pid == pid), "redis-server")
            return f"{name} exited ({info.si_status if info else '?'})"
        watched = self.children + ([("redis-server", self.redis)] if self.redis else [])
        return asyncio.run(
            self.autoscaler.run(
                CommonSettings(redis_url=self.env["CONVEYOR_REDIS_URL"]),
                interval_s=self.interval_s,
                watch=lambda: next((n for n, p in watched if p.poll() is not None), None),
            )
        )

    def workers(self) -> list[tuple[str, Process]]:
        """Every worker process started (the autoscaler's, draining ones included)."""
        started = [(n, p) for n, p in self.children if not _is_gateway(n)]
        return started + (self.autoscaler.processes() if self.autoscaler else [])

    def stop(self) -> None:
        """Stop in order: the workers, then every gateway, then Redis; each step SIGTERM
        (a graceful drain), a kill for a process still running after
        :data:`STOP_GRACE_S`."""
        _terminate(self.workers())
        _terminate(self.gateways())
        if self.redis is not None:
            _terminate([("redis-server", self.redis)])
        if self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)


def _is_gateway(name: str) -> bool:
    return name == "gateway" or name.startswith("gateway#")


def _terminate(procs: list[tuple[str, Process]]) -> None:
    """SIGTERM to each of ``procs`` still running; wait for all, killing what is still
    running after :data:`STOP_GRACE_S`."""
    for _, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for name, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{name} did not stop within {STOP_GRACE_S:g}s; killed")
            proc.kill()
            proc.wait()


def up(options: UpOptions) -> int:
    """Run ``conveyor up`` until Ctrl-C or SIGTERM (exit status 0) or until a process
    exits unasked (1); raises :class:`ConfigError` before anything starts for an unknown
    pipeline, a bad flag or a port something else listens on.

    Args:
        options: the command's flags.
    """
    # Every child's settings are checked before any starts: a bad value is one line
    # here, not a child exiting after Redis and the others have started.
    flags = {"host": options.host, "port": options.port, "gateways": options.gateways}
    gateway = load_settings(GatewaySettings, **{k: v for k, v in flags.items() if v is not None})
    if gateway.port == 0:  # any free port, the same for every gateway, and known to print
        gateway = gateway.model_copy(update={"port": free_port(gateway.host)})
    env = _child_env(options, gateway)
    registry = load_registry(env.get("CONVEYOR_APP"), env.get("CONVEYOR_PIPELINES"))
    scaling = _autoscale_settings(options)
    settings = load_settings(PlacementSettings)  # the workers' settings, and placement's
    groups = worker_groups(registry, options.replicas, settings)
    scaled = [g for g in groups if not g.light] if scaling is not None else []
    fixed = [g for g in groups if g not in scaled]  # the autoscaler starts the others
    # Cores are divided among the model processes up may run at once.
    most = sum(g.replicas for g in fixed if not g.light)
    most += sum(1 for g in scaled if not g.light) * (scaling.max_workers if scaling else 0)
    place = host_placer(settings, env, most)
    placed = place.all(fixed)
    if scaling is not None:
        # Their first workers must fit too: tried, then given back for the autoscaler.
        for p in place.all(replace(g, replicas=scaling.min_workers) for g in scaled):
            place.release(p)
    check_port(gateway.host, gateway.port)  # the last check: closest to its bind
    say(f"placement: {place.describe()}")
    supervisor = Supervisor(env, place)
    supervisor.start_redis()
    _on_stop_signals(_raise_stop)
    code = 0
    readiness: Readiness | None = None
    try:
        supervisor.start_gateways(gateway.gateways)
        supervisor.start_workers(placed)
        autoscaled = ""
        if scaling is not None and scaled:
            supervisor.start_autoscaler(scaled, registry.stages, scaling)
            autoscaled = (
                f"; autoscaling {', '.join(g.name for g in scaled)} "
                f"({scaling.min_workers} to {scaling.max_workers} workers each)"
            )
        gateways = "gateway" if gateway.gateways == 1 else f"{gateway.gateways} gateways"
        base = gateway_url(gateway.host, gateway.port)
        say(
            f"{gateways} on http://{gateway.host}:{gateway.port} serving "
            f"{', '.join(registry.pipelines)}; {len(supervisor.workers())} worker "
            f"process(es){autoscaled} loading their models; Ctrl-C stops"
        )
        say(f"API docs {base}/docs, status page {base}/status, metrics {base}/metrics")
        readiness = Readiness(
            CommonSettings(redis_url=env["CONVEYOR_REDIS_URL"]),
            list(registry.stages),
            lambda: {p.pid for _, p in supervisor.workers()},
            say,
            base,
        )
        readiness.start()
        why = supervisor.supervise()
        if why is not None:
            say(f"{why}; stopping")
            code = 1
    except _Stop:
        pass
    finally:
        if readiness is not None:
            readiness.stop()
        # A second Ctrl-C must not cut the ordered stop short (at most STOP_GRACE_S a step).
        _on_stop_signals(signal.SIG_IGN)
        say("stopping: workers drain and leave their groups, then the gateway, then redis")
        supervisor.stop()
        say("stopped")
    return code


def gateway_count() -> int:
    """``CONVEYOR_GATEWAYS``, validated: the gateway processes ``conveyor gateway`` runs."""
    return load_settings(GatewaySettings).gateways


def gateways(env: dict[str, str]) -> int:
    """``conveyor gateway`` with ``CONVEYOR_GATEWAYS`` above 1: that many gateway
    processes on one port, until Ctrl-C or SIGTERM (exit status 0) or until one exits
    unasked (1); then every one is stopped (a container's one command keeps them all).

    Args:
        env: their environment (``CONVEYOR_GATEWAYS``, ``CONVEYOR_HOST``, ...).
    """
    settings = load_settings(GatewaySettings)
    supervisor = Supervisor(env)
    _on_stop_signals(_raise_stop)
    code = 0
    try:
        supervisor.start_gateways(settings.gateways)
        say(f"{settings.gateways} gateways on http://{settings.host}:{settings.port}")
        why = supervisor.supervise()
        if why is not None:
            say(f"{why}; stopping")
            code = 1
    except _Stop:
        pass
    finally:
        _on_stop_signals(signal.SIG_IGN)
        supervisor.stop()
    return code


def _on_stop_signals(handler: Callable[[int, FrameType | None], None] | signal.Handlers) -> None:
    """Handle Ctrl-C, SIGTERM and SIGHUP (the terminal closed) with ``handler``."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, handler)


def say(line: str) -> None:
    """Print one line of ``up``'s own, flushed (its children print to the same terminal)."""
    print(f"conveyor: {line}", flush=True)
