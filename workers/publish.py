"""One round trip per batch: replies, hand-overs, join arrivals, the XACK and the stats.

A batch's effects are one call of ``publish.lua`` (EVALSHA), which Redis runs atomically: either
all of them happen with the ack or none do, and a worker that dies before the call leaves
the whole batch pending, to be delivered again. A script that fails midway would break
that (Redis keeps what it wrote before the error), so the script first checks the type of
every key it writes (a stream for XADD, a hash for HSET; absent is fine) and writes
nothing if a request's effects would meet a key of another type (a key something else
SET): it names those requests instead, and :class:`Publisher` dead-letters them and
publishes the rest of the batch in a second call (recovery's ``set_aside``). A key the batch
itself writes whatever its requests (the stats hash, the dead-letter stream, the
acked stage streams) is skipped if it holds another type, and named: the worker logs it
and goes on answering. The script is generic: :mod:`workers.plan` compiles the
outbox into a small plan of Redis commands and the script runs it.

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
from dataclasses import replace
from hashlib import sha1
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from pipelines.keys import Keys
from runtime.exits import progressed
from runtime.packing import command
from runtime.redisio import REDIS_DOWN, on_live_connection, text
from runtime.waiting import Backoff
from workers.claims import marks
from workers.plan import TOKEN_TTL_S, Call, Plan, compile_plan
from workers.settings import WorkerSettings
from workers.values import Entry, Letter, Outbox, Published, by_stream

logger = logging.getLogger(__name__)

RETRY_S = TOKEN_TTL_S / 2
"""How long a publish is retried while Redis refuses it or cannot be reached (BUSY, OOM,
an outage: :data:`~runtime.redisio.REDIS_DOWN`), backing off, before the batch is left
pending to be reclaimed. Well inside the token's life, so the repeat of a call that did
run is a no-op."""

PUBLISH_SCRIPT = resources.files("workers").joinpath("publish.lua").read_text()
PUBLISH_SHA = sha1(PUBLISH_SCRIPT.encode()).hexdigest()

SetAside = Callable[
    [Outbox, Sequence[Entry], Mapping[str, tuple[str, str]], Sequence[Letter]],
    tuple[list[Letter], list[str]],
]
"""Takes refused requests out of an outbox as dead letters (recovery's decision): the
letters to add, and the markers of those left unanswered."""


async def publish(client: aioredis.Redis, call: Call) -> Published:
    """Publish a batch's outbox and ack its entries, atomically, in one round trip.

    Each request's effects, and the count of its outcome (``items:<outcome>`` in the
    stats hash), are guarded by its "done" marker: a request whose marker exists (its
    step already published, by this or another worker) is skipped, so the counters equal
    the requests answered. A request whose ``Effects.cancel_marker`` exists publishes
    nothing and counts ``items:cancelled`` (unless it already ends ``cancelled``: that
    ending is what it publishes). If the connection dies under the call, it is retried
    once on a fresh connection, and while Redis refuses it, for a while; the call's
    token makes a repeat a no-op if the first did run.

    Returns:
        How many requests were skipped as already published, and which were cancelled;
        or which requests' effects meet a key of another type (then nothing was written);
        and the keys of the call's own writes skipped for their type.
    """
    plan = compile_plan(call)
    if plan is None:
        return Published()

    async def attempt() -> Published:
        try:
            return await _run(client, plan)
        finally:
            plan.retry = True  # whatever ended it, it may have run

    return await patiently(lambda: on_live_connection(client, attempt))


class Publisher:
    """One worker's :func:`publish`: its client, stage, partition and settings bound.

    A call refused for some of its requests (a key of theirs holds another type: nothing
    was written) is made again at once without them, dead-lettered
    (``set_aside``); a key of the call's own (stats, dead letters)
    holding another type is logged once, and the batches go on being answered.

    Args:
        client: Redis client.
        keys: the worker's keys, at its partition.
        stage: the stage served (its stats hash).
        consumer: the worker's consumer name (its calls' tokens are named after it).
        settings: the worker's settings (reply and job retention).
        set_aside: dead-letters the requests a call refused (recovery's).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        stage: str,
        consumer: str,
        settings: WorkerSettings,
        set_aside: SetAside,
    ) -> None:
        self.client, self.keys, self.stage = client, keys, stage
        self.set_aside = set_aside
        self.consumer, self.settings = consumer, settings
        self._broken: set[str] = set()  # own keys of another type, logged once each
        self._expired: dict[str, float] = {}  # reply streams' expiry last pushed back

    async def __call__(
        self,
        out: Outbox,
        entries: Sequence[Entry],
        counts: Mapping[str, float],
        letters: Sequence[Letter] = (),
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
            added, unanswered = self.set_aside(out, entries, published.refused, letters)
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
        letters: Sequence[Letter],
        gauges: Mapping[str, float] | None,
        dropped: Sequence[str],
    ) -> Published:
        keys = self.keys
        now = time.monotonic()
        # A reply stream's expiry is pushed back at most every quarter of its life.
        every = self.settings.reply_ttl_s / 4
        self._expired = {s: at for s, at in self._expired.items() if now - at < every}
        call = Call(
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
            fresh=frozenset(self._expired),
        )
        published = await publish(self.client, call)
        if not published.refused:  # a refused call wrote nothing
            for effects in out.effects.values():
                for reply_to, _ in effects.replies:
                    if not reply_to.startswith(keys.job_prefix):
                        self._expired.setdefault(reply_to, now)
        return published


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
        answer = await command(client, "EVALSHA", PUBLISH_SHA, len(plan.keys), *plan.keys, *args)
    except NoScriptError:  # first use on this server (or after a restart): EVAL caches it
        answer = await command(client, "EVAL", PUBLISH_SCRIPT, len(plan.keys), *plan.keys, *args)
    skipped, cancelled, *rest = answer
    refused = list(map(text, rest[0])) if rest else []
    broken = frozenset(map(text, rest[1])) if len(rest) > 1 else frozenset()
    return Published(
        int(skipped),
        frozenset(map(text, cancelled)),
        {refused[i]: (refused[i + 1], refused[i + 2]) for i in range(0, len(refused), 3)},
        broken,
    )
