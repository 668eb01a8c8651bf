"""One MULTI/EXEC per batch: replies, hand-overs, join arrivals, the XACK and the stats.

Either all of a batch's effects happen with its ack or none do: a worker that dies
before EXEC leaves the whole batch pending, to be delivered again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis

from pipelines.envelope import FIELD, encode
from pipelines.keys import GROUP
from workers.route import Outbox

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
) -> None:
    """Publish a batch's outbox and ack its entries, atomically.

    Args:
        client: Redis client.
        out: what the batch produced.
        stream: the stage stream the entries came from.
        entry_ids: the batch's entry ids (all acked).
        stats_key: the stage's stats hash.
        stats: increments for it (``*:sum`` fields are floats).
        reply_maxlen: approximate cap on each reply stream.
        reply_ttl_s: reply streams expire this long after their last write.
    """
    pipe = client.pipeline(transaction=True)
    for reply_to, reply in out.replies:
        pipe.xadd(reply_to, encode(reply), maxlen=reply_maxlen, approximate=True)
    for reply_to in {reply_to for reply_to, _ in out.replies}:
        pipe.expire(reply_to, reply_ttl_s)
    for target, request in out.forwards:
        pipe.xadd(target, encode(request))
    for key, ttl in out.failed_joins:
        pipe.eval(FAIL_JOIN_SCRIPT, 1, key, ttl)
    for j in out.joins:
        pipe.eval(
            JOIN_SCRIPT, 2, j.key, j.stream,
            j.branch, j.output, j.expected, j.envelope, j.ttl_s, FIELD, b"b:",
        )  # fmt: skip
    if entry_ids:
        pipe.xack(stream, GROUP, *entry_ids)
    for name, value in stats.items():
        if name.endswith(":sum"):
            pipe.hincrbyfloat(stats_key, name, value)
        else:
            pipe.hincrby(stats_key, name, int(value))
    await pipe.execute()
