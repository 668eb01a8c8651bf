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
   them, at least 1. ``up`` knows both for its workers; a worker started by hand
   (``conveyor worker``, ``python -m workers``) counts the other live workers of its host
   that run a model with torch on the CPU, from their heartbeats in Redis
   (:meth:`~pipelines.keys.Keys.cpu_models`, :func:`count_host_workers`, once at start),
   and takes its share, saying so in one line that names ``CONVEYOR_THREADS``; one that
   sees none (alone on its host, or beside processes that never load torch, such as the
   built-in toys', or whose models are on a GPU), or the bench in-process, keeps
   torch's default.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import socket
import sys
from dataclasses import dataclass

from pipelines.settings import CommonSettings
from runtime.redisio import connect
from runtime.status import live_beats

logger = logging.getLogger(__name__)

CUDA_THREADS = 1
"""Intra-op threads of a process whose models run on cuda, unless something says."""


@dataclass(frozen=True)
class HostShare:
    """The cores a worker started by hand divides, and among how many processes.

    Attributes:
        cores: the cores this process may run on.
        processes: the live worker processes of this host, this one included.
    """

    cores: int
    processes: int


_SHARE: list[HostShare] = []
"""This process's share, once :func:`share_host` found other workers (torch's thread
pool is the process's, and so is this)."""

_ON_CPU: set[str] = set()
"""The stages whose models this process runs with torch on the CPU, as their threads were
set (:func:`on_cpu`)."""


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the platform says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _pid_on(consumer: str, host: str) -> int | None:
    """The pid in a consumer name ``host-pid-random`` of ``host`` (None: another host's,
    or a name of another form, ``CONVEYOR_CONSUMER_NAME``)."""
    rest = consumer.removeprefix(f"{host}-")
    if rest == consumer:
        return None
    pid, _, _ = rest.partition("-")
    return int(pid) if pid.isdigit() and len(pid) < 10 else None


async def count_host_workers(settings: CommonSettings, host: str | None = None) -> int:
    """The live worker processes of ``host`` (default: this one) other than this
    process that run a model with torch on the CPU, in ``settings``' namespace: those
    whose beat in :meth:`~pipelines.keys.Keys.cpu_models` has not run out, by pid.

    Args:
        settings: where Redis is, and the namespace.
        host: the host name in the consumer names (default: :func:`socket.gethostname`).

    Raises:
        RedisError, OSError: Redis could not be reached.
    """
    host = host or socket.gethostname()
    client = connect(settings)
    try:
        pids: set[int] = set()
        for name in await live_beats(client, settings.keys.cpu_models()):
            pid = _pid_on(name, host)
            if pid is not None and pid != os.getpid():
                pids.add(pid)
    finally:
        await client.aclose()
    return len(pids)


def share_host(others: int, cores: int | None = None) -> HostShare | None:
    """Take this process's share of the host's cores beside ``others`` live workers (a
    worker with no thread count of its own, at start): one line says it, and names the
    setting that chooses instead; with none, nothing (torch's default stays).

    Args:
        others: the other live worker processes of this host (:func:`count_host_workers`).
        cores: the cores this process may run on (default: :func:`host_cores`).
    """
    _SHARE.clear()
    if others <= 0:
        return None
    share = HostShare(cores or host_cores(), others + 1)
    _SHARE.append(share)
    logger.info(
        "%d other worker process(es) live on this host: a model on cpu here runs %d torch "
        "thread(s), its share of %d core(s) (CONVEYOR_THREADS sets it)",
        others,
        max(1, share.cores // share.processes),
        share.cores,
    )
    return share


def host_share() -> HostShare | None:
    """This process's share of the host's cores (:func:`share_host`), if it took one."""
    return _SHARE[0] if _SHARE else None


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


def on_cpu(stage: str) -> None:
    """Note that ``stage``'s model runs with torch on the CPU in this process (its threads
    were set for it: :func:`workers.build.build_model`)."""
    _ON_CPU.add(stage)


def runs_torch_on_cpu() -> bool:
    """Whether this process runs a model with torch on the CPU: what a worker started by
    hand on the same host counts when it divides the cores (a process that never loads
    torch, such as a toy's or a function step's, or whose models are on cuda, does not)."""
    return bool(_ON_CPU)


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
