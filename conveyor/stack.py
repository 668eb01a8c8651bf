"""``conveyor up`` and ``conveyor gateway``: what they start, in which order, and how they
stop (the processes themselves are :class:`~conveyor.supervisor.Supervisor`'s).

:func:`up` checks every setting first, then takes the steps in order: start Redis
(unless ``CONVEYOR_REDIS_URL`` names one), the gateway processes (``--gateways N``,
``CONVEYOR_GATEWAYS``: N on one port, :mod:`gateway.__main__`), the worker groups; says
when every worker has loaded its model and reads its stage (:class:`Readiness`); then
supervises until Ctrl-C, SIGTERM or SIGHUP, and stops in order (see
:mod:`conveyor.supervisor`). :func:`gateways` is ``conveyor gateway``'s smaller
supervisor: N gateway processes alone.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from conveyor.autoscale import AutoscaleSettings
from conveyor.children import say
from conveyor.data import DataDir, DataSettings
from conveyor.embedded import free_port
from conveyor.placement import PlacementSettings, host_placer, worker_groups
from conveyor.readiness import Readiness, check_port, gateway_url
from conveyor.reload import Reloader, app_info
from conveyor.restarts import RestartSettings
from conveyor.supervisor import StopAsked, Supervisor
from gateway.settings import GatewaySettings
from pipelines.errors import ConfigError
from pipelines.registry import app_dir, load_registry
from pipelines.settings import CommonSettings, load_settings
from runtime.logs import configure_logging

__all__ = ["UpOptions", "gateway_count", "gateways", "up"]


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
        ephemeral: the embedded Redis keeps nothing (a temp folder), instead of its
            append-only file in ``CONVEYOR_DATA_DIR`` (:mod:`conveyor.data`).
        reload: watch the app folder's ``.py`` files and restart what runs the code
            that changed (:mod:`conveyor.reload`).
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
    ephemeral: bool = False
    reload: bool = False


_ASKED = threading.Event()
"""Set once a stop signal came: a :class:`StopAsked` that a library caught and wrapped in
an error of its own (pydantic-settings does), or that an event-loop callback swallowed
(the supervisor looks at this too), is still the stop asked for."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    _ASKED.set()
    raise StopAsked


def _asked_to_stop(exc: Exception) -> bool:
    """Whether ``exc`` is the stop signal's :class:`StopAsked`, as such or wrapped."""
    return isinstance(exc, StopAsked) or _ASKED.is_set()


@contextmanager
def _until_stop_signal() -> Iterator[None]:
    """Run the body until Ctrl-C, SIGTERM or SIGHUP: the signal ends it (and only that
    error is swallowed); from the body's end on, a second signal is ignored, so that it
    cannot cut the ordered stop that follows short."""
    _on_stop_signals(_raise_stop)
    try:
        yield
    except Exception as exc:
        if not _asked_to_stop(exc):
            raise
    finally:
        _on_stop_signals(signal.SIG_IGN)


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
    # The tokenizers' own thread pool would contend with the worker's host threads (and
    # warns after a fork); the user's setting, if any, wins.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if options.reload:  # an edit of a stage's input is the new definition, replicas or not
        env.setdefault("CONVEYOR_REPLACE_STAGE_DEFINITION", "true")
        env.setdefault("CONVEYOR_REUSE_PORT", "true")  # a new gateway starts beside the old
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
    return scaling


def up(options: UpOptions) -> int:
    """Run ``conveyor up`` until Ctrl-C or SIGTERM (exit status 0) or until it gives up
    on a process that keeps exiting unasked (1; see :meth:`Supervisor.tend`); raises
    :class:`ConfigError` before anything starts for an unknown pipeline, a bad flag or a
    port something else listens on.

    Args:
        options: the command's flags.
    """
    # Every child's settings are checked before any starts: a bad value is one line
    # here, not a child exiting after Redis and the others have started. The children
    # inherit CONVEYOR_LOG_*; up's own lines (the autoscaler's decisions) follow them too.
    configure_logging()
    flags = {"host": options.host, "port": options.port, "gateways": options.gateways}
    gateway = load_settings(GatewaySettings, **{k: v for k, v in flags.items() if v is not None})
    if gateway.port == 0:  # any free port, the same for every gateway, and known to print
        gateway = gateway.model_copy(update={"port": free_port(gateway.host)})
    env = _child_env(options, gateway)
    registry = load_registry(env.get("CONVEYOR_APP"), env.get("CONVEYOR_PIPELINES"))
    # A pipeline named as an OpenAI route: one line before anything starts. Imported here:
    # the gateway's routes need the serve extra, which the CLI's other commands do not.
    from gateway.routes.openai.serving import check_names

    check_names(registry)
    scaling = _autoscale_settings(options)
    if options.reload and (scaling is not None or not options.app):
        raise ConfigError("--reload needs --app (or CONVEYOR_APP), and not --autoscale")
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
    data = _data_dir(options, env)
    restart = load_settings(RestartSettings)
    check_port(gateway.host, gateway.port)  # the last check: closest to its bind
    if data is not None:
        data.lock()  # one up per data folder: a second is refused here
    say(f"placement: {place.describe()}")
    where = data.path if data is not None else None
    supervisor = Supervisor(env, place, restart, gateway.drain_s, stop_asked=_ASKED, data_dir=where)
    if options.reload and options.app:
        folder = Path(app_dir())
        info = app_info(registry, groups, options.app, folder)
        watcher = Reloader(folder, supervisor, info, options.replicas)
        supervisor.reloader = watcher.tick
        say(f"reload: watching the {len(watcher.seen)} .py file(s) under {folder}")
    try:
        supervisor.start_redis()
    except BaseException:
        if data is not None:
            data.release()
        raise
    code = 0
    readiness: Readiness | None = None
    try:
        with _until_stop_signal():
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
            code = supervisor.supervise()
    finally:
        if readiness is not None:
            readiness.stop()
        say(
            "stopping: the gateway drains (new requests get 503), then the workers "
            "finish and leave their groups, then redis"
        )
        supervisor.stop(list(registry.stages))
        if data is not None:
            data.release()
        say("stopped")
    return code


def _data_dir(options: UpOptions, env: dict[str, str]) -> DataDir | None:
    """The embedded Redis's data folder (None: ``--ephemeral``, or an outside Redis)."""
    if env.get("CONVEYOR_REDIS_URL"):
        if options.ephemeral:
            raise ConfigError(
                "--ephemeral is for up's embedded Redis; CONVEYOR_REDIS_URL names another"
            )
        return None
    if options.ephemeral:
        return None
    return DataDir(load_settings(DataSettings).data_dir.absolute())


def gateway_count() -> int:
    """``CONVEYOR_GATEWAYS``, validated: the gateway processes ``conveyor gateway`` runs."""
    return load_settings(GatewaySettings).gateways


def gateways(env: dict[str, str]) -> int:
    """``conveyor gateway`` with ``CONVEYOR_GATEWAYS`` above 1: that many gateway
    processes on one port, until Ctrl-C or SIGTERM (exit status 0), one that exits
    unasked restarted as ``up`` restarts it, or until it gives up on one (1); then every
    one is stopped, each draining (a container's one command keeps them all).

    Args:
        env: their environment (``CONVEYOR_GATEWAYS``, ``CONVEYOR_HOST``, ...).
    """
    configure_logging()
    settings = load_settings(GatewaySettings)
    supervisor = Supervisor(
        env, None, load_settings(RestartSettings), settings.drain_s, stop_asked=_ASKED
    )
    code = 0
    try:
        with _until_stop_signal():
            supervisor.start_gateways(settings.gateways)
            say(f"{settings.gateways} gateways on http://{settings.host}:{settings.port}")
            code = supervisor.supervise()
    finally:
        supervisor.stop()
    return code


def _on_stop_signals(handler: Callable[[int, FrameType | None], None] | signal.Handlers) -> None:
    """Handle Ctrl-C, SIGTERM and SIGHUP (the terminal closed) with ``handler``."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, handler)
