"""``conveyor deploy compose|k8s``: deploy files written from the pipelines served.

What is deployed comes from the registry (``--app``/``CONVEYOR_APP``, ``--pipelines``) and
its stages' own asks (:class:`~pipelines.stages.Stage`: ``gpus``, ``threads``,
``memory_mb``, ``replicas``, ``max_batch_size``), after ``CONVEYOR_RESOURCES``:

- **Workers**: one per model stage (each scales on its own backlog, so no two model
  stages share a process here, unlike ``up``'s :func:`~conveyor.placement.worker_groups`),
  and one per pipeline for its light function stages. Each is a compose service and a
  Kubernetes Deployment with a KEDA ScaledObject on the streams of every stage it serves.
- **Images**: a user's app gets its own image, built from its folder with nothing
  published by us (:mod:`conveyor.deploy.image`: conveyor's wheel, a pinned base, an
  ignore file, the stages' model weights); the built-ins run conveyor's own. Every image
  name conveyor builds carries the registry prefix (``--registry``/``CONVEYOR_REGISTRY``);
  Redis keeps Docker Hub's.

The shipped ``deploy/`` folder is this module's output for the built-in pipelines
(:func:`write_shipped`, ``python -m conveyor.deploy``); a test fails when it drifts.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import Field

from conveyor.deploy.names import VARIANT, WORKER, assign, functions_key
from conveyor.deploy.weights import Weights, weights
from conveyor.placement import PlacementSettings, worker_groups
from pipelines.errors import ConfigError
from pipelines.registry import Registry, load_registry

REDIS_FILES = ("redis.conf", "users.acl", "render-acl.sh")
"""What the Redis service reads beside the compose file (and the ConfigMap holds)."""

SHIPPED_PIPELINES = "embed,sentiment,ner,summarize,generate,wiki-summary"
"""What the shipped deploy/ serves."""

PYTHON_IMAGE = "python:3.12-slim-bookworm"
"""An app's CPU image's base: Python 3.12 on Debian 12 (compose's build arg PYTHON_IMAGE,
from ``DIR/.env``, pins it by digest)."""

CUDA_IMAGE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
"""An app's CUDA image's base (its python3 is 3.12 too; build arg CUDA_IMAGE)."""

SHIPPED_GPU_VARIANTS = ("generate",)
"""Stages the shipped deploy/ also offers on a GPU (compose profile ``gpu``, k8s optional/)."""


class DeploySettings(PlacementSettings):
    """What ``conveyor deploy`` reads: the workers' placement settings, plus:

    Attributes:
        registry: prefix of every image name conveyor builds (``ghcr.io/me/``).
    """

    registry: str = Field(default="", max_length=200, pattern=r"^$|^[A-Za-z0-9._:/-]+/$")


@dataclass(frozen=True)
class Build:
    """How an image is built.

    Attributes:
        context: the build context, relative to the compose file's folder.
        dockerfile: the Dockerfile, relative to the context.
        args: build arguments.
    """

    context: str
    dockerfile: str
    args: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Image:
    """An image the gateway or workers run.

    Attributes:
        name: its full name (registry prefix included).
        variable: the compose variable that overrides it.
        build: how compose builds it.
    """

    name: str
    variable: str
    build: Build


@dataclass(frozen=True)
class Worker:
    """A worker service / Deployment.

    Attributes:
        base: its own part of its names (:mod:`conveyor.deploy.names`): read from its
            stage's name, or its pipeline's for the function stages; a GPU variant shares
            its CPU worker's.
        stages: the stages it serves.
        targets: each stage's KEDA target, entries per worker (``max_batch_size`` x
            ``max_concurrent_batches``).
        gpus: whole GPUs per process (its stages' largest share, rounded up).
        threads: torch threads per process (= its CPU limit).
        memory_mb: what it asks (its stages' largest ``memory_mb``).
        replicas: processes it keeps at least (its stages' largest ``replicas``).
        light: the function stages' worker.
        variant: "" or "gpu" (an optional GPU copy of a CPU worker).
        labels: what tells its stages' KEDA triggers apart (a step's name each, for the
            function stages), empty for one stage.
    """

    base: str
    stages: tuple[str, ...]
    targets: tuple[int, ...]
    gpus: int
    threads: int
    memory_mb: int
    replicas: int
    light: bool
    variant: str = ""
    labels: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The compose service and the Kubernetes objects: ``worker-<base>[-gpu]``."""
        return self.cpu_name + (VARIANT if self.variant else "")

    @property
    def cpu_name(self) -> str:
        """The name of the CPU worker (itself, or the one a variant is a copy of)."""
        return WORKER + self.base

    @property
    def spec(self) -> str:
        """What ``conveyor worker`` is given."""
        return ",".join(self.stages)

    @property
    def drain_s(self) -> int:
        """Seconds a stopping worker gets to finish its batches (a model's run longer)."""
        return 30 if self.light else 60


@dataclass(frozen=True)
class Plan:
    """Everything the writers need.

    Attributes:
        app: ``module:attr`` of the user's pipelines, None for the built-ins.
        pipelines: the pipelines served, comma-separated.
        workers: the worker services, GPU variants last.
        cpu_image: the image of the gateway and the CPU workers.
        cuda_image: the image of the GPU workers.
        namespace: the key namespace (``CONVEYOR_NAMESPACE``).
        partitions: ``CONVEYOR_PARTITIONS`` (KEDA watches every partition's streams).
        cluster: the Redis is a cluster (KEDA's cluster triggers).
        redis_url: an external Redis (k8s), None for the bundled one.
        shipped: the built-ins' own deploy/ (its comments and paths).
        requirements: the app's folder has a requirements.txt (its image installs it).
        out_in_context: the deploy folder, relative to the app's folder (the build
            context), POSIX; "" when they are one folder.
        data_dir: ``conveyor up``'s data folder relative to the app's folder, if inside it.
        weights: the model weights the app's image brings.
    """

    app: str | None
    pipelines: str
    workers: tuple[Worker, ...]
    cpu_image: Image
    cuda_image: Image
    namespace: str = "conveyor"
    partitions: int = 1
    cluster: bool = False
    redis_url: str | None = None
    shipped: bool = False
    requirements: bool = False
    out_in_context: str = ""
    data_dir: str = ""
    weights: Weights = field(default_factory=Weights)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "app"


def _workers(
    registry: Registry, settings: DeploySettings, variants: tuple[str, ...]
) -> list[Worker]:
    placed = settings.model_copy(update={"share_models": False})
    pipeline_of = {  # a function stage's own pipeline (whose name may hold dots)
        s.name: p.name
        for p in registry.pipelines.values()
        for s in p.stages()
        if s.kind == "function"
    }
    drafts: dict[str, Worker] = {}  # by the key its name is read from; named below
    for group in worker_groups(registry, None, placed):
        stages = [registry.stage(s).with_resources(settings.resources.get(s)) for s in group.stages]
        by_key: dict[str, list[str]] = {}
        for s in stages:  # function stages: one worker per pipeline
            key = functions_key(pipeline_of[s.name]) if group.light else s.name
            by_key.setdefault(key, []).append(s.name)
        for key, names in by_key.items():
            own = [s for s in stages if s.name in names]
            memory = max((s.memory_mb or 0 for s in own), default=0)
            threads = group.threads or settings.threads or (1 if group.light else 2)
            drafts[key] = Worker(
                base="",
                stages=tuple(names),
                targets=tuple(s.max_batch_size * settings.max_concurrent_batches for s in own),
                gpus=math.ceil(max(s.gpus for s in own)),
                threads=threads,
                memory_mb=memory or (512 if group.light else 1024),
                replicas=max(s.replicas for s in own),
                light=group.light,
            )
    copied: list[str] = []
    for stage in variants:
        alone = next((k for k, w in drafts.items() if w.stages == (stage,)), None)
        if alone is None:
            raise ConfigError(f"no worker serves {stage!r} alone to give a GPU variant")
        copied.append(alone)
    bases = assign({key: key for key in drafts}, copied)
    out = [replace(w, base=bases[key], labels=_labels(w, pipeline_of)) for key, w in drafts.items()]
    for key in copied:
        cpu = drafts[key]
        out.append(
            replace(
                cpu,
                base=bases[key],  # its CPU worker's name, and -gpu
                gpus=max(1, cpu.gpus),
                threads=1,  # the GPU does the work; one core feeds it
                light=False,
                variant="gpu",
            )
        )
    return out


def _labels(worker: Worker, pipeline_of: dict[str, str]) -> tuple[str, ...]:
    """Its triggers' labels, read from each function stage's step name."""
    if len(worker.stages) < 2:
        return ()
    pipeline = pipeline_of[worker.stages[0]]
    steps = {s: s.removeprefix(pipeline + ".") for s in worker.stages}
    labels = assign(steps, prefix="lag-")
    return tuple(labels[s] for s in worker.stages)


def plan(
    app: str | None,
    pipelines: str | None,
    out: Path,
    *,
    registry: str | None = None,
    redis_url: str | None = None,
    gpu_variants: tuple[str, ...] = (),
    app_dir: Path | None = None,
    shipped: bool = False,
) -> Plan:
    """What to deploy: the served pipelines' workers and the images they run.

    Args:
        app: ``module:attr`` of the user's pipelines (None: the built-ins).
        pipelines: comma-separated subset to serve (None: all of the app's).
        out: the folder the files go to (image build paths are relative to it).
        registry: image name prefix (None: ``CONVEYOR_REGISTRY``).
        redis_url: an external Redis for Kubernetes instead of the bundled one.
        gpu_variants: stages that also get an optional GPU worker.
        app_dir: the app's folder, its image's build context (default: the current one).
        shipped: the built-ins' deploy/ of this repository (its comments and file names).

    Raises:
        ConfigError: the app or a pipeline cannot be loaded, or a setting is invalid.
    """
    from pipelines.settings import load_settings

    settings = load_settings(DeploySettings)
    prefix = settings.registry if registry is None else registry
    if prefix and not re.fullmatch(r"[A-Za-z0-9._:/-]+/", prefix):
        raise ConfigError(f"--registry {prefix!r}: a prefix like ghcr.io/me/ (ending in /)")
    reg = load_registry(app, pipelines)
    workers = _workers(reg, settings, gpu_variants)
    served = ",".join(reg.pipelines)
    context = (app_dir or Path.cwd()).resolve()
    out_in_context = data_dir = ""
    app_weights = Weights()
    if app is None:
        cpu = Image(f"{prefix}conveyor:cpu", "CONVEYOR_IMAGE", Build("..", "deploy/Dockerfile"))
        cuda = Image(
            f"{prefix}conveyor:cuda", "CONVEYOR_CUDA_IMAGE", Build("..", "deploy/Dockerfile.cuda")
        )
    else:
        out_in_context = _inside(out.resolve(), context, "--out")
        data_dir = _data_dir(context)
        app_weights = weights(reg, context)
        rel_context = os.path.relpath(context, out.resolve())
        dockerfile = os.path.relpath(out.resolve() / "Dockerfile", context)
        name = _slug(app.partition(":")[0].rpartition(".")[2])
        base = (("PYTHON_IMAGE", f"${{PYTHON_IMAGE:-{PYTHON_IMAGE}}}"),)
        cpu = Image(f"{prefix}{name}:cpu", "CONVEYOR_IMAGE", Build(rel_context, dockerfile, base))
        cuda_base = (("CUDA_IMAGE", f"${{CUDA_IMAGE:-{CUDA_IMAGE}}}"),)
        cuda = Image(
            f"{prefix}{name}:cuda",
            "CONVEYOR_CUDA_IMAGE",
            Build(rel_context, dockerfile + ".cuda", cuda_base),
        )
    return Plan(
        app=app,
        pipelines=served,
        workers=tuple(workers),
        cpu_image=cpu,
        cuda_image=cuda,
        namespace=settings.namespace,
        partitions=settings.partitions,
        cluster=settings.cluster,
        redis_url=redis_url,
        shipped=shipped,
        requirements=app is not None and (context / "requirements.txt").is_file(),
        out_in_context=out_in_context,
        data_dir=data_dir,
        weights=app_weights,
    )


def _inside(path: Path, context: Path, what: str) -> str:
    """``path`` relative to ``context`` (POSIX, "" for itself).

    Raises:
        ConfigError: ``path`` is outside it (the image's build context).
    """
    try:
        rel = path.relative_to(context).as_posix()
    except ValueError:
        raise ConfigError(
            f"{what} {str(path)!r} is outside the app's folder {str(context)!r}: the image is "
            "built from that folder and needs conveyor's wheel from the deploy folder, so "
            "write it under the app's folder (e.g. --out deploy-out)"
        ) from None
    return "" if rel == "." else rel


def _data_dir(context: Path) -> str:
    """``conveyor up``'s data folder (``CONVEYOR_DATA_DIR``) relative to ``context``, if
    it is inside it (its Redis data must stay out of the image)."""
    from conveyor.data import DataSettings
    from pipelines.settings import load_settings

    folder = (context / load_settings(DataSettings).data_dir).resolve()
    try:
        rel = folder.relative_to(context).as_posix()
    except ValueError:
        return ""
    return "" if rel == "." else rel


def redis_file(name: str) -> str:
    """The text of one of :data:`REDIS_FILES` (their one source, in this package)."""
    return (Path(__file__).with_name("redis") / name).read_text()


def write(files: dict[str, str], out: Path) -> list[Path]:
    """Write ``files`` (relative path -> text) under ``out``; shell scripts executable."""
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)
        written.append(path)
    return written


def shipped_files(root: Path) -> dict[str, str]:
    """The shipped deploy/ folder's generated files (relative to ``root``, the repo)."""
    from conveyor.deploy import compose, k8s

    the_plan = plan(
        None,
        SHIPPED_PIPELINES,
        root / "deploy",
        registry="",
        gpu_variants=SHIPPED_GPU_VARIANTS,
        shipped=True,
    )
    from conveyor.deploy.image import HEALTHCHECK

    files = {f"deploy/{k}": v for k, v in compose.files(the_plan).items()}
    files["deploy/healthcheck.sh"] = HEALTHCHECK
    files |= {f"deploy/k8s/{k}": v for k, v in k8s.files(the_plan).items()}
    return files


def write_shipped(root: Path) -> list[Path]:
    """Regenerate the shipped deploy/ of the repository at ``root``."""
    return write(shipped_files(root), root)
