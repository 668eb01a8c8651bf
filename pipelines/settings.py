"""Settings shared by every conveyor process; each process extends them in one class."""

from __future__ import annotations

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipelines.keys import Keys


class CommonSettings(BaseSettings):
    """What every process needs to reach Redis. Read from ``CONVEYOR_*`` variables.

    Attributes:
        redis_url: ``redis://`` or ``rediss://`` URL; user, password and db are honoured.
        namespace: key namespace, also the Redis Cluster hash tag.
        redis_timeout_s: connect and command timeout; Redis being down fails this fast.
    """

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "conveyor"
    redis_timeout_s: float = 2.0

    @field_validator("namespace")
    @classmethod
    def _namespace_ok(cls, value: str) -> str:
        Keys(value)  # raises with a message naming the value
        return value

    @field_validator("redis_url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @property
    def keys(self) -> Keys:
        """Key names of :attr:`namespace`."""
        return Keys(self.namespace)
