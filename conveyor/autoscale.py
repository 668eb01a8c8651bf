"""``conveyor up --autoscale``: each model stage's worker processes follow its backlog.

The one-machine counterpart of KEDA: :func:`desired` turns a stage's backlog (both priority
lanes: a worker serves both) into a worker count, its :class:`Scaler` adds cool-downs (grow
at once, shrink slowly and one at a time).
A stopped worker gets SIGTERM: it finishes and acks its in-flight batches, leaves the group
and exits; only one still running after ``drain_timeout_s`` is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from subprocess import Popen

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import RedisError

from pipelines.errors import ConfigError
from pipelines.settings import CommonSettings, load_settings
from pipelines.stages import Stage
from runtime.redisio import connect
from runtime.status import StageStatus, stage_status

logger = logging.getLogger(__name__)


class AutoscaleSettings(BaseSettings):
    """The autoscaler's settings: ``up``'s flags, else ``CONVEYOR_AUTOSCALE_*`` variables.

    Attributes:
        min_workers: fewest worker processes per model stage (0: none while idle).
        max_workers: most worker processes per model stage.
        target_backlog: backlog (undelivered + in-flight entries, both lanes) per worker (unset:
            max_batch_size).
        interval_s: how often the queues are read.
        up_cooldown_s: a stage grows at most this often.
        down_cooldown_s: a stage loses one worker once its backlog asked for fewer this long.
        drain_timeout_s: a stopped worker still running after this long is killed.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_AUTOSCALE_", extra="ignore")

    min_workers: int = Field(default=1, ge=0, le=1000)
    max_workers: int = Field(default=4, ge=1, le=1000)
    target_backlog: int | None = Field(default=None, ge=1)
    interval_s: float = Field(default=1.0, gt=0, le=60)
    up_cooldown_s: float = Field(default=5.0, ge=0)
    down_cooldown_s: float = Field(default=30.0, ge=0)
    drain_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("max_workers")
    @classmethod
    def _bounds_ok(cls, value: int, info: ValidationInfo) -> int:
        if value < info.data.get("min_workers", 0):
            raise ValueError(f"must be at least min_workers ({info.data['min_workers']})")
        return value

    @classmethod
    def from_flags(cls, **flags: int | None) -> AutoscaleSettings:
        """The settings, ``up``'s flags (those not None) over the environment; raises
        [`ConfigError`][pipelines.errors.ConfigError] naming the setting when a value is out
        of range.

        Args:
            flags: field values from the command line.
        """
        return load_settings(cls, **{k: v for k, v in flags.items() if v is not None})

    def scaler(self, *stages: Stage) -> Scaler:
        """A scaler for the worker processes serving ``stages`` (one, or the stages on one
        model's weights: their backlogs add up, `Autoscaler.apply`); the default
        target is the smallest of their ``max_batch_size``.

        Args:
            stages: the model stages one process serves.
        """
        target = self.target_backlog or min(s.max_batch_size for s in stages)
        return Scaler(
            self.min_workers, self.max_workers, target, self.up_cooldown_s, self.down_cooldown_s
        )


def desired(backlog: int, *, target: int, min_n: int, max_n: int) -> int:
    """Workers a stage's backlog calls for: ``ceil(backlog / target)`` within
    ``[min_n, max_n]``, so at least one whenever anything waits (a stage at zero wakes).

    Args:
        backlog: the stage's :attr:`~runtime.status.StageStatus.backlog` (undelivered
            plus in flight).
        target: backlog one worker should hold.
        min_n: fewest workers.
        max_n: most workers.
    """
    return max(min_n, min(max_n, math.ceil(backlog / target)))


@dataclass
class Scaler:
    """One stage's rule: :func:`desired` within ``[min_n, max_n]``, plus cool-downs.

    Args:
        min_n: fewest workers.
        max_n: most workers.
        target: backlog one worker should hold.
        up_cooldown_s: least time between scale-ups (each goes straight to ``desired``).
        down_cooldown_s: one worker goes once ``desired`` stayed below the count this long.
    """

    min_n: int
    max_n: int
    target: int
    up_cooldown_s: float = 5.0
    down_cooldown_s: float = 30.0
    last_up: float = -math.inf
    low_since: float | None = None  # since when desired() has stayed below the count

    def decide(self, current: int, backlog: int, now: float) -> int:
        """The worker count to have now (from zero: ``min_n`` at once).

        Args:
            current: workers running (draining ones not counted).
            backlog: the stage's :attr:`~runtime.status.StageStatus.backlog`.
            now: monotonic time, seconds.
        """
        want = desired(backlog, target=self.target, min_n=self.min_n, max_n=self.max_n)
        if not self.min_n <= current <= self.max_n:  # bounds hold whatever the cool-down
            return max(self.min_n, min(self.max_n, current))
        if want >= current:
            self.low_since = None
            if want > current and now - self.last_up >= self.up_cooldown_s:
                self.last_up = now
                return want
            return current
        if self.low_since is None:
            self.low_since = now
        elif now - self.low_since >= self.down_cooldown_s:
            self.low_since = now  # the next step down waits a whole cool-down again
            return current - 1
        return current


@dataclass
class Autoscaler:
    """Keeps each stage's worker processes at what its :class:`Scaler` decides.

    A scaler may be named for several stages (``embed,sentiment,summarize``: the stages
    one process serves, on one model's weights): its backlog is theirs added up.

    Args:
        scalers: per stage name (or comma-separated names), its scaler.
        spawn: starts one worker process for the named stage(s); may raise
            :class:`~pipelines.errors.ConfigError` when there is no room for it (no GPU
            share left, :mod:`conveyor.placement`): the stage stays as it is.
        drain_timeout_s: a stopped worker still running after this long is killed.
        released: told of each stopped worker once it has exited (its GPU share is
            free again).
        crashed: told of each worker that exited unasked (it is no longer counted, so
            the next tick starts another as the stage's bounds ask); answers why to
            give up, or None. None: every such exit gives up.
    """

    scalers: dict[str, Scaler]
    spawn: Callable[[str], Popen[bytes]]
    drain_timeout_s: float = 30.0
    released: Callable[[Popen[bytes]], None] = lambda proc: None
    crashed: Callable[[str, Popen[bytes]], Awaitable[str | None]] | None = None
    running: dict[str, list[Popen[bytes]]] = field(default_factory=dict)
    draining: list[tuple[str, Popen[bytes], float]] = field(default_factory=list)  # + SIGTERM time
    held: set[str] = field(default_factory=set)  # parked: no worker started

    def hold(self, stage: str) -> None:
        """Stop ``stage``'s workers (each drains) and start none until :meth:`resume`
        (``conveyor up`` parks a crash loop)."""
        self.held.add(stage)
        self._resize(stage, 0, time.monotonic())

    def resume(self, stage: str) -> None:
        """Scale ``stage`` again from the next tick (its scaler's bounds start it)."""
        self.held.discard(stage)

    def apply(self, statuses: Mapping[str, StageStatus], now: float) -> None:
        """Decide for each stage from its queue state; log and act on each change.

        Args:
            statuses: per stage, its queue state.
            now: monotonic time, seconds.
        """
        for stage, scaler in self.scalers.items():
            if stage in self.held:
                continue
            st = [statuses[s] for s in stage.split(",")]
            backlog = sum(s.backlog for s in st)
            current = len(self.running.get(stage, []))
            new = scaler.decide(current, backlog, now)
            if new != current:
                logger.info(
                    "stage %s: %d -> %d worker(s) (lag %d, pending %d, target %d each)",
                    stage,
                    current,
                    new,
                    sum(s.lag for s in st),
                    sum(s.pending for s in st),
                    scaler.target,
                )
                self._resize(stage, new, now)

    def _resize(self, stage: str, n: int, now: float) -> None:
        procs = self.running.setdefault(stage, [])
        while len(procs) < n:
            try:
                procs.append(self.spawn(stage))
            except ConfigError as exc:
                logger.warning("stage %s: stays at %d worker(s): %s", stage, len(procs), exc)
                return
        while len(procs) > n:
            proc = procs.pop()  # the newest: perhaps still loading, holding the least
            proc.send_signal(signal.SIGTERM)
            self.draining.append((stage, proc, now))

    def reap(self, now: float) -> list[tuple[str, Popen[bytes]]]:
        """Reap drained workers, kill overdue ones; return the workers that exited
        unasked (by stage), no longer counted among the running (their share released).

        Args:
            now: monotonic time, seconds.
        """
        for stage, proc, since in list(self.draining):
            if proc.poll() is None and now - since > self.drain_timeout_s:
                logger.warning("stage %s: worker %d ignored SIGTERM; killing it", stage, proc.pid)
                proc.kill()
                proc.wait()
            if proc.returncode is not None:
                self.draining.remove((stage, proc, since))
                self.released(proc)
        gone = [(s, p) for s, procs in self.running.items() for p in procs if p.poll() is not None]
        for stage, proc in gone:
            self.running[stage].remove(proc)
            self.released(proc)
        return gone

    def processes(self) -> list[tuple[str, Popen[bytes]]]:
        """Every worker started and not yet reaped (running or draining), named."""
        drained = [(s, [p]) for s, p, _ in self.draining]
        return [(f"worker {s}", p) for s, ps in [*self.running.items(), *drained] for p in ps]

    async def run(
        self,
        settings: CommonSettings,
        *,
        interval_s: float = 1.0,
        watch: Callable[[], Awaitable[str | None]] | None = None,
        stop: asyncio.Event | None = None,
    ) -> str | None:
        """Tick until ``stop``, or until there is a reason to give up (a worker exited
        unasked and :attr:`crashed` says so, or ``watch`` does): then return it. The
        first tick starts each stage's ``min_n``; the caller stops what is left
        (:meth:`processes`).

        Args:
            settings: the Redis and namespace whose queues are read.
            interval_s: seconds between ticks.
            watch: looks after the other supervised processes at each tick; says why
                to give up (None while all is well).
            stop: set to end the loop; None: SIGINT or SIGTERM ends it.
        """
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM) if stop is None else ()
        stop = stop or asyncio.Event()
        for sig in sigs:
            loop.add_signal_handler(sig, stop.set)
        client = connect(settings)
        try:
            while not stop.is_set():
                for stage, proc in self.reap(time.monotonic()):
                    if self.crashed is None:
                        return f"worker {stage} (pid {proc.pid}) exited"
                    if why := await self.crashed(stage, proc):
                        return why
                if watch is not None and (why := await watch()):
                    return why
                try:
                    names = [s for key in self.scalers for s in key.split(",")]
                    got = [await stage_status(client, settings.keys, s) for s in names]
                    self.apply({st.stage: st for st in got}, time.monotonic())
                except (RedisError, OSError) as exc:
                    logger.warning("tick failed (%s); the next one retries", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_s)
            return None
        finally:
            await client.aclose()
            for sig in sigs:
                loop.remove_signal_handler(sig)
