"""Requests a publish refused: dead-lettered, so their batch-mates publish without them.

A publish call writes nothing when a request's effects would meet a key that holds
another type (:data:`workers.publish.PUBLISH_SCRIPT`): a string SET where its reply stream
or its job record would be. Such a request cannot be published as it is, and publishing it
again would be refused again; so it ends as a dead letter (acked with its batch, kept in
the stage's dead-letter stream with the reason, counted an error), its caller told where
its reply address is a safe one (of this namespace, and not a key that was refused), and
the rest of the batch is published at once, in a second call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pipelines.envelope import sender
from pipelines.records import DeadLetter
from runtime.redisio import text
from workers.batch import Entry
from workers.recovery import Letter, letter
from workers.route import Outbox, Router

logger = logging.getLogger(__name__)


def set_aside(
    router: Router,
    out: Outbox,
    entries: Sequence[Entry],
    refused: Mapping[str, tuple[str, str]],
    letters: Sequence[Letter],
) -> tuple[list[Letter], list[str]]:
    """Take the refused requests' effects out of ``out`` (in place), answering each
    refused request's caller instead where that is safe.

    Args:
        router: answers the callers (and names the stage and its keys).
        out: the batch's outbox.
        entries: the batch's entries (each refused request's entries are found by its
            "done" marker).
        refused: (key, its type) by "done" marker, as :class:`~workers.publish.Published`
            says.
        letters: the dead letters the batch already adds (an entry among them is not
            added twice).

    Returns:
        The dead letters to add, and the markers (``Keys.dropped``) of the refused
        requests left unanswered, each to count one error.
    """
    keys, stage = router.keys, router.stage
    refused_keys = {key for key, _ in refused.values()}
    lettered = {text(fields.get(DeadLetter.ENTRY, b"")) for _, fields in letters}
    by_marker: dict[str, list[Entry]] = {}
    for entry in entries:
        who = sender(entry.fields)
        if who is not None:
            by_marker.setdefault(keys.done(who.id, who.step), []).append(entry)
    added: list[Letter] = []
    dropped: list[str] = []
    for marker, (key, kind) in refused.items():
        del out.effects[marker]
        message = (
            f"its result could not be published: Redis key {key!r} holds a {kind}, not "
            f"what stage {stage!r} writes there; dead-lettered: `conveyor dlq list {stage}`"
        )
        culprits = by_marker.get(marker, [])
        logger.error(
            "stage %s: %d entr%s dead-lettered (%s): %s",
            stage,
            len(culprits),
            "y" if len(culprits) == 1 else "ies",
            marker,
            message,
        )
        if not culprits:
            continue
        who = sender(culprits[0].fields)
        if (
            who is None
            or who.reply_to in refused_keys
            or not router.fail_unreadable(out, who, message)
        ):
            dropped.append(keys.dropped(stage, text(culprits[0].id)))
        for entry in culprits:
            if text(entry.id) not in lettered:
                added.append((keys.dead_letters(stage), letter(entry.id, entry.fields, 1, message)))
    return added, dropped
