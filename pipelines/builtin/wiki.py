"""Fetch a Wikipedia article for a search term: the first step of the wiki-summary pipeline.

The PyPI package ``wikipedia`` does the talking (search, page, content); this module closes
its gaps. It has no timeout: each fetch runs in a daemon thread that the caller stops
waiting for after ``timeout_s``, and each HTTP request gets the time left as its socket
timeout, so an abandoned thread ends by the deadline too. It reads a global ``API_URL``:
each fetch's URL travels with its thread instead, so concurrent calls do not race. Its
``search`` is memoised forever, keyed on the query alone (not the URL): we call the
undecorated function. It parses disambiguation pages with ``BeautifulSoup(html)`` and no
parser (a GuessedAtParserWarning, and results that depend on what is installed): it gets
``html.parser``. Both hooks go into ``wikipedia.wikipedia`` once, at import; the
``requests`` stand-in is plain ``requests.get`` in threads not running a fetch from here.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests
import wikipedia.wikipedia as wikiapi
from bs4 import BeautifulSoup

from pipelines.errors import ConfigError, NotFound, UpstreamUnavailable, retry_after_s

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # an UpstreamUnavailable's retry_after when the server named none
MAX_DISAMBIGUATION_OPTIONS = 10  # options of a disambiguation page tried, a request each

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)")
_search = wikiapi.search.__wrapped__  # past the package's unbounded, URL-blind cache
_local = threading.local()


@dataclass(frozen=True)
class Article:
    """A fetched article.

    Args:
        title: the page's title, as Wikipedia spells it.
        url: the page's canonical URL.
        text: its plain text (sections, no markup), at most ``max_chars`` long.
        truncated: whether ``text`` was cut short.
    """

    title: str
    url: str
    text: str
    truncated: bool

    def to_dict(self) -> dict[str, str | bool]:
        """The article as a JSON object."""
        return asdict(self)


@dataclass
class _Call:
    """What the requests of one fetch share: its URL, deadline and connection pool."""

    api_url: str | None
    deadline: float
    session: requests.Session = field(default_factory=requests.Session)
    sent: int = 0


class _Transport:
    """Stands in for ``requests`` inside ``wikipedia.wikipedia``; applies the thread's call."""

    def get(self, url: str, params: Any = None, headers: Any = None) -> requests.Response:
        """Send the package's GET with this thread's URL, session and time left, if any.

        Args:
            url: the package's ``API_URL``; replaced by the call's, when it has one.
            params: the query string.
            headers: request headers (the package's User-Agent).
        """
        call: _Call | None = getattr(_local, "call", None)
        if call is None:
            return requests.get(url, params=params, headers=headers)
        left = call.deadline - time.monotonic()
        if left <= 0:
            raise requests.Timeout("the deadline passed before the request was sent")
        call.sent += 1
        response = call.session.get(
            call.api_url or url, params=params, headers=headers, timeout=left
        )
        response.raise_for_status()  # the package would feed an error page to .json()
        return response


wikiapi.requests = _Transport()
wikiapi.BeautifulSoup = functools.partial(BeautifulSoup, features="html.parser")


def fetch_article(
    search_term: str,
    *,
    api_url: str | None = None,
    timeout_s: float = 10.0,
    max_chars: int = 100_000,
) -> Article:
    """Search Wikipedia and return the first hit's article.

    Runs the ``wikipedia`` package's ``search`` → first hit → ``page(title,
    auto_suggest=False)`` → ``content``. A disambiguation page resolves to its first option
    that is an article (of the first :data:`MAX_DISAMBIGUATION_OPTIONS`).

    Thread-safe: calls may run concurrently, with different ``api_url`` values; no global is
    set per call. The call blocks for at most about ``timeout_s``; on timeout the worker
    thread is abandoned and ends by itself once its current request times out.

    Args:
        search_term: what to search for.
        api_url: the MediaWiki ``api.php`` URL; None for the package's own
            (``wikipedia.wikipedia.API_URL``, English Wikipedia).
        timeout_s: seconds for the whole fetch, every request included.
        max_chars: the longest text returned; a longer one is cut at the last paragraph,
            sentence or word boundary before it.

    Raises:
        NotFound: the search has no hit, the page does not exist, or no option of a
            disambiguation page is an article.
        UpstreamUnavailable: the API is unreachable, took longer than ``timeout_s``,
            answered an HTTP error, non-JSON or an error object.
        ConfigError: ``api_url`` is not an http(s) URL.
        ValueError: ``timeout_s`` or ``max_chars`` is not positive.
    """
    if timeout_s <= 0 or max_chars <= 0:
        raise ValueError(f"timeout_s and max_chars must be > 0, got {timeout_s}, {max_chars}")
    if api_url is not None:
        parts = urlsplit(api_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"Wikipedia API URL {api_url!r} is not an http(s) URL")
    if not search_term.strip():
        raise NotFound(f"no Wikipedia article matches {search_term!r}")
    started = time.monotonic()
    call = _Call(api_url, deadline=started + timeout_s)
    future: Future[tuple[str, str, str]] = Future()
    threading.Thread(
        target=_run, args=(future, search_term, call), name="conveyor-wiki-fetch", daemon=True
    ).start()
    where = api_url or wikiapi.API_URL
    try:
        title, url, content = future.result(timeout=timeout_s)
    except wikiapi.PageError as exc:
        raise NotFound(f"no Wikipedia article matches {search_term!r}") from exc
    except Exception as exc:
        problem = _describe(exc, timeout_s)
        if problem is None:
            raise
        log.warning("wikipedia fetch of %r from %s: %s", search_term, where, problem[0])
        raise UpstreamUnavailable(
            f"the Wikipedia API at {where} {problem[0]}; retry later", retry_after=problem[1]
        ) from exc
    text, truncated = _truncate(content, max_chars)
    log.info(
        "wikipedia fetch of %r: %r, %d chars, truncated=%s, %d requests in %.2f s",
        search_term,
        title,
        len(text),
        truncated,
        call.sent,
        time.monotonic() - started,
    )
    return Article(title=title, url=url, text=text, truncated=truncated)


def _run(future: Future[tuple[str, str, str]], search_term: str, call: _Call) -> None:
    """The worker thread: run the lookup with ``call`` applied, into ``future``."""
    future.set_running_or_notify_cancel()
    _local.call = call
    try:
        future.set_result(_lookup(search_term))
    except Exception as exc:  # handed to the caller, who maps or re-raises it
        future.set_exception(exc)
    finally:
        del _local.call
        call.session.close()


def _lookup(search_term: str) -> tuple[str, str, str]:
    """Title, URL and plain text of the first hit for ``search_term``."""
    hits: list[str] = _search(search_term, results=1)
    if not hits:
        raise wikiapi.PageError(None, search_term)
    try:
        page = wikiapi.page(hits[0], auto_suggest=False)
    except wikiapi.DisambiguationError as exc:
        page = _first_article(hits[0], exc.options)
    return str(page.title), str(page.url), str(page.content)


def _first_article(title: str, options: list[str]) -> Any:
    """The first of a disambiguation page's ``options`` that is an article."""
    for option in options[:MAX_DISAMBIGUATION_OPTIONS]:
        try:
            return wikiapi.page(option, auto_suggest=False)
        except (wikiapi.PageError, wikiapi.DisambiguationError) as exc:
            log.debug("%r: skipping option %r (%s)", title, option, type(exc).__name__)
    raise wikiapi.PageError(None, title)


def _describe(exc: Exception, timeout_s: float) -> tuple[str, float] | None:
    """What went wrong upstream, and when to retry; None for an error that is not upstream's."""
    if isinstance(exc, TimeoutError | requests.Timeout | wikiapi.HTTPTimeoutError):
        return f"did not answer within {timeout_s:g} s", RETRY_AFTER_S
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        retry_after = retry_after_s(exc.response.headers.get("Retry-After"))
        wait = RETRY_AFTER_S if retry_after is None else retry_after
        return f"answered HTTP {exc.response.status_code}", wait
    if isinstance(exc, requests.exceptions.JSONDecodeError):
        return "answered with something other than JSON", RETRY_AFTER_S
    if isinstance(exc, requests.ConnectionError):
        return "is unreachable", RETRY_AFTER_S
    if isinstance(exc, requests.RequestException):
        return f"could not be asked ({type(exc).__name__})", RETRY_AFTER_S
    if isinstance(exc, wikiapi.WikipediaException):
        return f"answered an error: {str(exc.error)[:200]}", RETRY_AFTER_S
    # The package indexes into the JSON (and asserts on it) without checking its shape.
    if isinstance(exc, KeyError | IndexError | TypeError | AssertionError):
        return f"answered an unexpected response ({type(exc).__name__})", RETRY_AFTER_S
    return None


def _truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` cut to at most ``max_chars`` at a boundary, and whether it was cut.

    Prefers the last line break (a paragraph, in an extract), then the last sentence end,
    then the last space, each only if it keeps at least half of ``max_chars``.
    """
    if len(text) <= max_chars:
        return text, False
    window = text[: max_chars + 1]  # a boundary may be the character just past the limit
    floor = max_chars // 2
    cut = window.rfind("\n", floor)
    if cut < 0:
        ends = [m.end() for m in _SENTENCE_END.finditer(window, floor)]
        cut = ends[-1] if ends else window.rfind(" ", floor)
    if cut < 0:
        cut = max_chars
    return text[:cut].rstrip(), True
