"""A batch's publish, compiled: the outbox, the acks, the stats and the dead letters of
one call turned into a small plan of Redis commands that ``publish.lua`` runs atomically.
Pure: nothing here talks to Redis, so what a batch does is checked without a server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import orjson
from redis.typing import EncodableT, FieldT

from pipelines.envelope import BRANCH, FIELD, encode
from pipelines.keys import GROUP
from pipelines.outcomes import Outcome
from pipelines.records import job_finished
from workers.values import Effects, Letter, Outbox

TOKEN_TTL_S = 30
"""A publish call's token outlives any retry of it by far."""

DROPPED_TTL_S = 3600
"""How long the marker of a counted undecodable entry is kept: a second worker can only
hold the same entry while it is pending, which a stall of this length would outlast."""

Token = str | int
"""A plan token: a literal string, a value's number (>= 1) or a key's number (<= -1)."""

STREAM, HASH = "stream", "hash"
"""The types (as Redis's TYPE names them) a plan's keys must have, where absent."""


class Plan:
    """The commands of one batch, with every key and value passed out of band.

    Keys go in KEYS (so a cluster proxy can see them, all in one hash tag's slot) and
    values in ARGV, so results of any size or encoding never pass through JSON.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.types: list[str] = []  # what each key must hold where it exists ("": any)
        self.own: set[int] = set()  # the numbers of the keys the call itself writes
        self.checked: set[int] = set()  # those a request writes: their type is checked
        self.values: list[EncodableT] = []
        self.groups: list[list[object]] = []
        self.always: list[list[Token]] = []
        self.token: Token = ""
        self.retry = False  # set on every try after the first (the token is looked for)
        self._key_numbers: dict[str, int] = {}

    def key(self, name: str, kind: str = "") -> int:
        """The token of key ``name`` (each key is passed once), which the commands that
        use it need to be of type ``kind`` where it exists ("": any type does): its type
        is checked before anything is written."""
        token = self._number(name, kind)
        if kind:
            self.checked.add(-token)
        return token

    def _number(self, name: str, kind: str) -> int:
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
        acks): of another type, its commands are skipped, no request refused (written
        with pcall, its type is not checked first)."""
        token = self._number(name, kind)
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
            "r": self.retry,
            "tt": str(TOKEN_TTL_S),
            "g": self.groups,
            "a": self.always,
            "k": [t if i + 1 in self.checked else "" for i, t in enumerate(self.types)],
            "s": sorted(self.own),
        }
        return [orjson.dumps(plan), *self.values]


@dataclass(frozen=True)
class Call:
    """What one publish call writes.

    Attributes:
        out: what the batch produced.
        acks: entry ids to ack, by the stream (lane) each came from.
        stats_key: the stage's stats hash.
        stats: batch-level increments for it (``*:sum`` fields are floats), added once
            per call, unguarded (see :func:`runtime.stats.batch_fields`).
        token_key: a key unique to this call (``Keys.publish_token``), set by it.
        reply_maxlen: approximate cap on each reply stream.
        reply_ttl_s: reply streams expire this long after their last write.
        job_prefix: replies addressed to keys with this prefix are async jobs' results:
            stored in the job's hash (kept ``job_ttl_s``) instead of streamed.
        job_ttl_s: how long a finished job's record is kept.
        dead_letters: (dead-letter stream, fields) to add.
        gauges: values to set (not add) in the stats hash, e.g. the learned cost model.
        dropped: markers (``Keys.dropped``) of entries that could not be decoded and are
            acked unanswered: each counts one ``items:error``, once.
        unmark: the batch's on-model marks (:mod:`workers.claims`), deleted with the ack:
            entry ids by the hash of marks they are in.
        fresh: reply streams whose expiry a recent call already pushed back: not again.
        again: the call is made again, its first answer lost (its token is looked for
            first; :func:`workers.publish.publish` sets it on its own retries).
    """

    out: Outbox
    acks: Mapping[str, Sequence[bytes]]
    stats_key: str
    stats: Mapping[str, float]
    token_key: str
    reply_maxlen: int
    reply_ttl_s: int
    job_prefix: str = ""
    job_ttl_s: int = 86_400
    dead_letters: Sequence[Letter] = ()
    gauges: Mapping[str, float] | None = None
    dropped: Sequence[str] = ()
    unmark: Mapping[str, Sequence[bytes]] = field(default_factory=dict)
    fresh: frozenset[str] = frozenset()
    again: bool = False


def compile_plan(call: Call) -> Plan | None:
    """The plan of ``call``: each request's effects and outcome count in a group guarded
    by its "done" marker (and its cancellation marker), then what runs once per call
    (expiries, dead letters, acks, marks deleted, gauges, stats); None when it does
    nothing."""
    plan = Plan()
    out = call.out
    streams: set[str] = set()
    for marker, effects in out.effects.items():
        outcome = effects.outcome()
        commands = _commands(plan, effects, streams, call)
        stats_hash = plan.own_key(call.stats_key, HASH)
        commands.append(["HINCRBY", stats_hash, outcome.stats_field, "1"])
        if effects.cancel_marker is not None and outcome is not Outcome.CANCELLED:
            counted = ["HINCRBY", stats_hash, Outcome.CANCELLED.stats_field, "1"]
            commands = [["UNLESS", plan.key(effects.cancel_marker), counted, *commands]]
        plan.groups.append([plan.key(marker), str(effects.marker_ttl_s), *commands])
    for marker in call.dropped:
        dropped_group: list[object] = [plan.key(marker), str(DROPPED_TTL_S)]
        stats_hash = plan.own_key(call.stats_key, HASH)
        dropped_group.append(["HINCRBY", stats_hash, Outcome.ERROR.stats_field, "1"])
        plan.groups.append(dropped_group)
    for reply_to in sorted(streams - call.fresh):
        plan.always.append(["EXPIRE", plan.key(reply_to), str(call.reply_ttl_s)])
    for dlq, fields in call.dead_letters:
        plan.always.append(["XADD", plan.own_key(dlq, STREAM), "*", *_pairs(plan, fields)])
    for acked, ids in call.acks.items():
        for i in range(0, len(ids), 1000):  # Lua's unpack() takes a few thousand at most
            chunk = ids[i : i + 1000]
            xack: list[Token] = [
                "XACK",
                plan.own_key(acked, STREAM),
                GROUP,
                *map(plan.value, chunk),
            ]
            plan.always.append(xack)
    for hashed, ids in call.unmark.items():
        for i in range(0, len(ids), 1000):
            chunk = ids[i : i + 1000]
            plan.always.append(["HDEL", plan.own_key(hashed, HASH), *map(plan.value, chunk)])
    if call.gauges:
        plan.always.append(
            ["HSET", plan.own_key(call.stats_key, HASH), *_pairs(plan, dict(call.gauges.items()))]
        )
    for name, amount in call.stats.items():
        stats_hash = plan.own_key(call.stats_key, HASH)
        if name.endswith(":sum"):
            plan.always.append(["HINCRBYFLOAT", stats_hash, name, repr(float(amount))])
        else:
            plan.always.append(["HINCRBY", stats_hash, name, str(int(amount))])
    if not plan.groups and not plan.always:
        return None
    if call.stats or call.dead_letters:
        # Counts and dead letters would be added twice by a repeat: the call's token
        # makes its retry a no-op. Everything else in it is guarded by its requests'
        # done markers, or is the same done twice (acks, deleted marks, expiries).
        plan.token = plan.key(call.token_key)
    plan.retry = call.again
    return plan


def _pairs(
    plan: Plan, fields: Mapping[str, EncodableT] | Mapping[FieldT, EncodableT]
) -> list[Token]:
    tokens: list[Token] = []
    for name, value in fields.items():
        tokens += [plan.value(name), plan.value(value)]
    return tokens


def _commands(plan: Plan, effects: Effects, streams: set[str], call: Call) -> list[list[object]]:
    job_prefix = call.job_prefix
    commands: list[list[object]] = []
    for reply_to, reply in effects.replies:
        if job_prefix and reply_to.startswith(job_prefix):
            job = plan.key(reply_to, HASH)
            commands.append(["HSET", job, *_pairs(plan, job_finished(reply))])
            commands.append(["EXPIRE", job, str(call.job_ttl_s)])
        else:
            capped = ["MAXLEN", "~", str(call.reply_maxlen)]
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
