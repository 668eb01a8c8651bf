"""How many torch intra-op threads a process runs: one rule for ``conveyor up``, a bare
``python -m workers`` and the bench.

In order, the first that says wins:

1. a stage's own ``threads`` (the most any stage of the process asks:
   :attr:`~pipelines.stages.Stage.threads`, after ``CONVEYOR_RESOURCES``);
2. ``CONVEYOR_THREADS``;
3. on ``cuda``: ``CONVEYOR_CUDA_THREADS`` (1). The model's work runs on the device; the
   host only launches kernels and waits, and more threads only spin: on a 16-core H100 host
   a MiniLM batch of 32 took 114 ms of CPU for 13 ms of wall time at torch's default of 16,
   and a mixed-length batch 98 ms against 20 ms at 1;
4. on ``cpu``: the cores the process may use divided among the model processes sharing
   them, at least 1 (``up`` knows both); a process that knows neither (a bare worker, the
   bench in-process) keeps torch's default, the host's cores.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

CUDA_THREADS = 1
"""Intra-op threads of a process whose models run on cuda, unless something says."""


def torch_threads(
    device: str,
    *,
    asked: int | None = None,
    setting: int | None = None,
    cuda_threads: int = CUDA_THREADS,
    cores: int | None = None,
    processes: int = 1,
) -> int | None:
    """The torch intra-op threads of one process (see the module's docstring).

    Args:
        device: where its models run, resolved (``cpu``, ``cuda``, ``cuda:N``; see
            :func:`resolved_device`).
        asked: the most its stages ask (None: none asks).
        setting: ``CONVEYOR_THREADS`` (None: unset).
        cuda_threads: ``CONVEYOR_CUDA_THREADS``: the count on cuda.
        cores: the cores it may run on (None: unknown, keep torch's default on cpu).
        processes: the model processes dividing ``cores``.

    Returns:
        The count to set, or None: leave torch's default.
    """
    if asked:
        return asked
    if setting:
        return setting
    if device.startswith("cuda"):
        return cuda_threads
    if cores is None:
        return None
    return max(1, cores // max(1, processes))


def resolved_device(spec: str, model: object = None) -> str:
    """Where a model runs, as a string: the model's own ``device`` when it has one (what
    its runner resolved), else ``spec``, whose ``auto`` is ``cuda`` when torch is loaded
    and sees a GPU, else ``cpu``. Imports nothing: a process that never loaded torch has
    no torch threads to set.

    Args:
        spec: the device setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
        model: the built model, if any.
    """
    own = getattr(model, "device", None)
    if own is not None:
        return str(own)
    if spec != "auto":
        return spec
    torch = sys.modules.get("torch")
    return "cuda" if torch is not None and torch.cuda.is_available() else "cpu"


def runner_device(spec: str, *, load_torch: bool) -> str:
    """The device a runner is offered: ``spec`` with ``auto`` resolved (``cuda`` when torch
    is installed and sees a GPU, else ``cpu``), so that a user's runner can pass it
    straight to ``.to(device)`` (torch knows no ``auto``).

    Args:
        spec: the device setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
        load_torch: import torch to ask it, where it is installed and not loaded yet (a
            runner that names ``device`` will use it); else ``auto`` stays ``auto`` until
            torch is loaded (a runner taking only ``**options`` may never need it).
    """
    if spec != "auto":
        return spec
    if "torch" not in sys.modules:
        if not load_torch:
            return spec
        if importlib.util.find_spec("torch") is None:
            return "cpu"  # without torch, no GPU this process could drive
        importlib.import_module("torch")
    return resolved_device(spec)
