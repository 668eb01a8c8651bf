"""Where each worker process runs, so that a worker on the same machine can tell a dead
one's entries at once instead of waiting out the reclaim idle time.

A worker killed (kill -9, the OOM killer, an input that ends the process) leaves its
entries pending under its consumer name; any worker takes them back once they have been
idle ``min_idle_ms`` (:func:`workers.claims.claim_idle`). A restarted worker has a new
name, so each crash of a poison input used to cost its caller that idle time again, and
a caller promised a prompt 500 got a 504. So each worker records where it runs
(:func:`remember`): the machine's boot id, its pid namespace, its pid and the pid's start
time. Another worker that sees the same boot id and pid namespace can ask the kernel
whether that process still runs (:func:`gone`): if not (or the pid now names another
process), the dead worker's entries are taken back at once (:func:`take_from_dead`),
sorted by their marks as any reclaim's. Where it cannot tell (another machine, another
container, no ``/proc``), nothing changes: the idle time decides.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.keys import GROUP, Keys
from runtime.redisio import group_missing, text
from workers.claims import sort_out
from workers.values import Claimed

logger = logging.getLogger(__name__)

PLACE_TTL_S = 86_400
"""The hash of places outlives any worker's gap between two starts; each start pushes
its expiry back."""

_PROC = Path("/proc")


def _start_time(pid: int) -> str | None:
    """The start time (clock ticks since boot) of ``pid``, None when it is a zombie
    (exited, not yet reaped); raises :class:`OSError` where its stat cannot be read."""
    stat = (_PROC / str(pid) / "stat").read_text()  # raises OSError where unreadable
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # the 22nd field; the fields after the name start at the 3rd


def _machine() -> tuple[str, str] | None:
    """This machine's boot id and this process's pid namespace; None where unknown."""
    try:
        boot = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        pidns = os.readlink(_PROC / "self/ns/pid")
    except OSError:
        return None
    return boot, pidns


def here() -> str | None:
    """Where this process runs: ``<boot id>|<pid namespace>|<pid>|<start time>``; None
    where the kernel cannot say (not Linux)."""
    machine = _machine()
    try:
        started = _start_time(os.getpid())
    except OSError:
        return None
    if machine is None or started is None:
        return None
    return "|".join((*machine, str(os.getpid()), started))


def gone(place: str) -> bool:
    """Whether the process recorded at ``place`` has certainly ended: it ran on this
    machine, in this pid namespace, and its pid runs no more or names a process started
    later. False whenever that cannot be told (``place`` is read from Redis: anything
    malformed is no proof of death)."""
    machine = _machine()
    parts = place.split("|")
    if machine is None or len(parts) != 4 or tuple(parts[:2]) != machine:
        return False
    pid, started = parts[2], parts[3]
    if not pid.isdigit() or not 0 < int(pid) < 2**22 or not started.isdigit():
        return False
    try:  # signal 0: "no such process" whatever /proc lets this user see (hidepid)
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        pass
    try:
        return _start_time(int(pid)) != started
    except OSError:  # hidden (hidepid) or unreadable: no proof of death
        return False


async def remember(client: aioredis.Redis, keys: Keys, stage: str, consumer: str) -> None:
    """Record where this worker runs (before its first read), under its consumer name."""
    place = here()
    if place is None:
        return
    key = keys.places(stage)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, consumer, place)
    pipe.expire(key, PLACE_TTL_S)
    try:
        await pipe.execute()
    except ResponseError as exc:  # a key forged to another type: the idle time decides
        logger.warning("stage %s: could not record where this worker runs: %s", stage, exc)


TAKE_SCRIPT = """
-- KEYS[1]: stream; ARGV[1]: group, ARGV[2]: the dead consumer, ARGV[3]: this consumer,
-- ARGV[4]: how many. Moves up to that many of the dead consumer's pending entries to this
-- one (no delivery counted: JUSTID), checked and moved in one step, so two workers that
-- both find the dead one never take the same entry from each other. Returns the ids.
local rows = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[2])
if #rows == 0 then return {} end
local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0}
for i = 1, #rows do args[#args + 1] = rows[i][1] end
args[#args + 1] = 'JUSTID'
return redis.call(unpack(args))
"""


async def take_from_dead(
    client: aioredis.Redis,
    keys: Keys,
    stage: str,
    streams: Sequence[str],
    consumer: str,
    count: int,
) -> Claimed:
    """Take back at once up to ``count`` entries of ``streams`` (interactive first) held
    by consumers whose process is known to have ended (:func:`gone`), sorted by their
    marks as :func:`~workers.claims.claim_idle` sorts what it takes; a dead consumer
    left holding nothing has its place removed."""
    holding: dict[str, list[str]] = {}  # consumer -> the streams it holds entries of
    for stream in streams:
        try:
            members: list[dict[str, Any]] = await client.xinfo_consumers(stream, GROUP)
        except ResponseError as exc:
            if group_missing(exc):
                continue
            raise
        for member in members:
            name = text(member["name"])
            if name != consumer and int(member.get("pending", 0)) > 0:
                holding.setdefault(name, []).append(stream)
    if not holding:
        return Claimed()
    key = keys.places(stage)
    names = list(holding)
    pipe = client.pipeline(transaction=False)
    for name in names:  # HGET each (a deployment's ACL may predate HMGET's grant)
        pipe.hget(key, name)
    try:
        places = await pipe.execute()
    except ResponseError:  # a key forged to another type: the idle time decides
        return Claimed()
    out = Claimed()
    for name, place in zip(names, places, strict=True):
        if count <= 0 or not isinstance(place, bytes) or not gone(place.decode(errors="replace")):
            continue
        drained = True
        for stream in holding[name]:
            if count <= 0:
                drained = False
                break
            raw = await client.eval(TAKE_SCRIPT, 1, stream, GROUP, name, consumer, count)
            ids = [i if isinstance(i, bytes) else str(i).encode() for i in raw or []]
            drained = drained and len(ids) < count
            if ids:
                logger.warning(
                    "stage %s: worker %s died holding %d entr%s of %s; taken back at once",
                    stage,
                    name,
                    len(ids),
                    "y" if len(ids) == 1 else "ies",
                    stream,
                )
                out += await sort_out(client, keys, stream, consumer, ids)
                count -= len(ids)
        if drained:  # nothing more to look for under its name
            await client.hdel(key, name)
    return out
