"""The processes of ``conveyor up`` (and of ``conveyor gateway`` with several gateways):
the gateways and the workers, each started by module name exactly as a deployment runs
it (so this module imports neither side), and ``up``'s own Redis
(:class:`~conveyor.embedded.UpRedis`). :class:`Supervisor` looks after them until a stop
is asked: one that exits unasked is started again (:mod:`conveyor.restarts`), a crash
loop parks its group (:mod:`conveyor.parks`); then it stops them in order: the gateways
(each drains), the workers, Redis.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from redis.exceptions import RedisError

from conveyor.autoscale import Autoscaler, AutoscaleSettings
from conveyor.children import STOP_GRACE_S, ExitReports, Process, say, terminate
from conveyor.data import DataSettings, left_over
from conveyor.embedded import UpRedis
from conveyor.handover import Handover, hand_over, replaceable, settle
from conveyor.parks import Parks
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
)
from pipelines.settings import CommonSettings, load_settings
from pipelines.stages import Stage

__all__ = ["StopAsked", "Supervisor", "worker_groups"]

POLL_S = 0.1
"""How often the processes are looked at (without ``--autoscale``: with it, at each of
the autoscaler's ticks)."""


class StopAsked(Exception):
    """A stop signal came: raised by ``up``'s handler, and by :meth:`Supervisor.tend` once
    :attr:`Supervisor.stop_asked` is set (the handler's raise can land in an event-loop
    callback, which logs it and goes on)."""


@dataclass
class Supervisor:
    """The processes of one ``up``: started one step at a time, stopped together.

    Every child runs in its own process group, so the terminal's Ctrl-C reaches ``up``
    alone and nothing is stopped out of order (a Redis killed by the same keystroke as
    the workers would leave them unable to leave their groups); and every child dies
    with ``up``, even when ``up`` is killed and can run no stop (:mod:`conveyor.children`).

    Args:
        env: every child's environment (:meth:`start_redis` adds ``CONVEYOR_REDIS_URL``).
        placer: where each worker runs (None: every worker with ``env`` alone).
        restart: how a process that exits unasked is restarted.
        drain_s: the gateways' drain (``CONVEYOR_DRAIN_S``): ``up`` waits that long more
            for a gateway to stop.
        stop_asked: set by the stop signal.
        data_dir: the embedded Redis's data folder (None: ``--ephemeral``).
    """

    env: dict[str, str]
    placer: Placer | None = None
    restart: RestartSettings = field(default_factory=RestartSettings)
    drain_s: float = 10.0
    children: list[tuple[str, Process]] = field(default_factory=list)  # gateways, workers
    redis: UpRedis | None = None  # None: the Redis at CONVEYOR_REDIS_URL
    data_dir: Path | None = None
    autoscaler: Autoscaler | None = None
    interval_s: float = 1.0  # between the autoscaler's ticks
    placed: dict[int, Placed] = field(default_factory=dict)  # by pid
    due: dict[str, float] = field(default_factory=dict)  # restarts waiting: when, by name
    crashes: CrashLoop = field(init=False)
    parks: Parks = field(init=False)
    groups: dict[str, Group | None] = field(default_factory=dict)  # by child name (None: gateway)
    reports: ExitReports = field(default_factory=ExitReports)
    stop_asked: threading.Event = field(default_factory=threading.Event)
    reloader: Callable[[], Awaitable[None]] | None = None  # up --reload: at each look
    recycling: set[str] = field(default_factory=set)  # asked to stop, to start again
    retiring: set[str] = field(default_factory=set)  # asked to stop for good
    held: set[str] = field(default_factory=set)  # --reload: exited on a config error
    handovers: list[Handover] = field(default_factory=list)  # --reload: gateways replaced

    def __post_init__(self) -> None:
        self.crashes = CrashLoop(self.restart)
        self.parks = Parks(self.crashes)

    def start_redis(self) -> None:
        """``up``'s own redis-server (:class:`~conveyor.embedded.UpRedis`) on
        :attr:`data_dir`, unless ``CONVEYOR_REDIS_URL`` is set."""
        if self.env.get("CONVEYOR_REDIS_URL"):
            return
        memory = load_settings(DataSettings).redis_maxmemory_mb
        self.redis = UpRedis(self.data_dir, memory)  # a failed start's leftovers go at stop
        gateway = int(self.env.get("CONVEYOR_PORT", "0"))
        self.env["CONVEYOR_REDIS_URL"] = self.redis.start(avoid=gateway)

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
        """``count`` gateway processes on one port (each binds it with ``SO_REUSEPORT``
        when ``count`` is above 1, as ``CONVEYOR_GATEWAYS`` in :attr:`env` says)."""
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
        redis_code = self.redis.exit_status() if self.redis is not None else None
        if redis_code is not None and (why := self._redis_exited(redis_code)):
            return why
        now = time.monotonic()
        if redis_code is not None:  # the new one knows nothing of the parks still on
            await self.parks.remind(self._common(), now)
        await self._unpark(now)
        if self.reloader is not None:
            await self.reloader()
            settle(self, lambda name, proc: self._ask_stop(name, proc, self.retiring))
        for i, (name, proc) in enumerate(self.children):
            code = proc.poll()
            if code is None or self._group_name(name) in self.parks or name in self.held:
                continue
            if name in self.recycling or name in self.retiring:
                self.children[i] = (name, self._reloaded(name, proc))
                continue
            if name not in self.due:
                if (why := self._final(proc)) and self.reloader is None:
                    return f"{name} {exited(code)}: {why}; not restarted"
                if why:  # up --reload: the fix is the user's next change (recycle)
                    say(f"{name} {exited(code)}: {why}; started again at the next change")
                    self.held.add(name)
                    continue
                delay = self.crashes.crashed(name, now, self.reports.said(proc).progressed)
                if delay is None:
                    await self._park(self._group_name(name), self.crashes.looping(name, code))
                    continue
                say(f"{name} {exited(code)}; restarting it in {delay:g}s")
                self.due[name] = now + delay
            if now >= self.due[name]:
                del self.due[name]
                self.children[i] = (name, await self._again(name, proc))
        for name, proc in [(n, p) for n, p in self.children if n in self.retiring]:
            if proc.returncode is not None:  # seen exited above (_reloaded): dropped
                self.children.remove((name, proc))
                self.retiring.discard(name)
                self.groups.pop(name, None)
        return None

    async def _again(self, name: str, proc: Process) -> Process:
        """Start ``name`` (its process ``proc`` exited) again, where it was placed."""
        self.reports.said(proc)  # its pipe, if still open, is closed
        placed = self.placed.pop(proc.pid, None)
        again = self._spawn("gateway") if placed is None else self._spawn_placed(placed)
        say(f"{name} restarted (pid {again.pid})")
        await self._count(list(placed.group.stages) if placed is not None else [])
        return again

    def recycle(self, groups: Iterable[str], *, gateways: bool = False) -> None:
        """SIGTERM the workers of ``groups`` (names: ``embed``, ``a,b``), each started again
        once it exited (it finishes its batch; what comes meanwhile waits in Redis), and
        with ``gateways`` replace every gateway (``up --reload``: :mod:`conveyor.handover`)."""
        names, stop = set(groups), lambda n, p: self._ask_stop(n, p, self.retiring)
        for name, proc in list(self.children):
            group = self.groups.get(name)
            if group is not None and group.name in names:
                self._ask_stop(name, proc, self.recycling)
            elif group is None and gateways and replaceable(self, name, proc):
                if proc.poll() is not None:  # exited (held on a config error): started again
                    self._ask_stop(name, proc, self.recycling)
                else:  # the new one first
                    hand_over(self, name, proc, lambda: self._spawn("gateway"), stop)

    def retire(self, group: str) -> None:
        """Stop the workers of ``group`` for good (SIGTERM: their batches finish), its
        stages gone from the app (``up --reload``)."""
        for name, proc in self.children:
            found = self.groups.get(name)
            if found is not None and found.name == group:
                self._ask_stop(name, proc, self.retiring)

    def _ask_stop(self, name: str, proc: Process, into: set[str]) -> None:
        self.due.pop(name, None)
        self.crashes.forget(name)
        self.held.discard(name)
        if name in into:  # asked already (a second SIGTERM could cut its drain short)
            return
        into.add(name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def add_group(self, group: Group) -> None:
        """Start the workers of a group new to the app (``up --reload``), placed (raises
        :class:`~conveyor.placement.PlacementError` when its GPU share does not fit)."""
        taken = {n for n, _ in self.children}
        placed: list[Placed | None] = [None] * group.replicas
        if self.placer is not None:
            placed = [self.placer.one(group) for _ in range(group.replicas)]
        for i, p in enumerate(placed):
            name = f"worker {group.name}#{i}"
            if name in taken:  # its namesake still stopping: a fresh name
                name = f"worker {group.name}#{i}.{len(self.children)}"
            proc = self._spawn("workers", group.name) if p is None else self._spawn_placed(p)
            say(f"{name} started (pid {proc.pid})")
            self.children.append((name, proc))
            self.groups[name] = group

    def _reloaded(self, name: str, proc: Process) -> Process:
        """``name`` (``proc``) exited as :meth:`recycle` asked: started again; or as
        :meth:`retire` asked: its placement given back (:meth:`tend` drops it)."""
        self.reports.said(proc)
        group = self.groups.get(name)
        if name in self.retiring:
            self._release(proc)
            say(f"{name} stopped")
            return proc
        self.recycling.discard(name)
        placed = self.placed.pop(proc.pid, None)
        if placed is not None:
            again = self._spawn_placed(placed)
        else:
            again = self._spawn("gateway") if group is None else self._spawn("workers", group.name)
        say(f"{name} reloaded (pid {again.pid})")
        return again

    def _group_name(self, child: str) -> str:
        """What a crash loop of ``child`` parks: its worker group; a gateway alone (its
        siblings go on serving the port)."""
        group = self.groups.get(child)
        return child if group is None else group.name

    async def _park(self, group: str, why: str) -> None:
        """Park ``group``: stop its processes, and start them again once its park is over
        (:mod:`conveyor.parks`); its stages answer 503 meanwhile."""
        self.parks.park(group, [] if _is_gateway(group) else group.split(","), why)
        members = [(n, p) for n, p in self.children if self._group_name(n) == group]
        for name, proc in members:
            self.due.pop(name, None)
            self.crashes.forget(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if self.autoscaler is not None and group in self.autoscaler.scalers:
            self.autoscaler.hold(group)
        await self.parks.record(self._common(), group)

    async def _unpark(self, now: float) -> None:
        """Start again each parked group whose time has come."""
        for group in self.parks.due(now):
            stages = self.parks.end(group)
            for i, (name, proc) in enumerate(self.children):
                if self._group_name(name) == group:
                    if proc.poll() is None:  # still draining, a whole park later
                        proc.kill()
                        proc.wait()
                    self.children[i] = (name, await self._again(name, proc))
            if self.autoscaler is not None and group in self.autoscaler.scalers:
                self.autoscaler.resume(group)
            await self.parks.back(self._common(), stages)

    def _redis_exited(self, code: int) -> str | None:
        """Start the embedded Redis (exited with ``code``) again, unless it is in a crash
        loop; why to stop if it cannot be kept running."""
        assert self.redis is not None
        if self.crashes.crashed("redis-server", time.monotonic()) is None:
            return self.crashes.looping("redis-server", code)
        return self.redis.again()

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
        if stage in self.parks:  # stopped by its park (or dying with the others)
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
        kill for a process still running after :data:`~conveyor.children.STOP_GRACE_S`
        (a gateway: after its drain and that).

        Args:
            stages: the stages served: what they still hold once the workers stopped is
                said, and whether it is kept.
        """
        terminate(self.gateways(), self.drain_s + STOP_GRACE_S)
        terminate(self.workers())
        if stages and (self.redis is None or self.redis.running()):
            fate = self.redis.fate() if self.redis else "kept in the Redis at CONVEYOR_REDIS_URL"
            for line in left_over(self._common(), stages, fate):
                say(line)
        if self.redis is None:  # an outside Redis outlives this up
            self.parks.release(self._common())
        else:
            self.redis.stop()
        self.reports.close()


def _is_gateway(name: str) -> bool:
    return name == "gateway" or name.startswith(("gateway#", "gateway@"))
