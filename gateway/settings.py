"""The gateway process's settings, read from ``CONVEYOR_*`` environment variables."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from pipelines.settings import MAX_DEADLINE_S, CommonSettings, comma_list


class GatewaySettings(CommonSettings):
    """Settings of one gateway process.

    Attributes:
        host: address to bind.
        port: port to bind.
        max_body_bytes: larger request bodies get 413 before they are read.
        default_timeout_s: a request's deadline unless it asks for less.
        max_timeout_s: the most a client may ask for with ``X-Conveyor-Timeout``.
        job_timeout_s: an async job's deadline (a client may ask for less).
        max_backlog: overrides every stage's backlog bound when set.
        retry_after_s: the Retry-After a 503 carries.
        admission_refresh_ms: how stale a stage's measured backlog may be.
        admission_headroom: admit a request only if its predicted finish falls within
            this fraction of its deadline (the rest absorbs run-time jitter; 1: none).
        request_share: the fraction of a stage's backlog bound that requests of many
            items (an OpenAI list of inputs, ``n`` choices) hold together at a time in this
            process; the rest are enqueued as earlier ones end (`gateway.share`).
        reply_block_ms: how long one read of the reply stream blocks.
        api_keys: comma-separated keys; when set, every route but /healthz and /readyz
            needs one (``Authorization: Bearer <key>`` or ``X-API-Key``), else 401; the
            operator pages also take the cookie ``POST /login`` sets for a key.
        cors_origins: comma-separated origins allowed by CORS; empty: CORS off.
        client_timeout_s: a client must send a request's headers within this long of
            opening the connection (or of starting the request), and its body within this
            long of the headers; else 408 and the connection is closed (a connection that
            sent nothing is closed silently). Bounds what slow clients can hold open.
        max_header_bytes: a request whose header block grows past this gets 431 and the
            connection is closed.
        gateways: gateway processes serving ``host:port`` on this host, so a many-core
            host is not capped by one process's event loop: ``conveyor up`` and
            ``conveyor gateway`` start this many; above 1 each binds with
            ``SO_REUSEPORT`` and the kernel spreads connections among them (each has its
            own reply streams).
        reuse_port: bind with ``SO_REUSEPORT`` even when alone, so that a replacement
            can start listening beside it (``conveyor up --reload`` sets it: a gateway is
            replaced without a gap, ``conveyor.handover``).
        drain_s: on SIGTERM (``conveyor up`` stopping, a rolling deploy) the gateway
            stops taking requests (each new one gets 503 + Retry-After) and gives those
            in flight this long to be answered (one still waiting then gets a JSON 504);
            then its port closes (`Gateway.drain`).
        access_log: one INFO line per request on the ``gateway.access`` logger (method,
            route, status, milliseconds, request id); false: none.
        session_ttl_s: with API keys on, how long the cookie ``POST /login`` sets opens
            the operator pages (`gateway.sessions`).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=1_048_576, ge=1)
    # Finite and at most 30 days: a deadline becomes a key's expiry, which Redis bounds.
    default_timeout_s: float = Field(default=30.0, gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False)
    max_timeout_s: float = Field(default=300.0, gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False)
    job_timeout_s: float = Field(default=3600.0, gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False)
    max_backlog: int | None = Field(default=None, ge=1)
    retry_after_s: int = Field(default=1, ge=1)
    admission_refresh_ms: float = Field(default=50.0, ge=0)
    admission_headroom: float = Field(default=0.9, gt=0, le=1)
    request_share: float = Field(default=0.5, gt=0, le=1)
    reply_block_ms: int = Field(default=1000, ge=1, le=30_000)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    client_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    max_header_bytes: int = Field(default=65_536, ge=1024)
    gateways: int = Field(default=1, ge=1, le=256)
    reuse_port: bool = False
    drain_s: float = Field(default=10.0, ge=0, le=3600, allow_inf_nan=False)
    access_log: bool = True
    session_ttl_s: float = Field(default=28_800.0, ge=60, le=2_592_000, allow_inf_nan=False)

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        # "a,b" as the README writes it, or a JSON list.
        return comma_list(value)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_not_blank(cls, value: object) -> object:
        # Set but empty (say `${API_KEYS}` with the variable unset) must not turn
        # authentication off without a word: off is the variable unset.
        if isinstance(value, str) and not comma_list(value):
            raise ValueError("is set but holds no key; unset CONVEYOR_API_KEYS to turn keys off")
        return value
