"""Operator sessions: the signed cookie that lets a browser open the operator pages
(``/status``, ``/docs``, ``/redoc``, ``/metrics``) with API keys on.

A browser cannot send ``X-API-Key``; ``POST /login`` (:mod:`gateway.routes.login`)
takes a key in a form field once and answers with a cookie holding
``<expires>.<nonce>.<mac>``: an expiry (Unix seconds), a random nonce and an HMAC-SHA256
of both. The signing secret is derived from the configured keys with scrypt, once, so
every gateway sharing the keys accepts every other's cookie, dropping a key from
``CONVEYOR_API_KEYS`` ends every session, and a stolen cookie is a slow oracle for
guessing a weak key. The cookie never holds the key, nor a digest of it alone.

The edge (:class:`gateway.edge.EdgeMiddleware`) accepts the cookie on the operator
pages only (:func:`operator_page`); every other route still needs the key header.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence
from http.cookies import CookieError, SimpleCookie

from gateway.docs import ASSETS_URL, DOCS_URL, REDOC_URL

COOKIE = "conveyor_session"
"""The cookie's name."""

LOGIN_URL = "/login"
"""The login form (``GET``) and where it posts (``POST``)."""

LOGOUT_URL = "/logout"
"""Clears the cookie."""

OPERATOR_PATHS = frozenset(
    {"/status", "/status.json", "/metrics", DOCS_URL, REDOC_URL, "/openapi.json"}
)
"""The pages a session opens, with what they load (the status page polls
``/status.json``; the docs pages load ``/openapi.json`` and the assets)."""

SESSION = "operator-session"
"""The identity of a request let in by a session cookie (never a key's digest)."""

_CONTEXT = b"conveyor-session-v1"


def operator_page(path: str) -> bool:
    """Whether a session cookie opens ``path``."""
    return path in OPERATOR_PATHS or path.startswith(ASSETS_URL + "/")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Sessions:
    """Issues and checks session tokens.

    Args:
        api_keys: the configured keys; the signing secret is derived from all of them.
        ttl_s: how long a token stays valid after it is issued.
    """

    def __init__(self, api_keys: Sequence[str], ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # Derived here, at start (about 50-90 ms of CPU), not at the first visit, where
        # it would stall the event loop and every request on it.
        keys = b"\0".join(sorted(k.encode() for k in api_keys))
        self._secret = hashlib.scrypt(keys, salt=_CONTEXT, n=2**14, r=8, p=1, dklen=32)

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def issue(self, now: float | None = None) -> str:
        """A fresh token, valid for :attr:`ttl_s` from ``now`` (default: the clock)."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        body = f"{expires}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._mac(body)}"

    def valid(self, token: str, now: float | None = None) -> bool:
        """Whether ``token`` was issued here (its MAC, compared in constant time) and has
        not expired (nor claims to expire later than a token issued now would)."""
        body, _, mac = token.rpartition(".")
        expires, _, nonce = body.partition(".")
        if not (expires.isdigit() and nonce and mac) or len(token) > 200:
            return False
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return False
        now = time.time() if now is None else now
        return now < int(expires) <= now + self.ttl_s + 1

    def in_headers(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether the request's ``Cookie`` headers hold a valid session token."""
        for name, value in headers:
            if name != b"cookie":
                continue
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except CookieError:  # malformed: no session in it
                continue
            morsel = jar.get(COOKIE)
            if morsel is not None and self.valid(morsel.value):
                return True
        return False
