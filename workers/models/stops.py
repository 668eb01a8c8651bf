"""Stop strings: a generation's text ends before the first of its item's ``stop`` strings,
and a stream never shows one (what could still turn into one is held back).

Pure functions on text, shared by the static generator
(:class:`~workers.models.hf_text.Generator`) and the running batch
(:class:`~workers.models.decoder.Decoder`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelines.model import Item


def stops_of(item: Item) -> list[str]:
    """The item's ``stop`` strings (none: an empty list); the empty string is no stop."""
    stop = item.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


def cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the earliest occurrence of any of ``stops``, and whether one occurs."""
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    if not found:
        return text, False
    return text[: min(found)], True


def held(text: str, stops: Sequence[str]) -> str:
    """What of ``text`` (a generation's text so far) a stream may show now: cut at a stop
    that occurs, else without the longest tail that is the start of a stop (at most the
    longest stop less one character), which the next tokens may complete. What it returns
    is always the start of what it returns for the same text grown longer."""
    text, stopped = cut(text, stops)
    if stopped or not stops:
        return text
    longest = max(len(s) for s in stops)
    for keep in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-keep:]
        if any(s.startswith(tail) for s in stops):
            return text[:-keep]
    return text
