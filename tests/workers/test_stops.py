"""Stop strings (workers/models/stops.py): the text ends before the first, and what a
stream shows is always the start of what it shows later, never a stop string."""

from __future__ import annotations

import itertools

import pytest

from workers.models.stops import cut, held, stops_of


def test_the_text_ends_before_the_earliest_stop() -> None:
    assert cut("one two. three\n", ["\n", "."]) == ("one two", True)
    assert cut("one two", ["zzz"]) == ("one two", False)
    assert stops_of({"stop": "x"}) == ["x"]
    assert stops_of({"stop": ["", "y"]}) == ["y"]
    assert stops_of({}) == []


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("abc ab abx abcd", ["abcd"]),
        ("aaaa END and more", ["END", "E N"]),
        ("no stop in here at all", ["xyz", "!"]),
        ("ends with a partial sto", ["stop"]),
    ],
)
def test_a_stream_shows_a_growing_start_and_never_a_stop(text: str, stops: list[str]) -> None:
    shown = [held(text[:end], stops) for end in range(len(text) + 1)]
    final, _ = cut(text, stops)
    for before, after in itertools.pairwise(shown):
        assert after.startswith(before)
    assert all(final.startswith(s) for s in shown)
    assert not any(stop in s for s in shown for stop in stops)
    longest = max(map(len, stops))
    for end, s in enumerate(shown):  # at most the longest stop less one held back
        assert cut(text[:end], stops)[1] or end - len(s) <= longest - 1
