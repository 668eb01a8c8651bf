"""Every Redis key and stream name conveyor uses, built in one place.

All names live under one namespace, written as a Redis Cluster hash tag
(``{conveyor}:...``), so every key of a deployment maps to one cluster slot and the
script that publishes results and acks a batch never crosses slots. A deployment
that outgrows one shard runs several namespaces.
"""

from __future__ import annotations

import re

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

GROUP = "workers"
"""The consumer group every stage stream is read by."""


class Keys:
    """Builds the key names of one namespace.

    Args:
        namespace: letters, digits, ``_ . -``; becomes the hash tag ``{namespace}``.
    """

    def __init__(self, namespace: str) -> None:
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        self.namespace = namespace
        self.prefix = "{" + namespace + "}"

    def stage_stream(self, stage: str, lane: str = "interactive") -> str:
        """The stream a stage's workers read the requests of ``lane`` from (the
        interactive lane's is the stage's own name; another lane's adds ``:<lane>``)."""
        base = f"{self.prefix}:stage:{stage}"
        return base if lane == "interactive" else f"{base}:{lane}"

    def stage_stats(self, stage: str) -> str:
        """The hash of a stage's counters and histogram buckets."""
        return f"{self.prefix}:stats:{stage}"

    def reply_stream(self, gateway_id: str) -> str:
        """The stream one gateway process reads its replies from."""
        return f"{self.prefix}:reply:{gateway_id}"

    def join(self, request_id: str, step: str) -> str:
        """The hash where a join step's branch outputs meet for one request."""
        return f"{self.prefix}:join:{request_id}:{step}"

    def job(self, job_id: str) -> str:
        """The hash holding an async job's status and, when done, its result."""
        return f"{self.job_prefix}{job_id}"

    @property
    def job_prefix(self) -> str:
        """What every job key starts with (a reply addressed there is stored, not streamed)."""
        return f"{self.prefix}:job:"

    def done(self, request_id: str, step: str) -> str:
        """Marks that a request's step has published its effects (set once, expires)."""
        return f"{self.prefix}:done:{request_id}:{step}"

    def cancelled(self, request_id: str) -> str:
        """Marks that a request is cancelled: no step starts it any more (expires)."""
        return f"{self.prefix}:cancelled:{request_id}"

    def dropped(self, stage: str, entry_id: str) -> str:
        """Marks that an undecodable entry of ``stage`` has been counted (set once, expires)."""
        return f"{self.prefix}:dropped:{stage}:{entry_id}"

    def publish_token(self, token: str) -> str:
        """Marks that one publish call has run, so repeating it does nothing (short TTL)."""
        return f"{self.prefix}:published:{token}"

    def dead_letters(self, stage: str) -> str:
        """The stream of a stage's dead letters: entries delivered too often."""
        return f"{self.prefix}:dlq:{stage}"

    def stages_set(self) -> str:
        """The set of stage names that have ever had a worker (for status views)."""
        return f"{self.prefix}:stages"

    def is_reply_target(self, key: str) -> bool:
        """Whether ``key`` is a reply stream or a job record of this namespace (what a
        worker may answer to when all it has is an entry's word for it)."""
        return key.startswith((f"{self.prefix}:reply:", self.job_prefix))
