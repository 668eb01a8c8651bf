"""fetch_article: the real ``wikipedia`` client against a fake MediaWiki API on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from conveyor.embedded import free_port
from pipelines.builtin.wiki import RETRY_AFTER_S, Article, fetch_article
from pipelines.errors import (
    RETRY_AFTER_MAX_S,
    ConfigError,
    NotFound,
    UpstreamUnavailable,
    retry_after_s,
)
from tests.support.fakewiki import FakeWiki

LOVELACE = (
    "Augusta Ada King, Countess of Lovelace, was an English mathematician and writer.\n"
    "She is chiefly known for her work on Charles Babbage's Analytical Engine."
)


@pytest.fixture
def wiki() -> Iterator[FakeWiki]:
    """A fake API with two articles."""
    with FakeWiki() as fake:
        fake.add("Ada Lovelace", LOVELACE)
        fake.add("Charles Babbage", "Charles Babbage was an English polymath. He met Ada.")
        yield fake


def test_found(wiki: FakeWiki) -> None:
    article = fetch_article("lovelace", api_url=wiki.api_url)
    assert article == Article(
        title="Ada Lovelace",
        url="https://en.wikipedia.org/wiki/Ada_Lovelace",
        text=LOVELACE,
        truncated=False,
    )
    assert article.to_dict() == {
        "title": "Ada Lovelace",
        "url": "https://en.wikipedia.org/wiki/Ada_Lovelace",
        "text": LOVELACE,
        "truncated": False,
    }
    # The real client ran: search, page info, content.
    assert wiki.requests_received == 3
    assert [r.get("list") or r.get("prop") for r in wiki.received] == [
        "search",
        "info|pageprops",
        "extracts|revisions",
    ]


def test_title_hits_rank_first_and_search_is_not_cached_across_servers(wiki: FakeWiki) -> None:
    assert fetch_article("BABBAGE", api_url=wiki.api_url).title == "Charles Babbage"
    with FakeWiki() as other:
        other.add("Babbage (crater)", "A lunar impact crater.")
        assert fetch_article("BABBAGE", api_url=other.api_url).title == "Babbage (crater)"


def test_no_search_hit_is_not_found(wiki: FakeWiki) -> None:
    with pytest.raises(NotFound, match="no Wikipedia article matches 'quokka'"):
        fetch_article("quokka", api_url=wiki.api_url)
    assert wiki.requests_received == 1


def test_blank_term_is_not_found_without_asking(wiki: FakeWiki) -> None:
    with pytest.raises(NotFound):
        fetch_article("  ", api_url=wiki.api_url)
    assert wiki.requests_received == 0


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="not an http"):
        fetch_article("x", api_url="en.wikipedia.org/w/api.php")
    with pytest.raises(ValueError, match="max_chars"):
        fetch_article("x", api_url="http://127.0.0.1:1/w/api.php", max_chars=0)


def test_long_article_is_cut_at_a_boundary(wiki: FakeWiki) -> None:
    paragraph = " ".join(f"Sentence number {i} is about engines." for i in range(40))
    text = "\n".join([paragraph] * 1500)  # about 2 MB
    assert len(text) > 2_000_000
    wiki.add("Difference engine", text)
    article = fetch_article("difference engine", api_url=wiki.api_url, max_chars=10_000)
    assert article.truncated
    assert 5_000 <= len(article.text) <= 10_000
    assert text.startswith(article.text)
    assert text[len(article.text)] == "\n"  # cut at a paragraph end


def test_cut_falls_back_to_a_sentence_end(wiki: FakeWiki) -> None:
    text = " ".join(f"Gear {i} turns." for i in range(1000))  # one paragraph
    wiki.add("Gear train", text)
    article = fetch_article("gear train", api_url=wiki.api_url, max_chars=1000)
    assert article.truncated
    assert len(article.text) <= 1000
    assert article.text.endswith("turns.")
    assert text.startswith(article.text + " ")


def test_unreachable_service() -> None:
    url = f"http://127.0.0.1:{free_port()}/w/api.php"
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match="is unreachable") as caught:
        fetch_article("lovelace", api_url=url, timeout_s=5)
    assert time.monotonic() - started < 4
    assert caught.value.retry_after is not None
    assert caught.value.retry_after > 0
    assert "Traceback" not in str(caught.value)


def test_hanging_service_times_out(wiki: FakeWiki) -> None:
    wiki.hang = True
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match=r"did not answer within 0\.5 s"):
        fetch_article("lovelace", api_url=wiki.api_url, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert wiki.requests_received == 1
    # The abandoned thread's own socket timeout ends it too, without the server's help.
    deadline = time.monotonic() + 5
    while _fetch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _fetch_threads()


def test_http_error(wiki: FakeWiki) -> None:
    wiki.fail_status = 500
    with pytest.raises(UpstreamUnavailable, match="answered HTTP 500"):
        fetch_article("lovelace", api_url=wiki.api_url)


def test_rate_limited_passes_retry_after_on(wiki: FakeWiki) -> None:
    wiki.fail_status = 429
    wiki.retry_after = 7
    with pytest.raises(UpstreamUnavailable, match="answered HTTP 429") as caught:
        fetch_article("lovelace", api_url=wiki.api_url)
    assert caught.value.retry_after == 7


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("\u00b2", RETRY_AFTER_S),  # "²": str.isdigit() says yes, float() refuses it
        ("1e3", RETRY_AFTER_S),
        ("inf", RETRY_AFTER_S),
        ("-5", RETRY_AFTER_S),
        ("7.5", RETRY_AFTER_S),
        ("9" * 5000, RETRY_AFTER_MAX_S),  # past int()'s 4,300 digits
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0),  # an HTTP-date gone by
        ("Wed, 21 Oct 2999 07:28:00 GMT", RETRY_AFTER_MAX_S),
    ],
)
def test_an_upstream_retry_after_is_read_strictly_and_bounded(
    wiki: FakeWiki, header: str, expected: float
) -> None:
    # BREAK 7 (issue 23): `Retry-After: ²` made the fetch raise ValueError, a 500.
    wiki.fail_status = 503
    wiki.retry_after = header
    with pytest.raises(UpstreamUnavailable, match="answered HTTP 503") as caught:
        fetch_article("lovelace", api_url=wiki.api_url)
    assert caught.value.retry_after == expected


def test_retry_after_takes_ascii_seconds_and_http_dates_alone() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    assert retry_after_s(" 7 ") == 7
    assert retry_after_s("0000000000012") == 12
    assert retry_after_s("Wed, 01 Jan 2025 00:00:30 GMT", now) == 30
    for junk in (None, "", "\u0663", "7\n", "0x10", "nan", "Wed, 21 Oct 99999 07:28:00 GMT"):
        assert retry_after_s(junk, now) is None, junk


def test_non_json_answer(wiki: FakeWiki) -> None:
    wiki.fail_status = 200
    with pytest.raises(UpstreamUnavailable, match="other than JSON"):
        fetch_article("lovelace", api_url=wiki.api_url)


def test_disambiguation_takes_first_option_that_is_an_article(wiki: FakeWiki) -> None:
    wiki.add_disambiguation(
        "Mercury", ["Mercury (planet)", "Mercury (mythology)", "Quicksilver", "Mercury (element)"]
    )
    wiki.add_disambiguation("Mercury (mythology)", ["Mercury (god)"])
    wiki.add_redirect("Quicksilver", "Mercury (element)")
    wiki.add("Mercury (element)", "Mercury is a chemical element with the symbol Hg.")
    article = fetch_article("mercury", api_url=wiki.api_url)
    assert article.title == "Mercury (element)"
    assert article.url == "https://en.wikipedia.org/wiki/Mercury_(element)"
    assert article.text.startswith("Mercury is a chemical element")


def test_disambiguation_without_articles_is_not_found(wiki: FakeWiki) -> None:
    wiki.add_disambiguation("Lovelace (disambiguation)", ["Lovelace (film)", "Lovelace (band)"])
    with pytest.raises(NotFound, match="disambiguation"):
        fetch_article("disambiguation", api_url=wiki.api_url)


def test_concurrent_fetches_from_different_servers(wiki: FakeWiki) -> None:
    with FakeWiki() as other:
        other.add("Ada (programming language)", "Ada is a programming language.")
        results: dict[str, str] = {}

        def fetch(name: str, url: str) -> None:
            results[name] = fetch_article("ada", api_url=url).title

        threads = [
            threading.Thread(target=fetch, args=(f"{name}{i}", url))
            for i in range(4)
            for name, url in (("wiki", wiki.api_url), ("other", other.api_url))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
    assert {name: title for name, title in results.items() if name.startswith("wiki")} == {
        f"wiki{i}": "Ada Lovelace" for i in range(4)
    }
    assert {name: title for name, title in results.items() if name.startswith("other")} == {
        f"other{i}": "Ada (programming language)" for i in range(4)
    }


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "conveyor-wiki-fetch"]
