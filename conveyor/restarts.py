"""``conveyor up``'s restart policy for a process that exits unasked.

It is started again after a backoff that doubles with each of its crashes within
:attr:`RestartSettings.window_s` (systemd's ``Restart=on-failure`` with a start limit).
Crashes are counted per process: a replica's slot (``worker embed#1``), an autoscaled
worker by its pid once it served (five workers killed once each are no loop), and the
autoscaled workers of a stage that die before they serve, together. A crash after
progress starts the count again (the process said so on its pipe,
:func:`runtime.exits.progressed`: a worker that crashed on a poison input, whose inputs
the next one runs alone). :attr:`RestartSettings.max_crashes` crashes within the window
with no progress between are a loop: the process's worker group (a gateway: itself) is
parked (:mod:`conveyor.parks`) for :attr:`RestartSettings.park_s`, doubling with each
park up to :attr:`RestartSettings.max_park_s`. A status 2 or 3 that the process also
said on its pipe (:data:`NOT_RESTARTED`) is a configuration error no restart would
mend: ``up`` stops. Each restart is counted in the stats of the stages the worker
served (:data:`~runtime.stats.RESTARTS`).
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

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
