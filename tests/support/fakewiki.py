"""A fake MediaWiki API on loopback, so tests run the real ``wikipedia`` client against it.

It answers what ``wikipedia.search``, ``wikipedia.page`` and ``WikipediaPage.content``
ask (``action=query`` with ``list=search``; ``prop=info|pageprops`` with ``inprop=url``,
``ppprop=disambiguation`` and ``redirects``; ``prop=extracts|revisions`` with
``explaintext``; ``prop=revisions`` with ``rvparse`` for disambiguation pages), in the
shapes the real API answers, and can be made to hang or fail.
"""

from __future__ import annotations

import html
import json
import logging
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

log = logging.getLogger(__name__)

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class _Page:
    pageid: int
    title: str
    text: str
    words: frozenset[str]
    options: tuple[str, ...] | None  # set for a disambiguation page
    redirect_to: str | None


class FakeWiki:
    """A MediaWiki ``api.php`` on 127.0.0.1 and a free port, serving registered pages.

    Use as a context manager (or call :meth:`start` and :meth:`close`). Attributes a test
    may set at any time:

    - ``hang``: accept requests and never answer them (until :meth:`close`).
    - ``fail_status``: answer every request with this HTTP status and ``fail_body``
      (200 with an HTML body stands in for a proxy's error page).
    - ``retry_after``: a ``Retry-After`` header on those answers (seconds, or any text,
      sent as given: Latin-1, as ``http.server`` encodes headers).
    """

    def __init__(self) -> None:
        self.hang = False
        self.fail_status: int | None = None
        self.fail_body = "<html><body><h1>Wikimedia Error</h1></body></html>"
        self.retry_after: int | str | None = None
        self.received: list[dict[str, str]] = []
        self._pages: dict[str, _Page] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def api_url(self) -> str:
        """The URL of ``api.php``."""
        if self._server is None:
            raise RuntimeError("FakeWiki is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}/w/api.php"

    @property
    def requests_received(self) -> int:
        """How many HTTP requests arrived (hung and failed ones included)."""
        with self._lock:
            return len(self.received)

    def add(self, title: str, text: str) -> None:
        """Register an article.

        Args:
            title: its title; its URL is ``https://en.wikipedia.org/wiki/<Title_with_underscores>``.
            text: its plain text (the ``extract``); search matches its words and the title's.
        """
        self._register(title, text, None, None)

    def add_disambiguation(self, title: str, options: list[str]) -> None:
        """Register a disambiguation page.

        Args:
            title: its title.
            options: the titles it links to, in order (they need not exist).
        """
        self._register(title, f"{title} may refer to: " + "; ".join(options), tuple(options), None)

    def add_redirect(self, title: str, target: str) -> None:
        """Register a redirect (not found by search, followed by ``redirects``).

        Args:
            title: the redirect's title.
            target: the title it leads to.
        """
        self._register(title, "", None, target)

    def _register(
        self, title: str, text: str, options: tuple[str, ...] | None, redirect_to: str | None
    ) -> None:
        with self._lock:
            pageid = 1000 + len(self._pages)
            words = frozenset(_WORD.findall(f"{title} {text}".lower()))
            self._pages[title] = _Page(pageid, title, text, words, options, redirect_to)

    def start(self) -> FakeWiki:
        """Start serving on a free loopback port."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("fakewiki: %s", format % args)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), name="fakewiki", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Release hung requests, stop serving and free the port."""
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeWiki:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        params = dict(parse_qsl(urlsplit(request.path).query, keep_blank_values=True))
        with self._lock:
            self.received.append(params)
        if self.hang:
            self._closing.wait(timeout=60)  # bounded: close() sets it
            return
        if self.fail_status is not None:
            self._send(request, self.fail_status, self.fail_body, "text/html")
            return
        self._send(request, 200, json.dumps(self._answer(params)), "application/json")

    def _send(self, request: BaseHTTPRequestHandler, status: int, body: str, kind: str) -> None:
        data = body.encode()
        request.send_response(status)
        request.send_header("Content-Type", f"{kind}; charset=utf-8")
        request.send_header("Content-Length", str(len(data)))
        if status != 200 and self.retry_after is not None:
            request.send_header("Retry-After", str(self.retry_after))
        request.end_headers()
        request.wfile.write(data)

    def _answer(self, params: dict[str, str]) -> dict[str, Any]:
        if params.get("action") != "query" or params.get("format") != "json":
            return _error("badvalue", "only action=query&format=json is faked")
        if params.get("list") == "search":
            return self._search(params.get("srsearch", ""), int(params.get("srlimit", "10")))
        if "titles" in params:
            return self._query(params)
        return _error("missingparam", "one of list=search or titles is needed")

    def _search(self, query: str, limit: int) -> dict[str, Any]:
        wanted = set(_WORD.findall(query.lower()))
        with self._lock:
            pages = [p for p in self._pages.values() if p.redirect_to is None]
        hits = [p for p in pages if wanted and wanted <= p.words]
        hits.sort(key=lambda p: not wanted <= set(_WORD.findall(p.title.lower())))
        found = [{"ns": 0, "title": p.title, "pageid": p.pageid} for p in hits[:limit]]
        return {
            "batchcomplete": "",
            "query": {"searchinfo": {"totalhits": len(hits)}, "search": found},
        }

    def _query(self, params: dict[str, str]) -> dict[str, Any]:
        asked = params["titles"]
        title = asked.replace("_", " ")
        title = title[:1].upper() + title[1:]
        query: dict[str, Any] = {}
        if title != asked:
            query["normalized"] = [{"from": asked, "to": title}]
        with self._lock:
            page = self._pages.get(title)
            if page is not None and page.redirect_to is not None and "redirects" in params:
                query["redirects"] = [{"from": title, "to": page.redirect_to}]
                page = self._pages.get(page.redirect_to)
        if page is None:
            query["pages"] = {"-1": {"ns": 0, "title": title, "missing": ""}}
            return {"batchcomplete": "", "query": query}
        props = params.get("prop", "").split("|")
        entry: dict[str, Any] = {"pageid": page.pageid, "ns": 0, "title": page.title}
        if "info" in props:
            entry.update(contentmodel="wikitext", pagelanguage="en", length=len(page.text))
            if "url" in params.get("inprop", "").split("|"):
                url = "https://en.wikipedia.org/wiki/" + _url_title(page.title)
                entry.update(fullurl=url, canonicalurl=url)
        if "pageprops" in props and page.options is not None:
            entry["pageprops"] = {"disambiguation": ""}
        if "extracts" in props:
            entry["extract"] = page.text
        if "revisions" in props:
            revision: dict[str, Any] = {"revid": page.pageid * 10, "parentid": page.pageid * 10 - 1}
            if "rvparse" in params:
                revision["*"] = _disambiguation_html(page)
            entry["revisions"] = [revision]
        query["pages"] = {str(page.pageid): entry}
        return {"batchcomplete": "", "query": query}


def _disambiguation_html(page: _Page) -> str:
    items = "".join(
        f'<li><a href="/wiki/{_url_title(o)}" title="{html.escape(o)}">'
        f"{html.escape(o)}</a>, one meaning</li>"
        for o in page.options or ()
    )
    return f"<p><b>{html.escape(page.title)}</b> may refer to:</p><ul>{items}</ul>"


def _url_title(title: str) -> str:
    # MediaWiki's wfUrlencode leaves these unescaped.
    return quote(title.replace(" ", "_"), safe=";:@$!*(),/~")


def _error(code: str, info: str) -> dict[str, Any]:
    return {"error": {"code": code, "info": info, "*": "See https://en.wikipedia.org/w/api.php"}}
