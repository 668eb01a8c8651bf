"""``conveyor dlq``: a stage's dead letters listed, replayed or purged.

A dead letter (see :class:`~pipelines.records.DeadLetter`) keeps its request's envelope
untouched, so a replay sends the same request back to its stage with a fresh deadline,
on the stream of the lane it came in (``Keys.stage_stream(stage, req.lane)``).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any, cast

import redis.asyncio as aioredis

from pipelines.envelope import decode_request
from pipelines.errors import ConfigError, ConveyorError, EnvelopeError, UnknownStage
from pipelines.keys import Keys
from pipelines.records import DeadLetter
from pipelines.registry import load_registry
from pipelines.settings import CommonSettings, load_settings
from runtime.redisio import RedisClock, connect, enqueue, in_order, text
from runtime.status import known_stages, live_workers

Entry = tuple[bytes, dict[bytes, bytes]]

_STREAM_ID = re.compile(r"^[0-9]+(-[0-9]+)?$")


def stream_id(raw: str | None) -> str | None:
    """``--id``, checked before Redis sees it: a stream entry id (``<ms>-<seq>`` or
    ``<ms>``), as ``dlq list`` prints them."""
    if raw is not None and not _STREAM_ID.match(raw):
        raise ConfigError(
            f"--id {raw!r} is not a stream entry id (<ms>-<seq>, as `conveyor dlq list` "
            "prints them)"
        )
    return raw


async def dlq_command(
    action: str, stage: str, entry_id: str | None, timeout_s: float, force: bool = False
) -> int:
    """Run ``conveyor dlq ACTION STAGE``; returns the exit status.

    Args:
        action: ``list``, ``replay`` or ``purge``.
        stage: the stage whose dead letters these are.
        entry_id: only this dead letter (``--id``), else all of them.
        timeout_s: a replayed request's deadline, seconds from now.
        force: replay even when no worker serves the stage (``--force``): said on
            stderr, not refused.

    Raises:
        ConveyorError: a replay to a stage no live worker serves, without ``force``.
    """
    entry_id = stream_id(entry_id)
    settings = load_settings(CommonSettings)
    client = connect(settings)
    try:
        configured = load_registry(settings.app, settings.pipelines).stages
        known = await known_stages(client, settings.keys, configured)
        # A typo would list nothing, as if the stage had no dead letters.
        if stage not in known and not await _has_letters(client, settings.keys, stage):
            raise UnknownStage(f"unknown stage {stage!r}; known: {', '.join(known)}")
        if action == "replay" and not await live_workers(client, settings.keys, stage):
            # Its letters would wait on a stream nobody reads, their deadlines running out.
            unserved = f"no worker serves stage {stage!r} (none has a live heartbeat)"
            if not force:
                raise ConveyorError(
                    f"{unserved}: its replayed requests would wait on a stream nobody "
                    "reads; start its workers first, or replay anyway with --force"
                )
            print(
                f"conveyor: {unserved}: the replayed requests wait on its stream until one "
                "starts, within their --timeout",
                file=sys.stderr,
            )
        for keys in settings.keys.each():  # each partition has its own dead letters
            dlq = keys.dead_letters(stage)
            raw = await client.xrange(dlq, min=entry_id or "-", max=entry_id or "+") or []
            entries: list[Entry] = cast(list[Any], raw)
            if action == "list":
                _list(dlq, entries)
            elif action == "replay":
                await _replay(client, settings, keys, stage, entries, timeout_s)
            else:
                removed = await client.xdel(dlq, *[eid for eid, _ in entries]) if entries else 0
                print(f"purged {removed} dead letter(s) from {dlq}")
    finally:
        await client.aclose()
    return 0


async def _has_letters(client: aioredis.Redis, keys: Keys, stage: str) -> bool:
    """Whether ``stage`` has a dead-letter stream in some partition (whoever wrote it)."""
    for part in keys.each():  # one at a time: each partition is its own slot
        if await client.exists(part.dead_letters(stage)):
            return True
    return False


def _list(dlq: str, entries: list[Entry]) -> None:
    for eid, fields in entries:
        letter = DeadLetter.parse(fields)
        try:
            req = decode_request(fields)
            # attempt: how often it was replayed (deliveries count this entry's own).
            what = f"request {req.id} pipeline {req.pipeline} step {req.step} attempt={req.attempt}"
        except EnvelopeError as exc:
            what = f"undecodable entry ({exc})"
        print(f"{text(eid)}  {what}  deliveries={letter.deliveries}  {letter.error or ''}")
    print(f"{len(entries)} dead letter(s) in {dlq}")


async def _replay(
    client: aioredis.Redis,
    settings: CommonSettings,
    keys: Keys,
    stage: str,
    entries: list[Entry],
    timeout_s: float,
) -> None:
    dlq = keys.dead_letters(stage)
    clock = RedisClock()
    await clock.calibrate(client)
    replayed: Counter[str] = Counter()  # by the stream (lane) each went back to
    skipped: list[str] = []
    foreign: list[str] = []
    branches: list[str] = []
    registry = load_registry(settings.app, settings.pipelines)
    for eid, fields in entries:
        try:
            req = decode_request(fields)
        except EnvelopeError:  # nothing to run: left where it is, reported below
            skipped.append(text(eid))
            continue
        if keys.of(req.id).partition != keys.partition:
            # Not a request of this partition (written under another partition count):
            # its replay would cross slots. Left where it is, reported below.
            foreign.append(text(eid))
            continue
        pipeline = registry.pipelines.get(req.pipeline)
        if (
            pipeline is not None
            and req.step in pipeline.by_name
            and (pipeline.branch_end(req.step) is not None)
        ):
            # Its join was marked failed when it was dead-lettered and never fires:
            # run alone, it would answer nothing. The request must be sent again.
            branches.append(text(eid))
            continue
        again = req.model_copy(
            update={
                "stage": stage,  # back to the stream it was read from, whatever it claims
                "attempt": req.attempt + 1,
                "deadline": clock.now() + timeout_s,
                "enqueue_by": None,
            }
        )
        pipe = in_order(client)
        enqueue(pipe, keys, again)  # to the stage's stream of the request's lane
        pipe.xdel(dlq, eid)
        # Dead-lettering published the request's error; a replay may publish again.
        pipe.delete(keys.done(req.id, req.step))
        await pipe.execute()
        replayed[keys.stage_stream(stage, again.lane)] += 1
    if not replayed:
        print(f"replayed 0 dead letter(s) to {keys.stage_stream(stage)}")
    for stream, count in sorted(replayed.items()):
        print(f"replayed {count} dead letter(s) to {stream}")
    if branches:
        print(
            f"conveyor: skipped {len(branches)} dead letter(s) of a join's branch, "
            f"left in {dlq}: their join has failed, so they cannot complete alone; "
            f"send those requests again: {', '.join(branches)}",
            file=sys.stderr,
        )
    if foreign:
        print(
            f"conveyor: skipped {len(foreign)} dead letter(s) of requests of another "
            f"partition, left in {dlq} (written with another CONVEYOR_PARTITIONS; replay "
            f"them with that setting): {', '.join(foreign)}",
            file=sys.stderr,
        )
    if skipped:
        print(
            f"conveyor: skipped {len(skipped)} undecodable dead letter(s), left in "
            f"{dlq} (`conveyor dlq list {stage}` shows why): {', '.join(skipped)}",
            file=sys.stderr,
        )
