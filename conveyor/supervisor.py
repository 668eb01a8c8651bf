"""``conveyor up``: an embedded redis-server, the gateway(s) and the workers, supervised.

Each runs as its own process, started by module name exactly as a deployment runs it (so
this module imports neither side); :mod:`conveyor.stack` starts them in order and says
when they are ready. :class:`Supervisor` looks after them until Ctrl-C, SIGTERM or
SIGHUP: a gateway or worker that exits unasked is
restarted after a backoff, a crash loop parks its group alone, the embedded Redis is
started again if it exits, and only a configuration error stops ``up``
(:mod:`conveyor.restarts`). Then it stops in order: the gateways first (each
drains: its port closes, a request on a connection still open gets 503 + Retry-After,
those in flight are answered, by the workers still running, within
``CONVEYOR_DRAIN_S``), then the workers (each finishes its batches and leaves its
groups), then Redis.

Every child runs in its own process group, so the terminal's Ctrl-C reaches ``up`` alone
and nothing is stopped out of that order (a Redis killed by the same keystroke as the
workers would leave them unable to leave their groups); and every child dies with ``up``
even when ``up`` is killed and can run no stop at all (:mod:`conveyor.children`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from redis.exceptions import RedisError

from conveyor.autoscale import Autoscaler, AutoscaleSettings
from conveyor.children import ExitReports
from conveyor.data import PIDFILE, left_over
from conveyor.embedded import free_port, start_redis
from conveyor.placement import (
    Group,
    Placed,
    Placer,
    worker_groups,
)
from conveyor.readiness import waiting
from conveyor.restarts import (
    NOT_RESTARTED,
    CrashLoop,
    RestartSettings,
    count_restart,
    exited,
    mark_parked,
)
from pipelines.errors import ConfigError
from pipelines.settings import CommonSettings
from pipelines.stages import Stage
from runtime.redisio import REDIS_DOWN

__all__ = ["StopAsked", "Supervisor", "say", "worker_groups"]

STOP_GRACE_S = 15.0
"""A process still running this long after SIGTERM is killed (a gateway: this long after
its drain, ``CONVEYOR_DRAIN_S``)."""

POLL_S = 0.1
"""How often the processes are looked at (without ``--autoscale``: with it, at each of
the autoscaler's ticks)."""

Process = subprocess.Popen[bytes]


class StopAsked(Exception):
    """A stop signal came: raised by ``up``'s handler, and by :meth:`Supervisor.tend` once
    :attr:`Supervisor.stop_asked` is set (the handler's raise can land in an event-loop
    callback, which logs it and goes on)."""


@dataclass
class Supervisor:
    """The processes of one ``up``: started one step at a time, stopped together.

    Args:
        env: every child's environment (``start_redis`` adds ``CONVEYOR_REDIS_URL``).
        restart: how a process that exits unasked is restarted.
        drain_s: the gateways' drain (``CONVEYOR_DRAIN_S``): ``up`` waits that long more
            for a gateway to stop.
    """

    env: dict[str, str]
    placer: Placer | None = None  # None: every worker with ``env`` alone
    restart: RestartSettings = field(default_factory=RestartSettings)
    drain_s: float = 10.0
    children: list[tuple[str, Process]] = field(default_factory=list)  # gateways, workers
    redis: Process | None = None
    redis_dir: Path | None = None  # an ephemeral Redis's files, removed once it stopped
    data_dir: Path | None = None  # the embedded Redis's data folder (None: --ephemeral)
    autoscaler: Autoscaler | None = None
    interval_s: float = 1.0  # between the autoscaler's ticks
    placed: dict[int, Placed] = field(default_factory=dict)  # by pid
    due: dict[str, float] = field(default_factory=dict)  # restarts waiting: when, by name
    crashes: CrashLoop = field(init=False)
    groups: dict[str, Group | None] = field(default_factory=dict)  # by child name (None: gateway)
    parked: dict[str, float] = field(default_factory=dict)  # group name: until (monotonic)
    reports: ExitReports = field(default_factory=ExitReports)
    redis_port: int = 0
    stop_asked: threading.Event = field(default_factory=threading.Event)  # set by the stop signal

    def __post_init__(self) -> None:
        self.crashes = CrashLoop(self.restart)

    def start_redis(self) -> None:
        """An embedded redis-server on a free port, unless ``CONVEYOR_REDIS_URL`` is set:
        on :attr:`data_dir`'s files (its append-only file), or keeping nothing."""
        if self.env.get("CONVEYOR_REDIS_URL"):
            return
        # Not the gateway's port: it is checked free but bound only once the gateway starts.
        gateway = int(self.env.get("CONVEYOR_PORT", "0"))
        self.redis_port = port = free_port(avoid=gateway)
        self._run_redis()
        url = self.env["CONVEYOR_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        kept = (
            f"its data in {self.data_dir} (append-only file: what it accepted is kept "
            "across a stop, a kill or a restart)"
            if self.data_dir is not None
            else "in memory: nothing kept at stop (--ephemeral)"
        )
        say(
            f"embedded redis on 127.0.0.1:{port}, {kept}; "
            f"`CONVEYOR_REDIS_URL={url} conveyor status` reads it"
        )

    def _run_redis(self) -> None:
        if self.data_dir is not None:
            self.redis = start_redis(
                self.redis_port,
                self.data_dir,
                appendonly=True,
                fsync="everysec",  # see conveyor/data.py
                pidfile=self.data_dir / PIDFILE,
                bound=True,
            )
            return
        # --ephemeral: it persists nothing, so its folder is needed only while it starts
        # (its log says why it failed to): removed at once, nothing is left behind even
        # when up is killed and can remove nothing.
        workdir = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
        try:
            self.redis = start_redis(self.redis_port, workdir, bound=True)
        except ConfigError:
            self.redis_dir = workdir  # kept for its log until up stops
            raise
        shutil.rmtree(workdir, ignore_errors=True)

    def _spawn(self, module: str, *argv: str, env: dict[str, str] | None = None) -> Process:
        # Its own process group, bound to die with up (see the module's docstring), and a
        # pipe of its own to say why it exits when no restart would mend it.
        return self.reports.start([sys.executable, "-m", module, *argv], self.env | (env or {}))

    def _final(self, proc: Process) -> str | None:
        """Why ``proc`` (exited) must not be restarted: a status 2 or 3 with its reason
        on its pipe; None: a crash (whatever its status), restarted."""
        said = self.reports.said(proc, keep=True)  # kept for the crash count next
        code = proc.returncode
        if code in NOT_RESTARTED and said.reason is not None:
            return f"{NOT_RESTARTED[code]}: {said.reason}"
        return None

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
        self.reports.said(proc, keep=True)  # for _crashed, which comes next if it crashed
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
            self.groups[name] = None

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
            self.groups[f"worker {p.group.name}#{i}"] = p.group

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
            crashed=self._crashed,
        )
        self.interval_s = scaling.interval_s

    def supervise(self) -> int:
        """Look after the processes, restarting those that exit unasked, until there is
        a reason to give up: then say it and return 1 (the exit status). Ctrl-C or SIGTERM
        raise out of it (with the autoscaler: it returns 0)."""
        why = asyncio.run(self._supervise())
        if why is None:
            return 0
        say(f"{why}; stopping")
        return 1

    async def _supervise(self) -> str | None:
        if self.autoscaler is None:
            # Polled: a child's exit is no event here (and the restarts have times).
            while True:
                if why := await self.tend():
                    return why
                await asyncio.sleep(POLL_S)
        return await self.autoscaler.run(
            self._common(), interval_s=self.interval_s, watch=self.tend
        )

    def _common(self) -> CommonSettings:
        return CommonSettings(redis_url=self.env.get("CONVEYOR_REDIS_URL", ""))

    async def tend(self) -> str | None:
        """One look at the processes: a gateway or worker that exited unasked is given
        its restart time (:class:`~conveyor.restarts.CrashLoop`), one whose time has come
        is started again, a group in a crash loop is parked, a parked one whose time has
        come is started again, an embedded Redis that exited is started again; None
        while ``up`` goes on, else why it stops (a configuration error, a Redis that
        cannot be started). Raises :class:`StopAsked` once :attr:`stop_asked` is set."""
        if self.stop_asked.is_set():
            raise StopAsked
        redis_gone = self.redis is not None and self.redis.poll() is not None
        if redis_gone and (why := self._redis_exited()):
            return why
        now = time.monotonic()
        if redis_gone:  # the new one knows nothing of the parks still on
            for group, until in self.parked.items():
                if not _is_gateway(group):
                    await self._say_parked(group.split(","), "parked", until - now)
        await self._unpark(now)
        for i, (name, proc) in enumerate(self.children):
            code = proc.poll()
            if code is None or self._group_name(name) in self.parked:
                continue
            if name not in self.due:
                if why := self._final(proc):
                    return f"{name} {exited(code)}: {why}; not restarted"
                delay = self.crashes.crashed(name, now, self.reports.said(proc).progressed)
                if delay is None:
                    await self._park(self._group_name(name), self.crashes.looping(name, code))
                    continue
                say(f"{name} {exited(code)}; restarting it in {delay:g}s")
                self.due[name] = now + delay
            if now >= self.due[name]:
                del self.due[name]
                self.children[i] = (name, await self._again(name, proc))
        return None

    async def _again(self, name: str, proc: Process) -> Process:
        """Start ``name`` (its process ``proc`` exited) again, where it was placed."""
        self.reports.said(proc)  # its pipe, if still open, is closed
        placed = self.placed.pop(proc.pid, None)
        again = self._spawn("gateway") if placed is None else self._spawn_placed(placed)
        say(f"{name} restarted (pid {again.pid})")
        await self._count(list(placed.group.stages) if placed is not None else [])
        return again

    def _group_name(self, child: str) -> str:
        """What a crash loop of ``child`` parks: its worker group; a gateway alone (its
        siblings go on serving the port)."""
        group = self.groups.get(child)
        return child if group is None else group.name

    async def _park(self, group: str, why: str) -> None:
        """Stop ``group``'s processes and start them again after its park (see
        :mod:`conveyor.restarts`); its stages answer 503 meanwhile."""
        for_s = self.crashes.park(group)
        self.parked[group] = time.monotonic() + for_s
        say(
            f"{why}; parking {group} for {for_s:g}s (its requests get 503 + Retry-After; "
            "everything else goes on serving)"
        )
        members = [(n, p) for n, p in self.children if self._group_name(n) == group]
        for name, proc in members:
            self.due.pop(name, None)
            self.crashes.forget(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if self.autoscaler is not None and group in self.autoscaler.scalers:
            self.autoscaler.hold(group)
        if not _is_gateway(group):
            await self._say_parked(group.split(","), why, for_s)

    async def _unpark(self, now: float) -> None:
        """Start again each parked group whose time has come."""
        for group in [g for g, until in self.parked.items() if now >= until]:
            del self.parked[group]
            say(f"{group}: its park is over; starting it again")
            for i, (name, proc) in enumerate(self.children):
                if self._group_name(name) == group:
                    if proc.poll() is None:  # still draining, a whole park later
                        proc.kill()
                        proc.wait()
                    self.children[i] = (name, await self._again(name, proc))
            if self.autoscaler is not None and group in self.autoscaler.scalers:
                self.autoscaler.resume(group)
            if not _is_gateway(group):
                await self._say_parked(group.split(","), "", None)

    async def _say_parked(self, stages: list[str], why: str, for_s: float | None) -> None:
        try:
            await mark_parked(self._common(), stages, why, for_s)
        except RedisError as exc:  # unreachable, or a key of ours forged to another type
            say(f"could not record in redis that {','.join(stages)} is parked: {exc}")

    def _redis_exited(self) -> str | None:
        """Start the embedded Redis again (it reloads what it held from its append-only
        file; with ``--ephemeral`` that is gone and the workers re-create their groups);
        why to stop if it cannot be kept running."""
        assert self.redis is not None
        code = self.redis.returncode
        now = time.monotonic()
        if self.crashes.crashed("redis-server", now) is None:
            return self.crashes.looping("redis-server", code)
        held = (
            f"it reloads what it held from {self.data_dir}"
            if self.data_dir is not None
            else "what it held is lost: --ephemeral"
        )
        say(f"redis-server {exited(code)}; starting it again ({held})")
        try:
            self._run_redis()
        except ConfigError as exc:
            return f"redis-server {exited(code)} and could not start again: {exc}"
        return None

    async def _count(self, stages: list[str]) -> None:
        """Count a restart in ``stages``' stats; Redis down is said, not fatal."""
        if not stages:
            return
        try:
            await count_restart(self._common(), stages)
        except RedisError as exc:  # unreachable, or a key of ours forged to another type
            say(f"the restart of a worker of {','.join(stages)} was not counted: {exc}")

    async def _crashed(self, stage: str, proc: Process) -> str | None:
        """The autoscaler's worker of ``stage`` exited unasked: stop on a configuration
        error, park the stage's workers on a crash loop, else count it; the autoscaler
        starts another at its next tick."""
        if why := self._final(proc):
            return f"worker {stage} {exited(proc.returncode)}: {why}"
        if stage in self.parked:  # stopped by its park (or dying with the others)
            return None
        stages = stage.split(",")
        # Its crashes are its own once it served (one autoscaled worker is not restarted:
        # it counts once); those of the workers that never started are the stage's.
        try:
            started = not await waiting(self._common(), stages, {proc.pid})
        except RedisError:  # unreachable, or a key of ours forged to another type
            started = False  # unknown: counted with the stage's, the stricter count
        name = f"worker {stage} (pid {proc.pid})" if started else f"worker {stage} (starting)"
        now = time.monotonic()
        if self.crashes.crashed(name, now, self.reports.said(proc).progressed) is None:
            await self._park(stage, self.crashes.looping(name, proc.returncode))
            return None
        say(f"{name} {exited(proc.returncode)}; the autoscaler starts another")
        await self._count(stages)
        return None

    def workers(self) -> list[tuple[str, Process]]:
        """Every worker process started (the autoscaler's, draining ones included)."""
        started = [(n, p) for n, p in self.children if not _is_gateway(n)]
        return started + (self.autoscaler.processes() if self.autoscaler else [])

    def stop(self, stages: list[str] | None = None) -> None:
        """Stop in order: every gateway (it drains: the workers still answer what is in
        flight), then the workers, then Redis; each step SIGTERM (a graceful drain), a
        kill for a process still running after :data:`STOP_GRACE_S` (a gateway: after
        its drain and that).

        Args:
            stages: the stages served: what they still hold once the workers stopped is
                said, and whether it is kept.
        """
        _terminate(self.gateways(), self.drain_s + STOP_GRACE_S)
        _terminate(self.workers())
        if stages and (self.redis is None or self.redis.poll() is None):
            if self.redis is None:
                fate = "kept in the Redis at CONVEYOR_REDIS_URL"
            elif self.data_dir is not None:
                fate = f"kept in {self.data_dir}: `conveyor up` there again finishes it"
            else:
                fate = "lost with this Redis (--ephemeral)"
            for line in left_over(self._common(), stages, fate):
                say(line)
        if self.parked and self.redis is None:  # an outside Redis outlives this up
            stages = [s for g in self.parked if not _is_gateway(g) for s in g.split(",")]
            with contextlib.suppress(*REDIS_DOWN):
                asyncio.run(mark_parked(self._common(), stages, "", None))
        if self.redis is not None:
            _terminate([("redis-server", self.redis)])
        if self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)
        self.reports.close()


def _is_gateway(name: str) -> bool:
    return name == "gateway" or name.startswith("gateway#")


def _terminate(procs: list[tuple[str, Process]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to each of ``procs`` still running; wait for all, killing what is still
    running after ``grace_s``."""
    for _, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for name, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(f"{name} did not stop within {grace_s:g}s; killed")
            proc.kill()
            proc.wait()


def say(line: str) -> None:
    """Print one line of ``up``'s own, flushed (its children print to the same terminal)."""
    print(f"conveyor: {line}", flush=True)
