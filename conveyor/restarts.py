"""``conveyor up`` restarts a process that exits unasked, and parks a crash loop.

A worker killed by one input (a segfault, the OOM killer), or a gateway that died, is
started again after a backoff that doubles with each crash of that process within
:attr:`RestartSettings.window_s` (systemd's ``Restart=on-failure`` with a start limit,
supervisord's ``startretries``). Crashes are counted per process: a replica's slot
(``worker embed#1``, restarted in place), an autoscaled worker by its pid once it had
started to serve (its crashes are its own: five workers killed once each are no loop),
and the autoscaled workers of a stage that die before they serve together (a model that
cannot start kills every one the same way).

A crash after progress is no loop: a worker that crashes on a poison input is restarted,
and the next one charges the crash to the inputs that were on the model, runs them alone
and dead-letters the one that kills (:mod:`workers.crashes`). So a process's count
starts again when the process that crashed had done some work first (published a batch
or a dead letter, or charged a crash to its inputs), which it says on its pipe
(:func:`runtime.exits.progressed`): per process, so one replica that crashes on every
batch is not kept out of its loop by a healthy sibling. Once a process crashed
:attr:`RestartSettings.max_crashes` times within the window with no progress between,
its worker group is **parked**: its processes are stopped, its stages answer 503 with a
Retry-After naming why (``/status`` and ``/metrics`` show it), and it is started again
after :attr:`RestartSettings.park_s`, doubling with each park up to
:attr:`RestartSettings.max_park_s`; a gateway in a loop is parked alone. The other
stages, the gateways and Redis go on; ``up`` exits only when asked, on a configuration
error (a status 2 or 3 that the process also said on its pipe,
:func:`runtime.exits.exit_for`: a bad setting, an app that does not import, a model that
cannot be built, the port), or when its embedded Redis cannot be kept running.

Each restart is said on ``up``'s output and counted in the stats hash of each stage the
worker served (:data:`~runtime.stats.RESTARTS`), which ``/metrics``
(``conveyor_stage_worker_restarts_total``) and ``/status.json`` (``worker_restarts``) read.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.records import Parked
from pipelines.settings import CommonSettings
from runtime.redisio import connect
from runtime.stats import RESTARTS

NOT_RESTARTED = {
    2: "a configuration error (a setting, the app, a model that cannot be built)",
    3: "its port could not be bound",
}
"""Exit statuses meaning a restart would fail the same way, and what each says."""


class RestartSettings(BaseSettings):
    """How ``up`` restarts its processes: ``CONVEYOR_RESTART_*`` variables.

    Attributes:
        max_crashes: ``up`` parks a process's worker group once it crashed this many
            times within ``window_s`` with no progress between (see the module).
        window_s: the crash-loop window, seconds.
        backoff_s: the wait before the first restart; each further crash within the
            window doubles it.
        max_backoff_s: the longest wait before a restart.
        park_s: how long a crash loop's group is first parked; each further park of it
            doubles the time.
        max_park_s: the longest park.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_RESTART_", extra="ignore")

    max_crashes: int = Field(default=5, ge=1, le=1000)
    window_s: float = Field(default=60.0, gt=0, le=86_400, allow_inf_nan=False)
    backoff_s: float = Field(default=0.5, ge=0, le=600, allow_inf_nan=False)
    max_backoff_s: float = Field(default=10.0, ge=0, le=600, allow_inf_nan=False)
    park_s: float = Field(default=30.0, gt=0, le=86_400, allow_inf_nan=False)
    max_park_s: float = Field(default=600.0, gt=0, le=86_400, allow_inf_nan=False)


@dataclass
class CrashLoop:
    """The crashes of each process, within the window: when to restart it, or whether
    it is in a loop; and how long each group's next park lasts.

    Args:
        settings: the limits.
    """

    settings: RestartSettings
    crashes: dict[str, deque[float]] = field(default_factory=dict)  # by name, monotonic
    parks: dict[str, int] = field(default_factory=dict)  # by group: parks so far

    def crashed(self, name: str, now: float, progressed: bool = False) -> float | None:
        """Record a crash of ``name``; the seconds to wait before restarting it, or None:
        it crashed :attr:`~RestartSettings.max_crashes` times within the window, with no
        progress between (a loop).

        Args:
            name: the process (``worker embed#0``, ``gateway``).
            now: monotonic time, seconds.
            progressed: the process that crashed did some work first (it said so:
                :func:`runtime.exits.progressed`); its count starts again.
        """
        for other in [n for n, t in self.crashes.items() if now - t[-1] > self.settings.window_s]:
            del self.crashes[other]  # names seen once (autoscaled workers) do not pile up
        times = self.crashes.setdefault(name, deque())
        if progressed:
            times.clear()  # it did work since its last crash: that was no loop
        times.append(now)
        while now - times[0] > self.settings.window_s:
            times.popleft()
        if len(times) >= self.settings.max_crashes:
            return None
        return float(
            min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (len(times) - 1))
        )

    def forget(self, name: str) -> None:
        """Start ``name``'s count again (its group was parked, or is back)."""
        self.crashes.pop(name, None)

    def park(self, group: str) -> float:
        """Seconds to park ``group`` for, now that it looped: doubling with each park."""
        n = self.parks[group] = self.parks.get(group, 0) + 1
        return float(min(self.settings.max_park_s, self.settings.park_s * 2 ** (n - 1)))

    def looping(self, name: str, code: int | None) -> str:
        """Why ``name``'s group is parked after its last crash (exit status ``code``)."""
        s = self.settings
        return (
            f"{name} {exited(code)}: {s.max_crashes} crash(es) within {s.window_s:g}s with "
            "no work done between (CONVEYOR_RESTART_MAX_CRASHES, CONVEYOR_RESTART_WINDOW_S)"
        )


def exited(code: int | None) -> str:
    """How a process ended, in words: ``exited (1)``, ``was killed by SIGKILL``."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited ({code})"


async def mark_parked(
    settings: CommonSettings, stages: Iterable[str], why: str, for_s: float | None
) -> None:
    """Say in Redis that ``stages`` are parked for ``for_s`` seconds because ``why``
    (:class:`~pipelines.records.Parked`), or (``for_s`` None) that they are back.

    Raises:
        RedisError, OSError: Redis could not be reached (the caller says so and goes on).
    """
    client = connect(settings)
    key = settings.keys.parked()
    try:
        for stage in stages:
            if for_s is None:
                await client.hdel(key, stage)
            else:
                await client.hset(key, stage, Parked(why, time.time() + for_s).encode())
    finally:
        await client.aclose()


async def count_restart(settings: CommonSettings, stages: Iterable[str]) -> None:
    """Add one restart to each of ``stages``' stats (:data:`~runtime.stats.RESTARTS`).

    Args:
        settings: where Redis is.
        stages: the stages the restarted worker serves.

    Raises:
        RedisError, OSError: Redis could not be reached (the caller says so and goes on).
    """
    client = connect(settings)
    try:
        for stage in stages:  # one at a time: on a cluster each is in its own slot
            await client.hincrby(settings.keys.stage_stats(stage), RESTARTS, 1)
    finally:
        await client.aclose()
