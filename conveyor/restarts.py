"""``conveyor up`` restarts a process that exits unasked, and gives up on a crash loop.

A worker killed by one input (a segfault, the OOM killer), or a gateway that died, is
started again after a backoff that doubles with each crash of that process within
:attr:`RestartSettings.window_s` (systemd's ``Restart=on-failure`` with a start limit,
supervisord's ``startretries``); once one process crashed
:attr:`RestartSettings.max_crashes` times within the window, ``up`` stops everything and
says why, as a crash loop will not mend itself. A process that exits with status 2 (a
configuration error: a bad setting, an app that does not import, a model that cannot be
built) or 3 (a gateway's port taken) is not restarted: it would fail the same way.

Each restart is said on ``up``'s output and counted in the stats hash of each stage the
worker served (:data:`~runtime.stats.RESTARTS`), which ``/metrics``
(``conveyor_stage_worker_restarts_total``) and ``/status.json`` (``worker_restarts``) read.
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
        max_crashes: ``up`` gives up (stops everything, exit status 1) once one process
            crashed this many times within ``window_s``.
        window_s: the crash-loop window, seconds.
        backoff_s: the wait before the first restart; each further crash within the
            window doubles it.
        max_backoff_s: the longest wait before a restart.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_RESTART_", extra="ignore")

    max_crashes: int = Field(default=5, ge=1, le=1000)
    window_s: float = Field(default=60.0, gt=0, le=86_400, allow_inf_nan=False)
    backoff_s: float = Field(default=0.5, ge=0, le=600, allow_inf_nan=False)
    max_backoff_s: float = Field(default=10.0, ge=0, le=600, allow_inf_nan=False)


@dataclass
class CrashLoop:
    """The crashes of each process, within the window: when to restart it, or whether
    to give up.

    Args:
        settings: the limits.
    """

    settings: RestartSettings
    crashes: dict[str, deque[float]] = field(default_factory=dict)  # by name, monotonic

    def crashed(self, name: str, now: float) -> float | None:
        """Record a crash of ``name``; the seconds to wait before restarting it, or None:
        it crashed :attr:`~RestartSettings.max_crashes` times within the window.

        Args:
            name: the process (``worker embed#0``, ``gateway``).
            now: monotonic time, seconds.
        """
        times = self.crashes.setdefault(name, deque())
        times.append(now)
        while now - times[0] > self.settings.window_s:
            times.popleft()
        if len(times) >= self.settings.max_crashes:
            return None
        return float(
            min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (len(times) - 1))
        )

    def giving_up(self, name: str, code: int | None) -> str:
        """Why ``up`` stops after ``name``'s last crash (exit status ``code``)."""
        s = self.settings
        return (
            f"{name} {exited(code)}: its {s.max_crashes} crash(es) within {s.window_s:g}s are "
            "a crash loop; giving up (CONVEYOR_RESTART_MAX_CRASHES, CONVEYOR_RESTART_WINDOW_S)"
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
