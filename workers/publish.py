"""One round trip per batch: replies, hand-overs, join arrivals, the XACK and the stats.

A batch's effects are one Lua script call (EVALSHA), which Redis runs atomically: either
all of them happen with the ack or none do, and a worker that dies before the call leaves
the whole batch pending, to be delivered again. A script that fails midway would break
that (Redis keeps what it wrote before the error), so the script first checks the type of
every key it writes (a stream for XADD, a hash for HSET; absent is fine) and writes
nothing if a request's effects would meet a key of another type (a key something else
SET): it names those requests instead, and :class:`Publisher` dead-letters them and
publishes the rest of the batch in a second call (:mod:`workers.refused`). A key the
batch itself writes whatever its requests (the stats hash, the dead-letter stream, the
acked stage streams) is skipped if it holds another type, and named: the worker logs it
and goes on answering. The script is generic: Python compiles the
outbox into a small plan of Redis commands (:class:`Plan`) and the script runs it, so what
a batch does is decided in one place (:mod:`workers.route`) and written here once.

A call is safe to repeat: each request's effects and its outcome counter are guarded by
the request's "done" marker, and the call as a whole by a token key of its own, so a call
that Redis ran but whose answer was lost (the connection died) does nothing the second
time. That is what lets :func:`publish` retry: at once on a fresh connection, and while
Redis refuses or is unreachable, for a while (:func:`patiently`).

A request cancelled while its step ran (its ``Keys.cancelled`` marker exists when the
script runs) publishes none of its effects: no reply, no hand-over, no join arrival, no
job record written over the one its cancellation wrote. It counts ``cancelled`` instead
of its outcome, under its "done" marker as well; its entry is acknowledged with the rest.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from hashlib import sha1

import orjson
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT, FieldT

from pipelines.envelope import BRANCH, FIELD, encode
from pipelines.keys import GROUP
from pipelines.outcomes import Outcome
from pipelines.records import job_finished
from runtime.exits import progressed
from runtime.redisio import REDIS_DOWN, Backoff, on_live_connection, text
from workers.batch import Entry, by_stream
from workers.crashes import marks
from workers.refused import set_aside
from workers.route import Effects, Outbox, Router
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)

TOKEN_TTL_S = 30
"""A publish call's token outlives any retry of it by far (see :data:`RETRY_S`)."""

RETRY_S = TOKEN_TTL_S / 2
"""How long a publish is retried while Redis refuses it or cannot be reached (BUSY, OOM,
an outage: :data:`~runtime.redisio.REDIS_DOWN`), backing off, before the batch is left
pending to be reclaimed. Well inside the token's life, so the repeat of a call that did
run is a no-op."""

DROPPED_TTL_S = 3600
"""How long the marker of a counted undecodable entry is kept: a second worker can only
hold the same entry while it is pending, which a stall of this length would outlast."""

PUBLISH_SCRIPT = """
-- KEYS: every key the batch touches. ARGV[1]: the plan (JSON); ARGV[2..]: the values.
-- The plan is {"t": token, "tt": ttl, "g": groups, "a": commands}. If the token key
-- exists, this very call has run before (its answer was lost): nothing runs again and
-- the first run's answer (kept in it) is returned; else it is set (tt seconds) at the
-- end. A group is [marker, ttl, command...]: its commands run only if its "done" marker
-- is absent, and then the marker is set (ttl seconds), so a step that ran twice
-- publishes (and counts its outcome) once. "a" runs once per call (ack, batch stats, dead letters).
-- In a command, a string is itself, a number n >= 1 is ARGV[n + 1] and -n is KEYS[n].
-- JOIN and FAILJOIN are the join operations below; ONCE marker ttl command... runs its
-- commands only if a second marker is absent too, and sets it (the answer of a failed
-- branch, shared by its join's branches); UNLESS key otherwise command... runs its
-- commands only if key is absent, else the one command otherwise (a request cancelled
-- while it ran: its count alone); any other name is a Redis command.
-- Before anything is written, plan.k (each key's type: 'stream', 'hash', '' for any)
-- is checked: a key of another type (a missing one is fine) would fail its command midway
-- through the call, after earlier commands had run. If a group that would run meets one,
-- nothing runs: the answer is {0, {}, refused} where refused lists marker, key, type of
-- each such group. A key of plan.s (written by the call itself, "a": stats, dead letters,
-- acks) of another type is not a request's fault: every command writing it is skipped.
-- Returns {skipped, cancelled, {}, broken}: how many groups were skipped as already
-- published, the markers of those whose UNLESS found its key (cancelled), and the keys
-- of plan.s skipped for their type.
local function value(t)
  if type(t) == 'number' then
    if t < 0 then return KEYS[-t] end
    return ARGV[t + 1]
  end
  return t
end

-- A branch output arrives at a join hash; the last one enqueues the join step with every
-- branch's output as a field (prefix .. branch). A join that failed or fired stays so.
local function join(key, stream, branch, output, expected, envelope, ttl, field, prefix)
  if redis.call('HEXISTS', key, '!failed') == 1 or redis.call('HEXISTS', key, '!done') == 1 then
    return
  end
  redis.call('HSET', key, branch, output)
  redis.call('EXPIRE', key, ttl)
  local all = redis.call('HGETALL', key)
  if #all / 2 < tonumber(expected) then
    return
  end
  local fields = {field, envelope}
  for i = 1, #all, 2 do
    fields[#fields + 1] = prefix .. all[i]
    fields[#fields + 1] = all[i + 1]
  end
  redis.call('XADD', stream, '*', unpack(fields))
  redis.call('HSET', key, '!done', '1')
end

-- A failed branch stops its join from ever firing.
local function failjoin(key, ttl)
  if redis.call('HEXISTS', key, '!done') == 0 then
    redis.call('HSET', key, '!failed', '1')
    redis.call('EXPIRE', key, ttl)
  end
end

local plan = cjson.decode(ARGV[1])
local wrong, muted, broken = {}, {}, {}
for i, want in ipairs(plan.k) do
  if want ~= '' then
    local have = redis.call('TYPE', KEYS[i])['ok']
    if have ~= 'none' and have ~= want then wrong[i] = have end
  end
end
for _, i in ipairs(plan.s) do
  if wrong[i] then
    muted[i] = true
    broken[#broken + 1] = KEYS[i]
  end
end

-- The first key of a wrong type that a command (or a group) would write, or nil.
local function culprit(command)
  for i = 1, #command do
    local t = command[i]
    if type(t) == 'table' then
      local n = culprit(t)
      if n then return n end
    elseif type(t) == 'number' and t < 0 and wrong[-t] and not muted[-t] then
      return -t
    end
  end
  return nil
end

local function run(command)
  if command[1] == 'UNLESS' then
    if redis.call('EXISTS', value(command[2])) == 1 then
      run(command[3])
      return true
    end
    for i = 4, #command do run(command[i]) end
    return false
  end
  if command[1] == 'ONCE' then
    local marker = value(command[2])
    if redis.call('EXISTS', marker) == 0 then
      redis.call('SET', marker, '1', 'EX', command[3])
      for i = 4, #command do run(command[i]) end
    end
    return
  end
  if type(command[2]) == 'number' and command[2] < 0 and muted[-command[2]] then
    return
  end
  local args = {}
  for i = 1, #command do args[i] = value(command[i]) end
  if args[1] == 'JOIN' then
    join(unpack(args, 2))
  elseif args[1] == 'FAILJOIN' then
    failjoin(args[2], args[3])
  else
    redis.call(unpack(args))
  end
end

local token = value(plan.t)
local first = redis.call('GET', token)
if first then return cjson.decode(first) end
local refused = {}
for _, group in ipairs(plan.g) do
  if redis.call('EXISTS', value(group[1])) == 0 then
    local n = culprit(group)
    if n then
      refused[#refused + 1] = value(group[1])
      refused[#refused + 1] = KEYS[n]
      refused[#refused + 1] = wrong[n]
    end
  end
end
if #refused > 0 then return {0, {}, refused, broken} end
local skipped, cancelled = 0, {}
for _, group in ipairs(plan.g) do
  local marker = value(group[1])
  if redis.call('EXISTS', marker) == 1 then
    skipped = skipped + 1
  else
    redis.call('SET', marker, '1', 'EX', group[2])
    for i = 3, #group do
      if run(group[i]) then cancelled[#cancelled + 1] = marker end
    end
  end
end
for _, command in ipairs(plan.a) do run(command) end
local answer = {skipped, cancelled, {}, broken}
redis.call('SET', token, cjson.encode(answer), 'EX', plan.tt)
return answer
"""
PUBLISH_SHA = sha1(PUBLISH_SCRIPT.encode()).hexdigest()

Token = str | int
"""A plan token: a literal string, a value's number (>= 1) or a key's number (<= -1)."""

STREAM, HASH = "stream", "hash"
"""The types (as Redis's TYPE names them) a plan's keys must have, where absent."""


@dataclass(frozen=True)
class Published:
    """What one publish call did.

    Attributes:
        skipped: how many requests were skipped as already published.
        cancelled: the "done" markers of the requests found cancelled (nothing of them
            was published; each counted ``cancelled``).
        refused: the requests whose effects would have written a key holding another
            type: (key, its type) by "done" marker. When a call answers any, it wrote
            nothing at all (:class:`Publisher` publishes the rest again without them).
        broken: keys the call writes whatever its requests (stats hash, dead-letter
            stream, acked streams) that hold another type: what it would write there was
            skipped.
    """

    skipped: int = 0
    cancelled: frozenset[str] = frozenset()
    refused: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    broken: frozenset[str] = frozenset()


class Plan:
    """The commands of one batch, with every key and value passed out of band.

    Keys go in KEYS (so a cluster proxy can see them, all in one hash tag's slot) and
    values in ARGV, so results of any size or encoding never pass through JSON.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.types: list[str] = []  # what each key must hold where it exists ("": any)
        self.own: set[int] = set()  # the numbers of the keys the call itself writes
        self.values: list[EncodableT] = []
        self.groups: list[list[object]] = []
        self.always: list[list[Token]] = []
        self.token: Token = ""
        self._key_numbers: dict[str, int] = {}

    def key(self, name: str, kind: str = "") -> int:
        """The token of key ``name`` (each key is passed once), which the commands that
        use it need to be of type ``kind`` where it exists ("": any type does)."""
        number = self._key_numbers.get(name)
        if number is None:
            self.keys.append(name)
            self.types.append(kind)
            number = self._key_numbers[name] = len(self.keys)
        elif kind:
            had = self.types[number - 1]
            if had and had != kind:  # the key names keep each kind apart (pipelines/keys.py)
                raise ValueError(f"key {name!r} would be written as a {had} and a {kind}")
            self.types[number - 1] = kind
        return -number

    def own_key(self, name: str, kind: str) -> int:
        """The token of a key the call writes whatever its requests (stats, dead letters,
        acks): of another type, its commands are skipped, no request refused."""
        token = self.key(name, kind)
        self.own.add(-token)
        return token

    def value(self, value: EncodableT) -> int:
        """The token of ``value``."""
        self.values.append(value)
        return len(self.values)

    def script_args(self) -> list[EncodableT]:
        """ARGV: the plan, then the values."""
        plan = {
            "t": self.token,
            "tt": str(TOKEN_TTL_S),
            "g": self.groups,
            "a": self.always,
            "k": self.types,
            "s": sorted(self.own),
        }
        return [orjson.dumps(plan), *self.values]


async def publish(
    client: aioredis.Redis,
    out: Outbox,
    *,
    stream: str = "",
    entry_ids: Sequence[bytes] = (),
    acks: Mapping[str, Sequence[bytes]] | None = None,
    stats_key: str,
    stats: Mapping[str, float],
    reply_maxlen: int,
    reply_ttl_s: int,
    token_key: str,
    job_prefix: str = "",
    job_ttl_s: int = 86_400,
    dead_letters: Sequence[tuple[str, dict[FieldT, EncodableT]]] = (),
    gauges: Mapping[str, float] | None = None,
    dropped: Sequence[str] = (),
    unmark: Sequence[str] = (),
) -> Published:
    """Publish a batch's outbox and ack its entries, atomically, in one round trip.

    Each request's effects, and the count of its outcome (``items:<outcome>`` in the
    stats hash), are guarded by its "done" marker: a request whose marker exists (its
    step already published, by this or another worker) is skipped, so the counters equal
    the requests answered. A request whose ``Effects.cancel_marker`` exists publishes
    nothing and counts ``items:cancelled`` (unless it already ends ``cancelled``: that
    ending is what it publishes). If the connection dies under the call, it is retried
    once on a fresh connection; ``token_key`` makes the retry a no-op if the first call
    did run.

    Args:
        client: Redis client.
        out: what the batch produced.
        stream: the stage stream ``entry_ids`` came from (a batch of one lane).
        entry_ids: entry ids to ack on ``stream``.
        acks: entry ids to ack, by the stream (lane) each came from: a batch that mixes
            lanes acks each on its own stream, in the same call (and ``stream`` with
            ``entry_ids``, if given, as well).
        stats_key: the stage's stats hash.
        stats: batch-level increments for it (``*:sum`` fields are floats), added once
            per call, unguarded (see :func:`runtime.stats.batch_fields`).
        reply_maxlen: approximate cap on each reply stream.
        reply_ttl_s: reply streams expire this long after their last write.
        token_key: a key unique to this call (``Keys.publish_token``), set by it.
        job_prefix: replies addressed to keys with this prefix are async jobs' results:
            stored in the job's hash (kept ``job_ttl_s``) instead of streamed.
        job_ttl_s: how long a finished job's record is kept.
        dead_letters: (dead-letter stream, fields) to add.
        gauges: values to set (not add) in the stats hash, e.g. the learned cost model.
        dropped: markers (``Keys.dropped``) of entries that could not be decoded and are
            acked unanswered: each counts one ``items:error``, once.
        unmark: the batch's on-model marks (:mod:`workers.crashes`), deleted with the ack:
            a crash from then on is not the batch's.

    Returns:
        How many requests were skipped as already published, and which were cancelled;
        or which requests' effects meet a key of another type (then nothing was written);
        and the keys of the call's own writes skipped for their type.
    """
    plan = Plan()
    streams: set[str] = set()
    for marker, effects in out.effects.items():
        outcome = effects.outcome()
        commands = _commands(plan, effects, streams, reply_maxlen, job_prefix, job_ttl_s)
        stats_hash = plan.own_key(stats_key, HASH)
        commands.append(["HINCRBY", stats_hash, outcome.stats_field, "1"])
        if effects.cancel_marker is not None and outcome is not Outcome.CANCELLED:
            counted = ["HINCRBY", stats_hash, Outcome.CANCELLED.stats_field, "1"]
            commands = [["UNLESS", plan.key(effects.cancel_marker), counted, *commands]]
        plan.groups.append([plan.key(marker), str(effects.marker_ttl_s), *commands])
    for marker in dropped:
        dropped_group: list[object] = [plan.key(marker), str(DROPPED_TTL_S)]
        stats_hash = plan.own_key(stats_key, HASH)
        dropped_group.append(["HINCRBY", stats_hash, Outcome.ERROR.stats_field, "1"])
        plan.groups.append(dropped_group)
    for reply_to in sorted(streams):
        plan.always.append(["EXPIRE", plan.key(reply_to), str(reply_ttl_s)])
    for dlq, fields in dead_letters:
        plan.always.append(["XADD", plan.own_key(dlq, STREAM), "*", *_pairs(plan, fields)])
    to_ack: dict[str, list[bytes]] = {stream: list(entry_ids)} if entry_ids else {}
    for acked, ids in (acks or {}).items():
        to_ack.setdefault(acked, []).extend(ids)
    for acked, ids in to_ack.items():
        for i in range(0, len(ids), 1000):  # Lua's unpack() takes a few thousand at most
            chunk = ids[i : i + 1000]
            xack: list[Token] = [
                "XACK",
                plan.own_key(acked, STREAM),
                GROUP,
                *map(plan.value, chunk),
            ]
            plan.always.append(xack)
    for i in range(0, len(unmark), 1000):
        plan.always.append(["DEL", *map(plan.key, unmark[i : i + 1000])])
    if gauges:
        plan.always.append(
            ["HSET", plan.own_key(stats_key, HASH), *_pairs(plan, dict(gauges.items()))]
        )
    for name, amount in stats.items():
        stats_hash = plan.own_key(stats_key, HASH)
        if name.endswith(":sum"):
            plan.always.append(["HINCRBYFLOAT", stats_hash, name, repr(float(amount))])
        else:
            plan.always.append(["HINCRBY", stats_hash, name, str(int(amount))])
    if not plan.groups and not plan.always:
        return Published()
    plan.token = plan.key(token_key)
    return await patiently(lambda: on_live_connection(client, lambda: _run(client, plan)))


class Publisher:
    """One worker's :func:`publish`: its client, stage, partition and settings bound.

    A call refused for some of its requests (a key of theirs holds another type: nothing
    was written) is made again at once without them, dead-lettered
    (:func:`workers.refused.set_aside`); a key of the call's own (stats, dead letters)
    holding another type is logged once, and the batches go on being answered.

    Args:
        client: Redis client.
        router: the worker's router (its keys, at the worker's partition, and its stage:
            its stats hash; it answers refused requests).
        consumer: the worker's consumer name (its calls' tokens are named after it).
        settings: the worker's settings (reply and job retention).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        router: Router,
        consumer: str,
        settings: WorkerSettings,
    ) -> None:
        self.client, self.router = client, router
        self.keys, self.stage = router.keys, router.stage
        self.consumer, self.settings = consumer, settings
        self._broken: set[str] = set()  # own keys of another type, logged once each

    async def __call__(
        self,
        out: Outbox,
        entries: Sequence[Entry],
        counts: Mapping[str, float],
        letters: Sequence[tuple[str, dict[FieldT, EncodableT]]] = (),
        gauges: Mapping[str, float] | None = None,
        dropped: Sequence[str] = (),
    ) -> Published:
        """Publish ``out``, ack ``entries`` (each on its lane's stream), add ``counts`` to
        the stage's stats and ``letters`` to its dead letters, in one call; a request
        refused is taken out of ``out`` (in place) and dead-lettered, and the call made
        again. What it returns names every request refused on the way."""
        letters, dropped, counts = list(letters), list(dropped), dict(counts)
        refused: dict[str, tuple[str, str]] = {}
        # Each refusal takes at least one request's effects out for good (an answer in
        # their place is refused at most once more, then dropped): this ends.
        for _ in range(2 * len(out.effects) + 2):
            published = await self._once(out, entries, counts, letters, gauges, dropped)
            for key in published.broken - self._broken:
                self._broken.add(key)
                logger.error(
                    "stage %s: Redis key %s holds a type the worker cannot write (something "
                    "else wrote it); what the batches write there is skipped until it is "
                    "deleted (requests are still answered)",
                    self.stage,
                    key,
                )
            if not published.refused:
                progressed()  # what conveyor up counts as work done (runtime/exits.py)
                return replace(published, refused=refused) if refused else published
            refused.update(published.refused)
            added, unanswered = set_aside(self.router, out, entries, published.refused, letters)
            letters += added
            dropped += unanswered
            if added:
                counts["dead_letters"] = counts.get("dead_letters", 0) + len(added)
        raise RuntimeError(f"stage {self.stage}: a batch's publish was refused every time")

    async def _once(
        self,
        out: Outbox,
        entries: Sequence[Entry],
        counts: Mapping[str, float],
        letters: Sequence[tuple[str, dict[FieldT, EncodableT]]],
        gauges: Mapping[str, float] | None,
        dropped: Sequence[str],
    ) -> Published:
        keys = self.keys
        return await publish(
            self.client,
            out,
            acks=by_stream(entries),
            stats_key=keys.stage_stats(self.stage),
            stats=counts,
            reply_maxlen=self.settings.reply_maxlen,
            reply_ttl_s=self.settings.reply_ttl_s,
            # A fresh token per call: what makes its retry safe.
            token_key=keys.publish_token(f"{self.consumer}-{secrets.token_hex(8)}"),
            job_prefix=keys.job_prefix,
            job_ttl_s=self.settings.job_ttl_s,
            dead_letters=letters,
            gauges=gauges,
            dropped=dropped,
            unmark=marks(keys, entries),
        )


async def patiently(call: Callable[[], Awaitable[Published]]) -> Published:
    """``call()``, retried with a growing back-off for up to :data:`RETRY_S` while Redis
    refuses it or cannot be reached; then its error is raised (the batch stays pending).

    A batch already run is worth keeping through a Redis that is busy (a long script),
    out of memory (until replies are read and memory frees) or restarting: without
    this, its results were dropped and the batch ran again when reclaimed, seconds later.
    """
    give_up = time.monotonic() + RETRY_S
    backoff = Backoff(first_s=0.05, most_s=2.0)
    while True:
        try:
            return await call()
        except REDIS_DOWN as exc:
            if time.monotonic() + backoff.next_s > give_up:
                raise
            logger.warning("publish refused (%s); retrying in %.2fs", exc, backoff.next_s)
            await backoff.wait()


async def _run(client: aioredis.Redis, plan: Plan) -> Published:
    args = plan.script_args()
    try:
        answer = await client.evalsha(PUBLISH_SHA, len(plan.keys), *plan.keys, *args)
    except NoScriptError:  # first use on this server (or after a restart): EVAL caches it
        answer = await client.eval(PUBLISH_SCRIPT, len(plan.keys), *plan.keys, *args)
    skipped, cancelled, *rest = answer
    refused = list(map(text, rest[0])) if rest else []
    broken = frozenset(map(text, rest[1])) if len(rest) > 1 else frozenset()
    return Published(
        int(skipped),
        frozenset(map(text, cancelled)),
        {refused[i]: (refused[i + 1], refused[i + 2]) for i in range(0, len(refused), 3)},
        broken,
    )


def _pairs(
    plan: Plan, fields: Mapping[str, EncodableT] | Mapping[FieldT, EncodableT]
) -> list[Token]:
    tokens: list[Token] = []
    for name, value in fields.items():
        tokens += [plan.value(name), plan.value(value)]
    return tokens


def _commands(
    plan: Plan,
    effects: Effects,
    streams: set[str],
    reply_maxlen: int,
    job_prefix: str,
    job_ttl_s: int,
) -> list[list[object]]:
    commands: list[list[object]] = []
    for reply_to, reply in effects.replies:
        if job_prefix and reply_to.startswith(job_prefix):
            job = plan.key(reply_to, HASH)
            commands.append(["HSET", job, *_pairs(plan, job_finished(reply))])
            commands.append(["EXPIRE", job, str(job_ttl_s)])
        else:
            capped = ["MAXLEN", "~", str(reply_maxlen)]
            commands.append(
                ["XADD", plan.key(reply_to, STREAM), *capped, "*", *_pairs(plan, encode(reply))]
            )
            streams.add(reply_to)
    for target, request in effects.forwards:
        commands.append(["XADD", plan.key(target, STREAM), "*", *_pairs(plan, encode(request))])
    for join_key, ttl in effects.failed_joins:
        commands.append(["FAILJOIN", plan.key(join_key, HASH), str(ttl)])
    if effects.answer_marker is not None:  # the branches of a join answer once between them
        once = ["ONCE", plan.key(effects.answer_marker), str(effects.marker_ttl_s)]
        commands = [[*once, *commands]]
    for j in effects.joins:
        where = [plan.key(j.key, HASH), plan.key(j.stream, STREAM), plan.value(j.branch)]
        arrival = [plan.value(j.output), str(j.expected), plan.value(j.envelope), str(j.ttl_s)]
        commands.append(["JOIN", *where, *arrival, plan.value(FIELD), plan.value(BRANCH)])
    return commands
