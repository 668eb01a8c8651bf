"""``/login`` and ``/logout``: a browser's way onto the operator pages with API keys on
(routed only then).

``GET /login`` is a form with one password field; ``POST /login`` takes an API key in it
(``key``, form-encoded) and, when the key is one of ``CONVEYOR_API_KEYS``, answers 303 to
the page asked for (``next``, an operator page; ``/status`` else) with the session cookie
of :mod:`gateway.sessions`: ``HttpOnly``, ``SameSite=Strict``, ``Secure`` when the request
came over https. A wrong key gets the form again with 401, and no cookie. ``/logout``
(``GET`` or ``POST``) clears the cookie and answers 303 to the form.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from gateway.edge import key_matches
from gateway.sessions import COOKIE, LOGIN_URL, LOGOUT_URL, Sessions, operator_page

HOME = "/status"
"""Where a login goes when it names no operator page."""

_FORM = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>conveyor: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px system-ui,sans-serif;max-width:24rem;margin:4rem auto;padding:0 1rem}}
input{{font:inherit;width:100%;box-sizing:border-box;margin:.4rem 0;padding:.4rem}}
.error{{color:#b00020}}</style></head>
<body><h1>conveyor</h1><p>An API key opens the status page, the API docs and the metrics
in this browser for {hours:g} hours.</p>{error}
<form method="post" action="{login}">
<input type="hidden" name="next" value="{next}">
<label>API key <input type="password" name="key" autocomplete="current-password" autofocus
required></label><input type="submit" value="Log in"></form></body></html>
"""


def _next(value: str | None) -> str:
    """``value`` where it is an operator page (so a login never redirects elsewhere, nor
    off this host), else :data:`HOME`."""
    if value and value.startswith("/") and not value.startswith("//") and operator_page(value):
        return value
    return HOME


def _form(sessions: Sessions, target: str, error: str = "") -> str:
    return _FORM.format(
        hours=sessions.ttl_s / 3600,
        error=f'<p class="error">{html.escape(error)}</p>' if error else "",
        login=LOGIN_URL,
        next=html.escape(target, quote=True),
    )


def _no_store(response: Response) -> Response:
    response.headers["Cache-Control"] = "no-store"
    return response


def add_login_routes(app: FastAPI, sessions: Sessions, api_keys: Sequence[str]) -> None:
    """Route ``/login`` and ``/logout`` (left out of the OpenAPI document: pages for a
    browser, not API).

    Args:
        app: the application to add the routes to.
        sessions: issues the cookies the edge then accepts.
        api_keys: the keys a login may present.
    """
    keys = [k.encode() for k in api_keys]

    @app.get(LOGIN_URL, include_in_schema=False)
    async def login_form(next: str | None = None) -> Response:
        return _no_store(HTMLResponse(_form(sessions, _next(next))))

    @app.post(LOGIN_URL, include_in_schema=False)
    async def login(request: Request) -> Response:
        # Form-encoded by hand: python-multipart is not a dependency, and the edge has
        # bounded the body already.
        try:
            fields = parse_qs((await request.body()).decode("utf-8"), max_num_fields=8)
        except (UnicodeDecodeError, ValueError):
            fields = {}
        target = _next(fields.get("next", [""])[0])
        presented = fields.get("key") or [""]
        if len(presented) != 1 or not key_matches(presented[0].encode(), keys):
            page = _form(sessions, target, "That is not one of this gateway's API keys.")
            return _no_store(HTMLResponse(page, 401))
        response = RedirectResponse(target, 303)
        response.set_cookie(
            COOKIE,
            sessions.issue(),
            max_age=int(sessions.ttl_s),
            path="/",
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return _no_store(response)

    @app.api_route(LOGOUT_URL, methods=["GET", "POST"], include_in_schema=False)
    async def logout(request: Request) -> Response:
        response = RedirectResponse(LOGIN_URL, 303)
        response.delete_cookie(
            COOKIE,
            path="/",
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return _no_store(response)
