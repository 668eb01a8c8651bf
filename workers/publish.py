"""One MULTI/EXEC per batch: replies, hand-overs, join arrivals, the XACK and the stats.

Either all of a batch's effects happen with its ack or none do: a worker that dies
before EXEC leaves the whole batch pending, to be delivered again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError
from redis.typing import EncodableT, FieldT

from pipelines.envelope import BRANCH, FIELD, Reply, encode
from pipelines.keys import GROUP
from workers.route import Effects, Outbox

JOIN_SCRIPT = """
-- KEYS[1]: the join hash, KEYS[2]: the join step's stream
-- ARGV: branch, branch output (JSON), branches expected, join envelope (JSON), ttl seconds
-- Returns 1 when this arrival completed the join and enqueued the join step, 0 while
-- branches are missing, -1 when the join already failed or already fired.
if redis.call('HEXISTS', KEYS[1], '!failed') == 1 then
  return -1
end
if redis.call('HEXISTS', KEYS[1], '!done') == 1 then
  return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
local all = redis.call('HGETALL', KEYS[1])
local fields = {ARGV[6], ARGV[4]}
for i = 1, #all, 2 do
  fields[#fields + 1] = ARGV[7] .. all[i]
  fields[#fields + 1] = all[i + 1]
end
if (#fields - 2) / 2 < tonumber(ARGV[3]) then
  return 0
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HSET', KEYS[1], '!done', '1')
return 1
"""

FAIL_JOIN_SCRIPT = """
-- KEYS[1]: the join hash; ARGV[1]: ttl seconds. A failed branch stops the join firing.
if redis.call('HEXISTS', KEYS[1], '!done') == 0 then
  redis.call('HSET', KEYS[1], '!failed', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return 0
"""


def job_fields(reply: Reply) -> dict[FieldT, EncodableT]:
    """A job hash's fields once its request has finished with ``reply``."""
    if reply.outcome == "ok":
        return {
            "status": "done",
            "result": orjson.dumps(reply.result).decode(),
            "http_status": "200",
        }
    status = "expired" if reply.outcome == "expired" else "failed"
    code = 504 if reply.outcome == "expired" else reply.status
    return {"status": status, "error": reply.error or "", "http_status": str(code)}


async def publish(
    client: aioredis.Redis,
    out: Outbox,
    *,
    stream: str,
    entry_ids: Sequence[bytes],
    stats_key: str,
    stats: Mapping[str, float],
    reply_maxlen: int,
    reply_ttl_s: int,
    job_prefix: str = "",
    job_ttl_s: int = 86_400,
    dead_letters: Sequence[tuple[str, dict[FieldT, EncodableT]]] = (),
    gauges: Mapping[str, float] | None = None,
) -> int:
    """Publish a batch's outbox and ack its entries, atomically.

    Each request's effects are guarded by its "done" marker: the markers are WATCHed and
    read, and a request whose marker exists (its step already published, by this or
    another worker) is skipped. If another worker sets a watched marker before EXEC, the
    transaction aborts and is rebuilt.

    Args:
        client: Redis client.
        out: what the batch produced.
        stream: the stage stream the entries came from.
        entry_ids: the batch's entry ids (all acked).
        stats_key: the stage's stats hash.
        stats: increments for it (``*:sum`` fields are floats).
        reply_maxlen: approximate cap on each reply stream.
        reply_ttl_s: reply streams expire this long after their last write.
        job_prefix: replies addressed to keys with this prefix are async jobs' results:
            stored in the job's hash (kept ``job_ttl_s``) instead of streamed.
        job_ttl_s: how long a finished job's record is kept.
        dead_letters: (dead-letter stream, fields) to add.
        gauges: values to set (not add) in the stats hash, e.g. the learned cost model.

    Returns:
        How many requests were skipped as already published.
    """
    markers = list(out.effects)
    async with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                skipped: set[str] = set()
                if markers:
                    await pipe.watch(*markers)
                    found = await pipe.mget(markers)
                    skipped = {m for m, v in zip(markers, found, strict=True) if v is not None}
                pipe.multi()  # type: ignore[no-untyped-call]
                streams: set[str] = set()
                for marker, effects in out.effects.items():
                    if marker not in skipped:
                        pipe.set(marker, b"1", ex=effects.marker_ttl_s)
                        _queue_effects(pipe, effects, streams, reply_maxlen, job_prefix, job_ttl_s)
                for reply_to in streams:
                    pipe.expire(reply_to, reply_ttl_s)
                for dlq, fields in dead_letters:
                    pipe.xadd(dlq, fields)
                if entry_ids:
                    pipe.xack(stream, GROUP, *entry_ids)
                if gauges:
                    values: dict[FieldT, EncodableT] = {k: v for k, v in gauges.items()}
                    pipe.hset(stats_key, mapping=values)
                for name, value in stats.items():
                    if name.endswith(":sum"):
                        pipe.hincrbyfloat(stats_key, name, value)
                    else:
                        pipe.hincrby(stats_key, name, int(value))
                await pipe.execute()
                return len(skipped)
            except WatchError:
                continue  # a duplicate finished meanwhile: re-read the markers


def _queue_effects(
    pipe: Pipeline,
    effects: Effects,
    streams: set[str],
    reply_maxlen: int,
    job_prefix: str,
    job_ttl_s: int,
) -> None:
    for reply_to, reply in effects.replies:
        if job_prefix and reply_to.startswith(job_prefix):
            pipe.hset(reply_to, mapping=job_fields(reply))
            pipe.expire(reply_to, job_ttl_s)
        else:
            pipe.xadd(reply_to, encode(reply), maxlen=reply_maxlen, approximate=True)
            streams.add(reply_to)
    for target, request in effects.forwards:
        pipe.xadd(target, encode(request))
    for key, ttl in effects.failed_joins:
        pipe.eval(FAIL_JOIN_SCRIPT, 1, key, ttl)
    for j in effects.joins:
        pipe.eval(
            JOIN_SCRIPT, 2, j.key, j.stream,
            j.branch, j.output, j.expected, j.envelope, j.ttl_s, FIELD, BRANCH,
        )  # fmt: skip
