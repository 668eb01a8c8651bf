"""Where ``conveyor up``'s worker processes run: which stages share a process, which GPUs
each process sees, how many torch threads it runs.

- **Groups** (:func:`worker_groups`): model stages on the same weights on the same device
  (the same model under the served profile, after ``CONVEYOR_MODELS``) share one process,
  hence one copy of the model (the built-in embed, sentiment and summarize all sit on
  MiniLM); so do the model stages that name no model and ask no resources (the toys:
  nothing to keep apart); each other model stage gets its own; the light function stages
  share one. ``CONVEYOR_SHARE_MODELS=false`` gives every model stage its own process.
- **GPUs** (:class:`GpuPool`): each process reserves its group's GPU share (the most any
  of its stages asks, :attr:`~pipelines.stages.Stage.gpus`) on the visible GPUs, packed
  first-fit, the biggest shares first: a fraction on the first GPU with that much free, a
  whole number of GPUs on that many untouched ones. It is started with
  ``CUDA_VISIBLE_DEVICES`` naming them, so its model's ``cuda`` is its own GPU. A model
  process reserving nothing is still spread over the GPUs (the one with the most free,
  then the fewest processes), unless its device is ``cpu``. Shares that do not fit stop
  ``up`` before anything starts (:class:`PlacementError`).
- **Threads** (:func:`workers.threads.torch_threads`, the rule a bare worker and the
  bench follow too): a process's torch threads are its stages' ``threads`` when one says,
  else ``CONVEYOR_THREADS`` when set, else on a GPU (placed on one, or its device
  ``cuda``) ``CONVEYOR_CUDA_THREADS`` (1), else the cores this process may use divided
  among the model processes (at most ``max_workers`` per group under ``--autoscale``), at
  least 1: the model processes together never run more torch threads than there are
  cores.

The visible GPUs are ``CONVEYOR_GPUS`` (a count, simulated: for dry runs and tests on a
host without them), else ``CUDA_VISIBLE_DEVICES`` when set, else what ``nvidia-smi -L``
lists (none without it): torch is not imported here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import Field

from pipelines.errors import ConfigError
from pipelines.registry import Registry
from pipelines.stages import Stage
from workers.settings import WorkerSettings
from workers.threads import CUDA_THREADS, torch_threads

UNITS = 1000
"""A GPU, in shares of a thousandth: shares add up exactly (ten 0.1s fill one GPU)."""


class PlacementError(ConfigError):
    """The stages' GPU shares do not fit on the visible GPUs."""


class PlacementSettings(WorkerSettings):
    """What ``up`` reads to place its workers: the workers' own settings (``resources``,
    ``models``, ``model_profile``, ``device``, ``threads``), plus:

    Attributes:
        gpus: simulate this many GPUs instead of looking (dry runs, tests).
        share_models: host the model stages on the same weights in one process.
    """

    gpus: int | None = Field(default=None, ge=0, le=1024)
    share_models: bool = True


@dataclass(frozen=True)
class Group:
    """Stages served together by each of ``replicas`` worker processes.

    Attributes:
        stages: the stages' names.
        replicas: worker processes of it.
        gpus: the GPU share each process reserves.
        threads: torch threads each process runs (None: :class:`Placer` decides).
        light: the function stages' group: not spread over the GPUs nor counted among
            the model processes dividing the cores; it runs with the threads its stages
            ask (if any).
        cpu: its device is ``cpu``: it gets no GPU.
        cuda: its device is ``cuda`` or ``cuda:N``: its models run on a GPU even where
            none is visible to ``up`` (the few threads of :mod:`workers.threads`).
    """

    stages: tuple[str, ...]
    replicas: int = 1
    gpus: float = 0
    threads: int | None = None
    light: bool = False
    cpu: bool = False
    cuda: bool = False

    @property
    def name(self) -> str:
        """What ``python -m workers`` is given: the stages, comma-separated."""
        return ",".join(self.stages)


def _group(stages: list[Stage], replicas: int | None, device: str, light: bool) -> Group:
    threads = [s.threads for s in stages if s.threads]
    return Group(
        tuple(s.name for s in stages),
        replicas or max(s.replicas for s in stages),
        gpus=max(s.gpus for s in stages),
        threads=max(threads) if threads else None,
        light=light,
        cpu=device == "cpu",
        cuda=device.startswith("cuda"),
    )


def _asks(stage: Stage) -> bool:
    return bool(stage.gpus or stage.threads or stage.device)


def worker_groups(
    registry: Registry, replicas: int | None, settings: PlacementSettings
) -> list[Group]:
    """The worker processes ``up`` starts, as groups of stages (see the module's docstring).

    Model stages naming the same model on the same device share a group (one copy of the
    weights); so do those naming none and asking no resources (nothing to keep apart: the
    toy stages), unless ``share_models`` is off; the function stages share one.

    Args:
        registry: the pipelines served.
        replicas: processes of each group (None: the most any of its stages asks, one for
            the function stages).
        settings: the resources, models and device settings.

    Raises:
        ConfigError: ``CONVEYOR_RESOURCES`` names a stage not served.
    """
    unknown = sorted(set(settings.resources) - set(registry.stages))
    if unknown:
        raise ConfigError(
            f"CONVEYOR_RESOURCES names {', '.join(map(repr, unknown))}, which no served "
            f"pipeline has; stages: {', '.join(registry.stages)}"
        )
    stages = [s.with_resources(settings.resources.get(s.name)) for s in registry.stages.values()]
    shared: dict[tuple[str, str, str], list[Stage]] = {}  # (model, device, name or "")
    for s in stages:
        if s.kind != "model":
            continue
        spec = settings.models.get(s.name, s.model_for(settings.model_profile))
        alone = s.name if not settings.share_models or (not spec and _asks(s)) else ""
        shared.setdefault((spec, s.device or settings.device, alone), []).append(s)
    groups = [_group(members, replicas, k[1], False) for k, members in shared.items()]
    functions = [s for s in stages if s.kind == "function"]
    if functions:
        groups.append(_group(functions, replicas or 1, settings.device, True))
    return groups


def visible_gpus(settings: PlacementSettings, environ: dict[str, str]) -> list[str]:
    """The GPUs ``up`` places on, as ``CUDA_VISIBLE_DEVICES`` names them (see the module's
    docstring).

    Args:
        settings: ``gpus`` simulates that many.
        environ: ``up``'s environment (its ``CUDA_VISIBLE_DEVICES``).
    """
    if settings.gpus is not None:
        return [str(i) for i in range(settings.gpus)]
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(listed.stdout.splitlines()) if line.startswith("GPU")]


@dataclass
class GpuPool:
    """The visible GPUs and what is reserved on each.

    Args:
        ids: the GPUs, as ``CUDA_VISIBLE_DEVICES`` names them.
    """

    ids: list[str]
    free: list[int] = field(init=False)  # UNITS each, less what is reserved
    procs: list[int] = field(init=False)  # processes placed on each

    def __post_init__(self) -> None:
        self.free = [UNITS] * len(self.ids)
        self.procs = [0] * len(self.ids)

    def take(self, gpus: float) -> tuple[int, ...] | None:
        """Reserve ``gpus`` (None when it does not fit): the GPUs' indices.

        Args:
            gpus: a share (0 < gpus <= 1), a whole number of GPUs, or 0 (nothing
                reserved: the least loaded GPU).
        """
        need = round(gpus * UNITS)
        n = len(self.ids)
        if not n:
            return None
        if need == 0:
            taken: tuple[int, ...] = (min(range(n), key=lambda i: (-self.free[i], self.procs[i])),)
        elif need <= UNITS:
            taken = tuple([i for i in range(n) if self.free[i] >= need][:1])
        else:
            whole = [i for i in range(n) if self.free[i] == UNITS]
            taken = tuple(whole[: need // UNITS]) if len(whole) >= need // UNITS else ()
        if not taken:
            return None
        for i in taken:
            self.free[i] -= min(need, UNITS)
            self.procs[i] += 1
        return taken

    def give(self, taken: tuple[int, ...], gpus: float) -> None:
        """Release what :meth:`take` reserved.

        Args:
            taken: the indices it returned.
            gpus: the share it was given.
        """
        for i in taken:
            self.free[i] += min(round(gpus * UNITS), UNITS)
            self.procs[i] -= 1

    def describe(self) -> str:
        """Each GPU's free share, e.g. ``GPU 0: 0.5 free, GPU 1: 1 free``."""
        pairs = zip(self.ids, self.free, strict=True)
        return ", ".join(f"GPU {d}: {f / UNITS:g} free" for d, f in pairs)


@dataclass(frozen=True)
class Placed:
    """One worker process of a group, placed.

    Attributes:
        group: its stages.
        gpus: indices into the pool's GPUs (empty: none).
        devices: those GPUs as ``CUDA_VISIBLE_DEVICES`` names them.
        threads: its torch threads (None: ``CONVEYOR_THREADS`` as set, or torch's default).
    """

    group: Group
    gpus: tuple[int, ...]
    devices: tuple[str, ...]
    threads: int | None

    def env(self) -> dict[str, str]:
        """What its environment adds to ``up``'s."""
        env = {"CUDA_VISIBLE_DEVICES": ",".join(self.devices)} if self.gpus else {}
        return env | ({"CONVEYOR_THREADS": str(self.threads)} if self.threads else {})

    def describe(self) -> str:
        """One line: where it runs."""
        where = "cpu"
        if self.devices:
            share = f" ({self.group.gpus:g} reserved)" if self.group.gpus else ""
            where = f"GPU {','.join(self.devices)}{share}"
        threads = f", {self.threads} torch thread(s)" if self.threads else ""
        return f"{where}{threads}"


@dataclass
class Placer:
    """Places ``up``'s worker processes: the GPUs shared out, the cores divided.

    Args:
        pool: the visible GPUs.
        cores: the cores this process may run on.
        model_processes: the model processes ``up`` may run at once (cores are divided
            among them).
        threads: ``CONVEYOR_THREADS`` as set (None: unset).
        cuda_threads: ``CONVEYOR_CUDA_THREADS``: the threads of a process on a GPU.
    """

    pool: GpuPool
    cores: int
    model_processes: int
    threads: int | None = None
    cuda_threads: int = CUDA_THREADS

    def threads_for(self, group: Group, on_gpu: bool = False) -> int | None:
        """The torch threads of one of ``group``'s processes (the light group's: what its
        stages ask, if any).

        Args:
            group: its stages.
            on_gpu: it was given a GPU.
        """
        if group.light:
            return group.threads
        return torch_threads(
            "cuda" if on_gpu or group.cuda else "cpu",
            asked=group.threads,
            setting=self.threads,
            cuda_threads=self.cuda_threads,
            cores=self.cores,
            processes=self.model_processes,
        )

    def one(self, group: Group) -> Placed:
        """Place one more process of ``group``; raises :class:`PlacementError` when its
        share does not fit."""
        taken: tuple[int, ...] = ()
        if group.gpus or (self.pool.ids and not group.light and not group.cpu):
            got = self.pool.take(group.gpus)
            if got is None:
                raise PlacementError(self._refusal(group))
            taken = got
        devices = tuple(self.pool.ids[i] for i in taken)
        return Placed(group, taken, devices, self.threads_for(group, bool(taken)))

    def all(self, groups: Iterable[Group]) -> list[Placed]:
        """Place every replica of ``groups`` (the biggest shares first: first-fit
        decreasing), in the groups' order; raises :class:`PlacementError` naming the
        first that does not fit (nothing stays reserved then)."""
        wanted = [g for g in groups for _ in range(g.replicas)]
        for g in wanted:
            if g.cpu and g.gpus:
                raise PlacementError(f"stage(s) {g.name}: device cpu, but {g.gpus:g} GPU asked")
        order = sorted(range(len(wanted)), key=lambda i: -wanted[i].gpus)
        placed: dict[int, Placed] = {}
        try:
            for i in order:
                placed[i] = self.one(wanted[i])
        except PlacementError as exc:
            for p in placed.values():
                self.release(p)
            asked = sum(g.gpus for g in wanted)
            raise PlacementError(f"{exc}; {asked:g} GPU asked in all ({_shares(wanted)})") from None
        return [placed[i] for i in range(len(wanted))]

    def release(self, placed: Placed) -> None:
        """Give back what :meth:`one` reserved for a process that has exited."""
        if placed.gpus:
            self.pool.give(placed.gpus, placed.group.gpus)

    def describe(self) -> str:
        """One line: the GPUs and cores, and how the cores are divided."""
        gpus = f"GPU(s) {','.join(self.pool.ids)}" if self.pool.ids else "no GPU"
        if self.threads:
            split = f"CONVEYOR_THREADS={self.threads} per model process"
        else:
            split = f"{self.cores} core(s) / {self.model_processes} model process(es)"
        on_gpu = "" if self.threads else f"; {self.cuda_threads} on a GPU"
        return f"{gpus}; {self.cores} core(s); torch threads: {split}{on_gpu} unless a stage says"

    def _refusal(self, group: Group) -> str:
        if not self.pool.ids:
            return (
                f"stage(s) {group.name} ask {group.gpus:g} GPU per worker, but no GPU is "
                "visible (none listed by nvidia-smi or CUDA_VISIBLE_DEVICES; "
                "CONVEYOR_GPUS=N simulates N)"
            )
        return (
            f"stage(s) {group.name}: a worker asking {group.gpus:g} GPU does not fit on "
            f"the {len(self.pool.ids)} visible GPU(s) ({self.pool.describe()})"
        )


def _shares(wanted: list[Group]) -> str:
    counts: dict[str, tuple[int, float]] = {}
    for g in wanted:
        if g.gpus:
            n, share = counts.get(g.name, (0, g.gpus))
            counts[g.name] = (n + 1, share)
    return ", ".join(f"{name} {n}x{share:g}" for name, (n, share) in counts.items())


def host_placer(
    settings: PlacementSettings, environ: dict[str, str], model_processes: int
) -> Placer:
    """The :class:`Placer` of this host (see the module's docstring).

    Args:
        settings: ``gpus``, ``threads`` and ``cuda_threads``.
        environ: ``up``'s environment.
        model_processes: the model processes ``up`` may run at once.
    """
    return Placer(
        GpuPool(visible_gpus(settings, environ)),
        len(os.sched_getaffinity(0)),
        model_processes,
        settings.threads,
        settings.cuda_threads,
    )
