"""A batch's publish, compiled: the outbox, the acks, the stats and the dead letters of
one call turned into a small plan of Redis commands that ``publish.lua`` runs atomically.
Pure: nothing here talks to Redis, so what a batch does is checked without a server."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import orjson
from redis.typing import EncodableT, FieldT

from pipelines.envelope import BRANCH, FIELD, REPLIES_PER_ENTRY, Reply, encode
from pipelines.keys import GROUP
from pipelines.outcomes import Outcome
from pipelines.records import job_finished
from workers.values import Effects, Letter, Outbox

TOKEN_TTL_S = 30
"""A publish call's token outlives any retry of it by far."""

DROPPED_TTL_S = 3600
"""How long the marker of a counted undecodable entry is kept: a second worker can only
hold the same entry while it is pending, which a stall of this length would outlast."""

Token = str | int | list[int]
"""A plan token: a literal string, a value's number (>= 1), a key's number (<= -1) or, in
a command, a span of values ``[first, last]`` (each number from first to last)."""

RUN_MIN = 3
"""Groups alike in a row that are passed as one run (see :func:`runs`)."""

LITERAL = re.compile(r"[!-~]{1,64}")
"""A field name passed as itself in the plan (short printable ASCII), not as a value."""

STREAM, HASH = "stream", "hash"
"""The types (as Redis's TYPE names them) a plan's keys must have, where absent."""


class Plan:
    """The commands of one batch, with every key and value passed out of band.

    Keys go in KEYS (so a cluster proxy can see them, all in one hash tag's slot) and
    values in ARGV, so results of any size or encoding never pass through JSON. The
    keys the call reads (every group's "done" and cancellation markers) come first, so
    the script reads them in one MGET of ``KEYS[1..reads]``. A group is flat: its
    marker, ttl, cancellation marker (0: none), outcome's stats field, its reply (stream
    and value: the one command most groups have, written without a command's tokens; 0,
    0 for none), then its commands, each as its length and its tokens (:func:`op`);
    :attr:`always` holds the call's own commands the same way. Decoding and walking the
    plan was most of what the script cost beyond its commands while it was nested.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.types: list[str] = []  # what each key must hold where it exists ("": any)
        self.own: set[int] = set()  # the numbers of the keys the call itself writes
        self.checked: set[int] = set()  # those a request writes: their type is checked
        self.values: list[EncodableT] = []
        self.groups: list[list[Token]] = []
        self.always: list[Token] = []
        self.batched: list[int] = []  # the streams whose slot replies share an entry
        self.reads = 0  # KEYS[1..reads]: the markers read before anything is written
        self.stats = 0  # the stats hash's key number (groups count their outcome there)
        self.reply_maxlen = 0  # the cap of the reply streams (a group's reply is capped)
        self.token: Token = ""
        self.retry = False  # set on every try after the first (the token is looked for)
        self._key_numbers: dict[str, int] = {}
        self._value_numbers: dict[tuple[type, EncodableT], int] = {}

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
        """The token of ``value`` (a string passed twice, an entry id acked and unmarked,
        is passed once)."""
        if not isinstance(value, (str, bytes)):
            self.values.append(value)
            return len(self.values)
        number = self._value_numbers.get((type(value), value))
        if number is None:
            self.values.append(value)
            number = self._value_numbers[type(value), value] = len(self.values)
        return number

    def script_args(self) -> list[EncodableT]:
        """ARGV: the plan, then the values."""
        checked = [(n, self.types[n - 1]) for n in sorted(self.checked)]
        plan = {
            "t": self.token,
            "r": self.retry,
            "tt": str(TOKEN_TTL_S),
            "m": self.reads,
            "h": self.stats,
            "c": Outcome.CANCELLED.stats_field,
            "f": FIELD.decode(),
            "x": str(self.reply_maxlen),
            "g": runs(self.groups),
            "a": self.always,
            "k": [token for n, kind in checked if kind for token in (n, kind)],
            "s": sorted(self.own),
            "b": self.batched,
            "n": REPLIES_PER_ENTRY,
        }
        return [orjson.dumps(plan), *self.values]


def op(*tokens: Token) -> list[Token]:
    """One command of a plan: its length, then its tokens (name first)."""
    return [len(tokens), *tokens]


def spans(numbers: Sequence[int]) -> list[Token]:
    """Value numbers as tokens, each stretch of RUN_MIN or more consecutive ones as one
    span ``[first, last]`` (a batch's entry ids are numbered in a row: its ack and its
    marks' deletion pass them as one token each)."""
    tokens: list[Token] = []
    i = 0
    while i < len(numbers):
        j = i + 1
        while j < len(numbers) and numbers[j] == numbers[j - 1] + 1:
            j += 1
        if j - i >= RUN_MIN:
            tokens.append([numbers[i], numbers[j - 1]])
        else:
            tokens += numbers[i:j]
        i = j
    return tokens


def runs(groups: Sequence[list[Token]]) -> list[list[Token]]:
    """The groups as ``publish.lua`` reads them: RUN_MIN or more in a row that have no
    command beyond their reply, the same ttl, outcome field and stream, and marker,
    cancellation marker and reply numbers each a constant step from the last, as one run
    ``["R", n, marker, dm, ttl, cancel, dc, field, stream, reply, dr]``; the others as
    they are. A batch's groups are most often one run: its plan is a few dozen tokens,
    not six per request (decoding the plan's JSON was a third of a batch's script)."""
    out: list[list[Token]] = []
    i = 0
    while i < len(groups):
        steps = _steps(groups[i], groups[i + 1]) if i + 1 < len(groups) else None
        j = i + 2  # groups[i:j] step alike
        while steps is not None and j < len(groups) and _steps(groups[j - 1], groups[j]) == steps:
            j += 1
        if steps is None or j - i < RUN_MIN:
            out.append(groups[i])
            i += 1
            continue
        marker, ttl, cancel, counted, stream, reply = groups[i]
        dm, dc, dr = steps
        out.append(["R", j - i, marker, dm, ttl, cancel, dc, counted, stream, reply, dr])
        i = j
    return out


def _steps(a: list[Token], b: list[Token]) -> tuple[int, int, int] | None:
    """How b's marker, cancellation marker and reply numbers step from a's, where both
    groups have nothing beyond their reply and the same ttl, field and stream; else None."""
    if len(a) != 6 or len(b) != 6 or a[1] != b[1] or a[3] != b[3] or a[4] != b[4]:
        return None
    steps: list[int] = []
    for x, y in ((a[0], b[0]), (a[2], b[2]), (a[5], b[5])):
        if not isinstance(x, int) or not isinstance(y, int):
            return None
        steps.append(y - x)
    return steps[0], steps[1], steps[2]


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
    outcomes = {marker: effects.outcome() for marker, effects in out.effects.items()}
    cancels: dict[str, int] = {}
    for marker, effects in out.effects.items():  # what is read: first, in one MGET
        plan.key(marker)
        if effects.cancel_marker is not None and outcomes[marker] is not Outcome.CANCELLED:
            cancels[marker] = plan.key(effects.cancel_marker)
    for marker in call.dropped:
        plan.key(marker)
    plan.reads, plan.reply_maxlen = len(plan.keys), call.reply_maxlen
    if out.effects or call.dropped or call.stats or call.gauges:
        plan.stats = -plan.own_key(call.stats_key, HASH)
    streams: set[str] = set()
    shared: dict[int, bool] = {}  # a slot's stream: whether every reply to it may share
    for marker, effects in out.effects.items():
        head: list[Token] = [plan.key(marker), str(effects.marker_ttl_s)]
        head += [cancels.get(marker, 0), outcomes[marker].stats_field]
        commands = _commands(plan, effects, streams, call)
        slot = commands[0]
        if isinstance(slot, int) and slot:
            shared[slot] = shared.get(slot, True) and effects.batched
        plan.groups.append(head + commands)
    plan.batched = sorted(stream for stream, ok in shared.items() if ok)
    for marker in call.dropped:
        error = Outcome.ERROR.stats_field
        plan.groups.append([plan.key(marker), str(DROPPED_TTL_S), 0, error, 0, 0])
    for reply_to in sorted(streams - call.fresh):
        plan.always += op("EXPIRE", plan.key(reply_to), str(call.reply_ttl_s))
    for dlq, fields in call.dead_letters:
        plan.always += op("XADD", plan.own_key(dlq, STREAM), "*", *_pairs(plan, fields))
    for acked, ids in call.acks.items():
        for numbers in _id_spans(plan, ids):
            plan.always += op("XACK", plan.own_key(acked, STREAM), GROUP, *numbers)
    for hashed, ids in call.unmark.items():
        for numbers in _id_spans(plan, ids):
            plan.always += op("HDEL", plan.own_key(hashed, HASH), *numbers)
    if call.gauges:
        pairs = _pairs(plan, dict(call.gauges.items()))
        plan.always += op("HSET", -plan.stats, *pairs)
    for name, amount in call.stats.items():
        if name.endswith(":sum"):
            plan.always += op("HINCRBYFLOAT", -plan.stats, name, repr(float(amount)))
        else:
            plan.always += op("HINCRBY", -plan.stats, name, str(int(amount)))
    if not plan.groups and not plan.always:
        return None
    if call.stats or call.dead_letters:
        # Counts and dead letters would be added twice by a repeat: the call's token
        # makes its retry a no-op. Everything else in it is guarded by its requests'
        # done markers, or is the same done twice (acks, deleted marks, expiries).
        plan.token = plan.key(call.token_key)
    plan.retry = call.again
    return plan


def _id_spans(plan: Plan, ids: Sequence[bytes]) -> Iterator[list[Token]]:
    """Entry ids as value tokens (:func:`spans`), a thousand ids a command at most: Lua's
    unpack() takes a few thousand values."""
    for first in range(0, len(ids), 1000):
        yield spans([plan.value(eid) for eid in ids[first : first + 1000]])


def _pairs(
    plan: Plan, fields: Mapping[str, EncodableT] | Mapping[FieldT, EncodableT]
) -> list[Token]:
    tokens: list[Token] = []
    for name, value in fields.items():
        literal = name.decode("ascii", "replace") if isinstance(name, bytes) else name
        if isinstance(literal, str) and LITERAL.fullmatch(literal):
            tokens += [literal, plan.value(value)]  # the name as itself: one argument less
        else:
            tokens += [plan.value(name), plan.value(value)]
    return tokens


def _commands(plan: Plan, effects: Effects, streams: set[str], call: Call) -> list[Token]:
    """A group's reply (its stream and value, or 0, 0), then its commands."""
    job_prefix = call.job_prefix
    first: Reply | None = None
    replies = effects.replies
    if replies and effects.answer_marker is None:
        reply_to, first = replies[0]
        if job_prefix and reply_to.startswith(job_prefix):
            first = None
    commands: list[Token] = [0, 0]
    if first is not None:  # the common case, written by the script without a command
        fields = encode(first)
        if set(fields) == {FIELD}:
            commands = [plan.key(replies[0][0], STREAM), plan.value(fields[FIELD])]
            streams.add(replies[0][0])
            replies = replies[1:]
    for reply_to, reply in replies:
        if job_prefix and reply_to.startswith(job_prefix):
            job = plan.key(reply_to, HASH)
            commands += op("HSET", job, *_pairs(plan, job_finished(reply)))
            commands += op("EXPIRE", job, str(call.job_ttl_s))
        else:
            stream, capped = plan.key(reply_to, STREAM), ("MAXLEN", "~", str(call.reply_maxlen))
            commands += op("XADD", stream, *capped, "*", *_pairs(plan, encode(reply)))
            streams.add(reply_to)
    for target, request in effects.forwards:
        commands += op("XADD", plan.key(target, STREAM), "*", *_pairs(plan, encode(request)))
    for join_key, ttl in effects.failed_joins:
        commands += op("FAILJOIN", plan.key(join_key, HASH), str(ttl))
    if effects.answer_marker is not None:  # the branches of a join answer once between them
        kept = str(effects.marker_ttl_s)
        once = op("ONCE", plan.key(effects.answer_marker), kept, len(commands) - 2)
        commands = commands[:2] + once + commands[2:]
    for j in effects.joins:
        where: list[Token] = [
            plan.key(j.key, HASH),
            plan.key(j.stream, STREAM),
            plan.value(j.branch),
        ]
        arrival: list[Token] = [
            plan.value(j.output),
            str(j.expected),
            plan.value(j.envelope),
            str(j.ttl_s),
        ]
        commands += op("JOIN", *where, *arrival, plan.value(FIELD), plan.value(BRANCH))
    return commands
