"""Fixtures of the worker tests that run real models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.workers.fake_cuda import FakeCuda


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module, as a worker on a small host runs: two threads on
    the 2-core machine, busy with Redis and the test's own event loop, ran small models
    ~50x slower (idle OpenMP threads contending for the cores). Restored after. (torch is
    imported here, not above: most worker tests never load it.)"""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """``torch.cuda``'s device, stream, event, graph and pinned-memory calls recorded by
    a :class:`~tests.workers.fake_cuda.FakeCuda` for the test (undone after it; imported
    here, as torch is above)."""
    from tests.workers.fake_cuda import install

    return install(monkeypatch)
