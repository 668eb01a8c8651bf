"""Operator sessions (gateway/sessions.py, gateway/routes/login.py): with API keys on, a
browser logs in once with a key and opens ``/status``, ``/docs``, ``/redoc`` and
``/metrics`` with the cookie alone; every other route still needs the key header."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sessions import COOKIE, Sessions
from tests.helpers import Harness, number_stage
from tests.support.browser import CHROMIUM, Chromium, chromium, open_page

KEYS = ["k1", "operator-key-2"]
BROWSER = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
PAGES = (
    "/status",
    "/status.json",
    "/docs",
    "/redoc",
    "/openapi.json",
    "/docs-assets/swagger-ui.css",
    "/metrics",
)


async def keyed(harness: Harness, **overrides: object) -> httpx.AsyncClient:
    """A gateway with :data:`KEYS` on (its client keeps no cookies between requests)."""
    http = await harness.gateway([number_stage()], api_keys=KEYS, **overrides)
    http.cookies = httpx.Cookies()
    return http


async def log_in(http: httpx.AsyncClient, key: str, next: str = "") -> httpx.Response:
    """POST the login form as a browser does."""
    resp = await http.post("/login", data={"key": key, "next": next}, headers=BROWSER)
    http.cookies.clear()  # each request below says which cookie it sends
    return resp


def session_of(resp: httpx.Response) -> str:
    """The session token a login's answer sets."""
    [set_cookie] = resp.headers.get_list("set-cookie")
    name, _, rest = set_cookie.partition("=")
    assert name == COOKIE
    return rest.split(";")[0]


def with_cookie(token: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE}={token}"}


async def test_without_a_key_or_cookie_the_pages_refuse_and_a_browser_is_sent_to_log_in(
    harness: Harness,
) -> None:
    http = await keyed(harness)
    for page in PAGES:
        assert (await http.get(page)).status_code == 401, page
    resp = await http.get("/status", headers=BROWSER)
    assert resp.status_code == 303
    assert resp.headers["location"] == "/login?next=/status"
    form = await http.get("/login?next=/docs", headers=BROWSER)
    assert form.status_code == 200
    assert 'type="password" name="key"' in form.text
    assert 'name="next" value="/docs"' in form.text
    # Not an operator page: a browser gets the plain 401.
    assert (await http.get("/v1/jobs/x", headers=BROWSER)).status_code == 401


async def test_a_wrong_key_gets_401_and_no_cookie(harness: Harness) -> None:
    http = await keyed(harness)
    for key in ("nope", "", "k1x", "K1"):
        resp = await log_in(http, key)
        assert resp.status_code == 401, key
        assert "set-cookie" not in resp.headers
        assert "not one of this gateway" in resp.text
    resp = await http.post("/login", content=b"key=k1&key=k1", headers=BROWSER)
    assert resp.status_code == 401  # two keys: ambiguous
    assert "set-cookie" not in resp.headers


async def test_the_cookie_alone_opens_the_operator_pages_and_nothing_else(
    harness: Harness,
) -> None:
    http = await keyed(harness)
    resp = await log_in(http, "operator-key-2", next="/docs")
    assert resp.status_code == 303
    assert resp.headers["location"] == "/docs"
    assert resp.headers["cache-control"] == "no-store"
    set_cookie = resp.headers["set-cookie"].lower()
    for attribute in ("httponly", "samesite=strict", "path=/", "max-age=28800"):
        assert attribute in set_cookie
    assert "secure" not in set_cookie  # plain http
    token = session_of(resp)
    # An expiry, a nonce and a MAC, nothing else: no key in it. (Not "k1" not in token:
    # two random base64 characters are "k1" in about one token in seventy.)
    expires, nonce, mac = token.split(".")
    assert expires.isdigit()
    assert (len(nonce), len(mac)) == (16, 43)
    assert "operator" not in token
    for page in PAGES:
        assert (await http.get(page, headers=with_cookie(token))).status_code == 200, page
    # Everything else still needs the key header.
    cookie = with_cookie(token)
    for method, path in (
        ("POST", "/v1/double"),
        ("GET", "/v1/double?value=1"),
        ("POST", "/v1/jobs/double"),
        ("GET", "/v1/jobs/some-id"),
        ("GET", "/v1/models"),
    ):
        body = {"value": 1} if method == "POST" else None
        resp = await http.request(method, path, json=body, headers=cookie)
        assert resp.status_code == 401, path
    # A cookie beside a wrong key is refused, as two different keys are.
    wrong = {**cookie, "X-API-Key": "nope"}
    assert (await http.get("/status", headers=wrong)).status_code == 401
    # Prometheus keeps scraping with the header.
    assert (await http.get("/metrics", headers={"Authorization": "Bearer k1"})).status_code == 200


async def test_a_tampered_expired_or_foreign_cookie_gets_401(harness: Harness) -> None:
    http = await keyed(harness)
    token = session_of(await log_in(http, "k1"))
    expires, nonce, mac = token.split(".")
    flipped = mac[:-2] + ("A" if mac[-2] != "A" else "B") + mac[-1]
    later = str(int(expires) + 3600)
    sessions = Sessions(KEYS, 28_800)
    stale = sessions.issue(now=time.time() - 28_800 - 5)  # signed right, expired
    too_long = Sessions(KEYS, 10 * 28_800).issue()  # signed right, outlives any ttl here
    foreign = Sessions(["other-key"], 28_800).issue()
    for bad in (
        f"{expires}.{nonce}.{flipped}",
        f"{later}.{nonce}.{mac}",
        f"{expires}.{nonce}x.{mac}",
        f"{expires}.{nonce}",
        "",
        stale,
        too_long,
        foreign,
    ):
        resp = await http.get("/status", headers=with_cookie(bad))
        assert resp.status_code == 401, bad
    assert (await http.get("/status", headers=with_cookie(token))).status_code == 200
    assert (await http.get("/status", headers={"Cookie": 'x="\\'})).status_code == 401


async def test_logout_clears_the_cookie(harness: Harness) -> None:
    http = await keyed(harness)
    resp = await http.get("/logout")
    assert resp.status_code == 303
    assert resp.headers["location"] == "/login"
    cleared = resp.headers["set-cookie"]
    assert cleared.startswith(f'{COOKIE}="";') or cleared.startswith(f"{COOKIE}=;")
    assert "max-age=0" in cleared.lower()


@pytest.mark.parametrize("next", ["https://evil.example/", "//evil.example/", "/v1/double"])
async def test_a_login_goes_only_to_an_operator_page(harness: Harness, next: str) -> None:
    http = await keyed(harness)
    resp = await log_in(http, "k1", next=next)
    assert resp.status_code == 303
    assert resp.headers["location"] == "/status"


async def test_over_https_the_cookie_is_secure(harness: Harness) -> None:
    http = await keyed(harness)
    http.base_url = httpx.URL("https://gateway")
    resp = await log_in(http, "k1")
    assert "secure" in resp.headers["set-cookie"].lower()
    assert (await http.get("/metrics", headers=with_cookie(session_of(resp)))).status_code == 200


async def test_without_keys_there_is_no_login(harness: Harness) -> None:
    http = await harness.gateway([number_stage()])
    assert (await http.get("/login")).status_code == 404
    assert (await http.get("/status")).status_code == 200


async def evaluate(browser: Chromium, session: str, expression: str) -> Any:
    """``expression``'s value in the page (None while the page is between documents)."""
    try:
        result = await browser.call(
            "Runtime.evaluate", session, expression=expression, returnByValue=True
        )
    except RuntimeError:  # the page navigated while it ran
        return None
    return result["result"].get("value")


async def page_says(browser: Chromium, session: str, expression: str, limit_s: float = 15) -> Any:
    """Wait for ``expression`` to be truthy in the page; its value."""
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        value = await evaluate(browser, session, expression)
        if value:
            return value
        await asyncio.sleep(0.1)
    url = await evaluate(browser, session, "location.href")
    pytest.fail(f"the page never showed {expression!r} (at {url})")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
async def test_a_browser_logs_in_and_sees_the_live_status_page(
    harness: Harness, tmp_path: Path
) -> None:
    base = await harness.http_server([number_stage()], api_keys=KEYS)
    async with chromium(tmp_path) as browser:
        session = await open_page(browser, f"{base}/status")
        # Sent to the form, which comes back to the page asked for.
        await page_says(browser, session, "location.pathname === '/login' && !!document.forms[0]")
        await evaluate(
            browser,
            session,
            "document.querySelector('[name=key]').value = 'operator-key-2';"
            "document.forms[0].submit()",
        )
        refreshes = "location.pathname === '/status' && "
        refreshes += "Number(document.getElementById('status')?.dataset.refreshes || 0) >= 2"
        await page_says(browser, session, refreshes)  # /status.json polled with the cookie
        assert await evaluate(browser, session, "document.cookie") == ""  # HttpOnly
        await evaluate(browser, session, "location.href = '/docs'")
        await page_says(browser, session, "!!document.querySelector('.opblock')")  # loaded
