"""Settings shared by every conveyor process; each process extends them in one class."""

from __future__ import annotations

import json

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.keys import MAX_PARTITIONS, Keys

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""URL schemes naming a node of a Redis Cluster (the cluster client is used)."""

URL_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
"""What ``CONVEYOR_REDIS_URL`` may start with."""

MAX_DEADLINE_S = 30 * 86_400
"""The longest time budget a request may have (30 days)."""


class CommonSettings(BaseSettings):
    """What every process needs to reach Redis. Read from ``CONVEYOR_*`` variables.

    Attributes:
        redis_url: ``redis://`` or ``rediss://`` URL; user, password and db are honoured.
            ``redis+cluster://`` (or ``rediss+cluster://``) names one node of a Redis
            Cluster: the cluster client finds the others and routes each key to its
            shard.
        namespace: key namespace, also the Redis Cluster hash tag.
        partitions: how many partitions (hash slots) the namespace's streams are split
            into (:mod:`pipelines.keys`): spread over a cluster's shards, they carry
            more than one shard can. Every process of a deployment must set the same.
        redis_timeout_s: connect and command timeout; Redis being down fails this fast.
        redis_max_connections: connections per process; more concurrent commands wait.
        app: ``module:attr`` naming a Pipeline, a list of them, or a function returning
            either (``conveyor up --app``); unset: the built-in pipelines.
        pipelines: comma-separated pipeline names to serve (unset: all of the app's, or
            for the built-ins the default set).
        job_ttl_s: an async job's record (and result) is kept this long.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "conveyor"
    partitions: int = Field(default=1, ge=1, le=MAX_PARTITIONS)
    redis_timeout_s: float = Field(default=2.0, gt=0, le=300, allow_inf_nan=False)
    redis_max_connections: int = Field(default=64, ge=2, le=10_000)
    app: str | None = None
    pipelines: str | None = None
    job_ttl_s: int = Field(default=86_400, ge=1)

    @field_validator("namespace")
    @classmethod
    def _namespace_ok(cls, value: str) -> str:
        Keys(value)  # raises with a message naming the value
        return value

    @field_validator("redis_url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        if not value.startswith(URL_SCHEMES):
            raise ValueError("must start with " + ", ".join(URL_SCHEMES))
        return value

    @property
    def cluster(self) -> bool:
        """Whether :attr:`redis_url` names a Redis Cluster."""
        return self.redis_url.startswith(CLUSTER_SCHEMES)

    @property
    def keys(self) -> Keys:
        """Key names of :attr:`namespace`: partition 0's (:meth:`Keys.at`, :meth:`Keys.of`
        and :meth:`Keys.each` give the others)."""
        return Keys(self.namespace, self.partitions)


def comma_list(value: object) -> object:
    """A list setting's value from the environment: ``a,b`` (blanks dropped) or a JSON list.

    Fields using it are declared ``Annotated[list[str], NoDecode]``: pydantic-settings would
    otherwise decode every list from the environment as JSON before any validator runs, and
    refuse the comma form the README documents.
    """
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not a JSON list ({exc}); or write it as a,b,c") from None
    return [v.strip() for v in value.split(",") if v.strip()]
