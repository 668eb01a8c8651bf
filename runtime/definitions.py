"""What a stage's workers agree on: its definition as the wire sees it.

A stage is known by its name alone: the gateway validates a request with its copy of the
stage, and whichever worker reads the entry validates it again with its own. Two copies
that differ (another app defining the same name, a half-done redeploy) refuse half the
requests the gateway accepted. So the first worker of a stage records the definition
its group serves (:func:`agree_on_definition`): a digest and a short summary of what
the wire contract depends on (name, kind, the input's JSON schema, the runner, whether
it streams, its OpenAI route; not its batching bounds or resources, which workers may
tune apart). A later worker with another definition refuses to start, with one line
naming what differs, while a worker of the recorded one is live; once none is (all
stopped), the new one replaces it (a redeploy). ``CONVEYOR_REPLACE_STAGE_DEFINITION``
replaces it even then (a deliberate change, its old workers to be stopped).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipelines.errors import ConfigError
from pipelines.keys import Keys
from pipelines.stages import Stage
from runtime.status import live_workers

logger = logging.getLogger(__name__)

SHOWN = 120
"""The most characters of one side of a difference a message shows."""


def _named(obj: Any) -> str:
    """An import path for a runner or model, the same in every process (never a repr,
    which may hold an address)."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, partial):
        return _named(obj.func)
    if not hasattr(obj, "__qualname__"):
        obj = type(obj)
    return f"{getattr(obj, '__module__', '?')}:{obj.__qualname__}"


PROSE = frozenset({"title", "description", "examples", "example"})
"""What a JSON schema says for readers only: a docstring's edit is no other contract."""

NAMES = frozenset({"properties", "$defs", "definitions", "patternProperties"})
"""The schema keys whose own keys are names (a field called ``title`` is kept)."""


def _contract(schema: Any, named: bool = False) -> Any:
    """``schema`` without its prose (:data:`PROSE`), at any depth."""
    if isinstance(schema, dict):
        return {
            k: _contract(v, not named and k in NAMES)
            for k, v in schema.items()
            if named or k not in PROSE
        }
    if isinstance(schema, list):
        return [_contract(v) for v in schema]
    return schema


def definition(stage: Stage) -> dict[str, Any]:
    """What of ``stage`` the wire contract depends on, as plain JSON values (its input
    schema without titles and descriptions)."""
    try:
        schema: Any = _contract(stage.input_model.model_json_schema())
    except Exception:  # a model pydantic cannot describe: its name stands for it
        schema = _named(stage.input_model)
    return {
        "name": stage.name,
        "kind": stage.kind,
        "input": schema,
        "runner": _named(stage.runner),
        "streaming": stage.streaming,
        "openai": stage.openai,
    }


def digest(summary: dict[str, Any]) -> str:
    """A short digest of a definition (equal definitions, equal digests)."""
    raw = orjson.dumps(summary, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()[:16]


def _short(value: Any) -> str:
    shown = orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    return shown if len(shown) <= SHOWN else shown[: SHOWN - 3] + "..."


def differences(recorded: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """What differs between two definitions, each as ``what: recorded -> mine`` (the
    input schema field by field)."""
    out: list[str] = []
    for name in sorted(set(recorded) | set(mine)):
        old, new = recorded.get(name), mine.get(name)
        if old == new:
            continue
        if name == "input" and isinstance(old, dict) and isinstance(new, dict):
            out += _schema_differences(old, new)
        else:
            out.append(f"{name}: {_short(old)} -> {_short(new)}")
    return out


def _schema_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out: list[str] = []
    old_fields, new_fields = old.get("properties") or {}, new.get("properties") or {}
    if isinstance(old_fields, dict) and isinstance(new_fields, dict):
        for field in sorted(set(old_fields) | set(new_fields)):
            if field not in new_fields:
                out.append(f"input field {field!r}: removed")
            elif field not in old_fields:
                out.append(f"input field {field!r}: added")
            elif old_fields[field] != new_fields[field]:
                was, now = _short(old_fields[field]), _short(new_fields[field])
                out.append(f"input field {field!r}: {was} -> {now}")
        rest = {k for k in set(old) | set(new) if k != "properties"}
        for key in sorted(rest):
            if old.get(key) != new.get(key):
                out.append(f"input {key}: {_short(old.get(key))} -> {_short(new.get(key))}")
    if not out:
        out.append(f"input schema: {_short(old)} -> {_short(new)}")
    return out


def _parse(raw: bytes | str | None) -> dict[str, Any] | None:
    """A recorded definition, or None when there is none or it is not one (read from
    Redis: a malformed record counts as none, and is replaced)."""
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("definition"), dict):
        return None
    if not isinstance(value.get("digest"), str):
        return None
    return value


AGREE = """
local recorded = redis.call('GET', KEYS[1])
local digest, me = ARGV[1], ARGV[3]
local was = false
if recorded then
  local ok, value = pcall(cjson.decode, recorded)
  if ok and type(value) == 'table' and type(value['digest']) == 'string' then
    was = value['digest']
  end
end
local live, holding = {}, {}
for i = 5, #ARGV do
  live[ARGV[i]] = true
  if was and was ~= digest and redis.call('HGET', KEYS[2], ARGV[i]) == was then
    table.insert(holding, ARGV[i])
  end
end
if was ~= digest and #holding > 0 and ARGV[4] ~= '1' then
  return {'differs', recorded, unpack(holding)}
end
local held = redis.call('HGETALL', KEYS[2])
for i = 1, #held, 2 do
  if not live[held[i]] then redis.call('HDEL', KEYS[2], held[i]) end
end
redis.call('HSET', KEYS[2], me, digest)
if was == digest then return {'same'} end
redis.call('SET', KEYS[1], ARGV[2])
if recorded then return {'replaced', recorded, unpack(holding)} end
return {'set'}
"""
"""Check and record in one step (two workers starting together see each other): the
record (KEYS[1]) set when missing, unreadable or held by no live worker (ARGV[5:], the
live others) of its definition (KEYS[2]: consumer -> digest), or when ARGV[4] is 1; a
worker that agrees adds itself to the holders, and drops the holders no longer live
(the hash stays as small as the stage's live workers)."""


async def agree_on_definition(
    client: aioredis.Redis,
    keys: Keys,
    stage: Stage,
    consumer: str,
    *,
    replace: bool = False,
) -> None:
    """Record ``stage``'s definition if none is, else check this worker's against it.

    The worker's heartbeat must already be set (:meth:`workers.alive.Presence.beat`), so
    that one starting at the same moment with another definition sees it live.

    Args:
        client: Redis client.
        keys: key names (the record is in partition 0).
        stage: the stage this worker serves.
        consumer: this worker's consumer name (its own earlier heartbeat, under a stable
            name, is no other worker).
        replace: replace a differing record even while workers of it are live.

    Raises:
        ConfigError: the recorded definition differs and a worker of it is live; the
            message names the differences and how to replace it.
    """
    mine = definition(stage)
    record = {"digest": digest(mine), "definition": mine}
    encoded = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
    name = stage.name
    try:
        live = await live_workers(client, keys, name) - {consumer}
        flag = "1" if replace else "0"
        args: list[str | bytes] = [digest(mine), encoded, consumer, flag, *sorted(live)]
        keys_ = [keys.stage_definition(name), keys.definition_holders(name)]
        answer = await client.eval(AGREE, 2, *keys_, *args)
    except ResponseError as exc:  # a key forged to another type: nothing to agree with
        logger.warning("stage %s: its definition cannot be recorded: %s", name, exc)
        return
    verdict = answer[0].decode() if isinstance(answer, list) and answer else ""
    if verdict in ("same", "set"):
        return
    parsed = _parse(answer[1]) if len(answer) > 1 else None
    diff = differences(parsed["definition"], mine) if parsed is not None else ["unreadable"]
    holding = sorted(h.decode(errors="replace") for h in answer[2:])
    if verdict == "differs":
        names = ", ".join(holding[:3]) + (" ..." if len(holding) > 3 else "")
        raise ConfigError(
            f"stage {name!r}: this worker's definition differs from the one its "
            f"live workers serve ({len(holding)}: {names}): {'; '.join(diff)}. Stop them "
            "first (a redeploy), or set CONVEYOR_REPLACE_STAGE_DEFINITION=true to "
            "replace it while they run"
        )
    if parsed is None:  # an unreadable record (forged, or of an older conveyor): set
        return
    logger.warning(
        "stage %s: its definition replaced (%s): %s",
        name,
        "by setting" if holding else "no worker of the old one is live",
        "; ".join(diff),
    )


async def check_served(client: aioredis.Redis, keys: Keys, stages: Iterable[Stage]) -> int:
    """Log an ERROR for each of ``stages`` (a gateway's copies, which it validates
    requests with) whose recorded definition differs from its own, naming the
    differences: requests it accepts may be refused by the stage's workers. A stage not
    recorded yet (no worker has started) is not checked. Returns how many differ."""
    differ = 0
    for stage in stages:
        try:
            recorded = _parse(await client.get(keys.stage_definition(stage.name)))
        except ResponseError:
            continue
        mine = definition(stage)
        if recorded is None or recorded["digest"] == digest(mine):
            continue
        differ += 1
        logger.error(
            "stage %s: this gateway's definition differs from the one its workers serve "
            "(requests it accepts may be refused by them; deploy the gateway with the "
            "same app): %s",
            stage.name,
            "; ".join(differences(recorded["definition"], mine)),
        )
    return differ
