"""Settings shared by every conveyor process; each process extends them in one class."""

from __future__ import annotations

import json
import os
import re
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import AliasChoices, AliasPath, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from pipelines.errors import ConfigError
from pipelines.keys import MAX_PARTITIONS, Keys

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""URL schemes naming a node of a Redis Cluster (the cluster client is used)."""

URL_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)
"""What ``CONVEYOR_REDIS_URL`` may start with."""

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
"""The Redis every process uses unless ``CONVEYOR_REDIS_URL`` says otherwise."""

MAX_DEADLINE_S = 30 * 86_400
"""The longest time budget a request may have (30 days)."""

S = TypeVar("S", bound=BaseSettings)

# pydantic-settings names the field only in the text of the error it wraps a failed
# decode of a complex value (JSON) in.
_SOURCE_FIELD = re.compile(r'for field "([^"]+)"')
_SHOWN_CHARS = 80  # of a bad value, in the message


def redact_url(url: str) -> str:
    """``url`` as it may be shown or logged: a password in it (``user:password@`` or a
    ``password=`` query parameter) replaced by ``***``. Every message or log line that
    names a Redis URL shows it through this.

    Args:
        url: a URL, as configured (``CONVEYOR_REDIS_URL``).
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that cannot be parsed)"
    shown = url  # edited in place: urlunsplit would rewrite what it does not touch
    userinfo, at, host = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        shown = shown.replace(parts.netloc, f"{userinfo.split(':', 1)[0]}:***@{host}", 1)
    if parts.query:
        query = _PASSWORD_PARAM.sub(r"\1***", parts.query)
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return shown


_PASSWORD_PARAM = re.compile(r"((?:^|&)password=)[^&]*", re.IGNORECASE)


class CommonSettings(BaseSettings):
    """What every process needs to reach Redis. Read from ``CONVEYOR_*`` variables.

    Attributes:
        redis_url: ``redis://`` or ``rediss://`` URL; user, password and db are honoured.
            ``redis+cluster://`` (or ``rediss+cluster://``) names one node of a Redis
            Cluster: the cluster client finds the others and routes each key to its
            shard.
        namespace: key namespace, also the Redis Cluster hash tag.
        partitions: how many partitions (hash slots) the namespace's streams are split
            into (`pipelines.keys`): spread over a cluster's shards, they carry
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

    redis_url: str = Field(default=DEFAULT_REDIS_URL, repr=False)  # a password
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
        if value.startswith(("redis://", "rediss://")):  # one host: its port and db read now
            parts = urlsplit(value)
            # Fixed messages: parts of a password with an unescaped / # ? @ could show.
            hint = "(percent-encode any / # ? @ in the password)"
            try:
                parts.port  # noqa: B018  (reading it checks it: a number in 0-65535)
            except ValueError:
                raise ValueError(f"the port must be a number in 0-65535 {hint}") from None
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"the database after the host must be a number {hint}")
        return value

    @property
    def cluster(self) -> bool:
        """Whether `redis_url` names a Redis Cluster."""
        return self.redis_url.startswith(CLUSTER_SCHEMES)

    @property
    def keys(self) -> Keys:
        """Key names of `namespace`: partition 0's (`Keys.at`, `Keys.of`
        and `Keys.each` give the others)."""
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


def load_settings(cls: type[S], **values: Any) -> S:
    """``cls(**values)``: settings read from the environment, ``values`` over it, each
    problem named by the environment variable holding it.

    Every process and command builds its settings here, so that a bad ``CONVEYOR_*``
    value stops it with one line its entry point prints (exit status 2), not pydantic's
    multi-line error naming a field.

    Args:
        cls: the settings class.
        values: fields given otherwise (flags); a problem with one is named by its field.

    Raises:
        ConfigError: a value is invalid, or a complex one (a dict, a list) is not JSON;
            its message is one line, e.g. ``CONVEYOR_MAX_BATCH_SIZE: Input should be a
            valid integer, unable to parse string as an integer (got 'abc')``, the
            problems ``; ``-separated.
    """
    try:
        return cls(**values)
    except SettingsError as exc:
        found = _SOURCE_FIELD.search(str(exc))
        field = found.group(1) if found else None
        name = env_name(cls, field) if field in cls.model_fields else cls.__name__
        why = exc.__cause__ or exc
        what = f"not valid JSON ({why})" if isinstance(why, json.JSONDecodeError) else str(why)
        shown = field is not None and cls.model_fields[field].repr
        raw = next((v for k, v in os.environ.items() if k.upper() == name), None)
        got = f" (got {_shorten(raw)})" if shown and raw is not None else ""
        raise ConfigError(f"{name}: {what}{got}") from None
    except ValidationError as exc:
        wrong = "; ".join(_problem(cls, error, values) for error in exc.errors())
        raise ConfigError(wrong) from None


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable ``cls`` reads ``field`` from (an alias, if it has one,
    else the class's prefix and the field's name), as a user writes it: upper case.

    Args:
        cls: the settings class.
        field: the field's name.
    """
    info = cls.model_fields[field]
    alias = info.validation_alias or info.alias
    if isinstance(alias, AliasChoices):
        names = [c for c in alias.choices if isinstance(c, str)]
        return " or ".join(n.upper() for n in names) or field
    if isinstance(alias, AliasPath):
        return str(alias.path[0]).upper()
    if alias is not None:
        return alias.upper()
    return (str(cls.model_config.get("env_prefix", "")) + field).upper()


def _problem(cls: type[BaseSettings], error: ErrorDetails, values: dict[str, Any]) -> str:
    """One of a ValidationError's problems: ``VARIABLE: message (got value)``."""
    loc = [str(part) for part in error["loc"]]
    head = loc[0] if loc else ""
    field = next(
        (name for name, info in cls.model_fields.items() if head in (name, info.alias)),
        None,
    )
    if field is None:  # a problem of the whole (a model validator's)
        where = cls.__name__
    elif field in values:
        where = field
    else:
        where = env_name(cls, field)
    inner = ".".join(loc[1:])  # within a JSON value: which key, e.g. embed.gpus
    message = error["msg"].removeprefix("Value error, ")
    # Not a secret's value (``repr=False``), nor a whole object (a model validator's input).
    shown = (field is None or cls.model_fields[field].repr) and not isinstance(error["input"], dict)
    got = f" (got {_shorten(error['input'])})" if shown else ""
    return f"{where}: {inner + ': ' if inner else ''}{message}{got}"


def _shorten(value: object) -> str:
    """``value`` as it is shown in a message: its repr, on one line, cut short."""
    shown = repr(value)
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 3] + "..."
