"""Host reads of device values: the operations that make the host wait for the device.

On an accelerator, kernels are queued and the host goes on; an operation whose answer the
host needs (a tensor's truth value, ``.item()``, ``nonzero``'s size) waits until every
kernel queued before it has run: a sync. A sync inside a staged runner's ``launch`` stops
the host from queuing batch n+1 while batch n runs, which is the whole of the overlap
(transformers 5.x reads ``attention_mask.all()`` in every BERT-family forward).

:class:`DeviceReads` sees them on any device, the CPU included, where they cost nothing:
the tests count them (none in a runner's ``launch``), and the simulated accelerator
(:mod:`workers.models.simulated`) waits for its device at each, as a GPU would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS: frozenset[Any] = frozenset(
    {
        torch.ops.aten.is_nonzero.default,  # bool(tensor)
        torch.ops.aten._local_scalar_dense.default,  # tensor.item(), int(tensor), ...
        torch.ops.aten.item.default,
        torch.ops.aten.nonzero.default,  # its size is read from the device
    }
)
"""The aten operations that read a device value on the host (a sync on a GPU)."""


class DeviceReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """While entered, counts the operations of :data:`SYNC_OPS` run in this thread, and
    calls ``on_read`` before each (where the simulated accelerator waits for its device).

    Args:
        on_read: called before each read, with nothing; None: only count.

    Attributes:
        seen: the reads, by operation name, in order.
    """

    def __init__(self, on_read: Callable[[], None] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.on_read = on_read
        self.seen: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``func``; a read is counted (and waited for) first."""
        if func in SYNC_OPS:
            self.seen.append(str(func))
            if self.on_read is not None:
                self.on_read()
        return func(*args, **(kwargs or {}))
