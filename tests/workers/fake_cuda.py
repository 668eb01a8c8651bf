"""A fake of the ``torch.cuda`` calls the runners make, for CPU tests of what they pass:
which device a call is made under, which stream an event marks, which flags it has, how
many graphs are captured (issue 30)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch


class FakeCuda:
    """``torch.cuda`` as a runner calls it, recorded: each call with the device it was
    made under (the innermost ``torch.cuda.device`` scope; None outside any), so a CPU
    test can check which device and stream a runner on ``cuda:N`` asks for, and which
    flags it passes. Captures and pools are counted; a graph's replay does nothing.

    Attributes:
        events: every event made (``blocking``, ``made_under``, ``recorded``, ``waits``).
        pins: the device each ``Tensor.pin_memory`` call was made under.
        captures: the device each graph capture was made under.
        pools: how many graph memory pools were made.
    """

    def __init__(self) -> None:
        self.scopes: list[Any] = []
        self.events: list[FakeEvent] = []
        self.pins: list[Any] = []
        self.captures: list[Any] = []
        self.pools = 0

    @property
    def under(self) -> Any:
        return self.scopes[-1] if self.scopes else None

    @contextmanager
    def device(self, device: Any) -> Iterator[None]:
        self.scopes.append(torch.device(device))
        try:
            yield
        finally:
            self.scopes.pop()

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream(torch.device(device) if device is not None else self.under)

    def event(self, **flags: Any) -> FakeEvent:
        made = FakeEvent(self.under, bool(flags.get("blocking", False)))
        self.events.append(made)
        return made

    def graph_pool_handle(self) -> object:
        self.pools += 1
        return object()

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    @contextmanager
    def graph(self, graph: Any, **options: Any) -> Iterator[None]:
        self.captures.append(self.under)
        yield


class FakeStream:
    def __init__(self, device: Any) -> None:
        self.device = device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)

    def wait_stream(self, other: Any) -> None:
        pass


class FakeEvent:
    def __init__(self, made_under: Any, blocking: bool) -> None:
        self.made_under, self.blocking = made_under, blocking
        self.recorded: list[Any] = []
        self.waits = 0

    def record(self, stream: Any = None) -> None:
        self.recorded.append(stream)

    def synchronize(self) -> None:
        self.waits += 1


class FakeGraph:
    def replay(self) -> None:
        pass


def install(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Replace ``torch.cuda``'s device, stream, event, graph and pinned-memory calls by a
    :class:`FakeCuda` (``monkeypatch`` undoes it)."""
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", fake.graph_pool_handle)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake.graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def pin_memory(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        fake.pins.append(fake.under)
        return tensor

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return fake
