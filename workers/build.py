"""Building a stage's model once, as the worker's settings ask.

A runner needs no ceremony: it is given only the options its constructor takes
(:func:`accepted`), and a constructor that raises ends the worker with one line naming
the stage and the runner (:class:`~pipelines.errors.ConfigError`), not a traceback.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pipelines.errors import ConfigError, one_line
from pipelines.model import Model
from pipelines.stages import Stage
from runtime.logs import adopt_library_loggers
from workers.models.buckets import Bucketed, CannotCapture, summary
from workers.settings import WorkerSettings
from workers.threads import (
    host_share,
    on_cpu,
    resolved_device,
    runner_device,
    torch_threads,
)

logger = logging.getLogger(__name__)
_LOAD_LOCK = threading.Lock()


def _set_threads(stage: Stage, model: object, device: str, settings: WorkerSettings) -> None:
    torch = sys.modules.get("torch")
    # Only once a model imported torch: a framework-free runner (a function step, a toy)
    # must not pay its ~200 MB for nothing.
    if torch is None:
        return
    where = resolved_device(device, model)
    if where == "cpu":
        on_cpu(stage.name)
    share = host_share()  # a worker started by hand beside others: its share of the cores
    threads = torch_threads(
        where,
        setting=settings.threads,
        cuda_threads=settings.cuda_threads,
        cores=share.cores if share else None,
        processes=share.processes if share else 1,
    )
    if threads is not None:
        torch.set_num_threads(threads)
    logger.info(
        "stage %s: on %s, %d torch thread(s)%s",
        stage.name,
        where,
        torch.get_num_threads(),
        "" if threads is not None else " (torch's default)",
    )


def process_threads(stages: list[Stage], settings: WorkerSettings) -> int | None:
    """The torch threads of a process serving ``stages``: the most any of them asks for
    (:attr:`Stage.threads`, after ``CONVEYOR_RESOURCES``), else ``CONVEYOR_THREADS``
    (None: the device decides once the model loads, :mod:`workers.threads`). torch has one
    intra-op pool per process, so stages sharing a process share it.

    Args:
        stages: the stages the process serves, with their resources applied.
        settings: the worker's settings.
    """
    return max((s.threads for s in stages if s.threads), default=settings.threads)


def accepted(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The ``offered`` options ``factory`` takes: those its signature names (as keywords),
    all of them if it takes ``**kwargs`` or its signature cannot be read (a builtin).

    A plain class (``class WordCounter: def predict(self, items): ...``) takes none, and
    is built as ``WordCounter()``.

    Args:
        factory: the runner (a class or a function).
        offered: the options to choose from.
    """
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return offered
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return offered
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in params if p.kind in keywords}
    return {k: v for k, v in offered.items() if k in names}


def _names_device(factory: Callable[..., Any]) -> bool:
    """Whether ``factory``'s signature names a ``device`` parameter (not only ``**``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    param = params.get("device")
    return param is not None and param.kind is not inspect.Parameter.VAR_KEYWORD


def build_model(stage: Stage, settings: WorkerSettings) -> Model:
    """Load the stage's model once, as the settings ask (runs in a thread).

    The runner is offered ``model``, ``device`` (``auto`` already resolved to ``cuda`` or
    ``cpu``: :func:`~workers.threads.runner_device`), ``dtype`` and ``cache_dir`` and called
    with those its signature takes (:func:`accepted`), and every one of the stage's own
    ``options``.

    Args:
        stage: the stage to serve.
        settings: the worker's settings (profile, overrides, device, dtype, threads); the
            stage's own ``device`` wins over the settings' (``threads`` is the process's:
            :func:`process_threads`).

    Raises:
        ConfigError: the runner cannot be imported, its constructor raised (one line
            naming the stage, the runner and the model it was to load), or it does not
            return a model.
    """
    factory = stage.factory(settings.model_profile)
    adopt_library_loggers()  # transformers, if the runner's module imported it
    standard: dict[str, Any] = {
        "model": settings.models.get(stage.name, stage.model_for(settings.model_profile)),
        "device": stage.device or settings.device,
        "dtype": settings.dtype,
        "cache_dir": settings.cache_dir,
    }
    if "device" in accepted(factory, standard):
        # torch knows no "auto": a runner gets a device it can hand to `.to(device)`. One
        # that names `device` loads torch to ask it; one that takes only **options (a toy)
        # is told only once torch is loaded, so it does not pay for torch for nothing.
        standard["device"] = runner_device(standard["device"], load_torch=_names_device(factory))
    options = accepted(factory, standard) | dict(stage.options)
    # transformers builds models under a process-wide "meta device" context, which two
    # threads loading at once corrupt; one process may host several stages, so loads queue.
    with _LOAD_LOCK:
        try:
            model = factory(**options)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(_cannot_build(stage, factory, options, exc)) from exc
        _set_threads(stage, model, standard["device"], settings)
    adopt_library_loggers()  # or if the runner imported it as it loaded
    if not callable(getattr(model, "predict", None)):
        raise ConfigError(
            f"stage {stage.name!r}: runner built {type(model).__name__}, no predict()"
        )
    name = options.get("model") or type(model).__name__
    logger.info("stage %s: model %s ready", stage.name, name)
    return model


def _cannot_build(
    stage: Stage, factory: Callable[..., Any], options: dict[str, Any], exc: Exception
) -> str:
    """The one line a runner's failed constructor ends the worker with."""
    runner = f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', factory)}"
    if options.get("model"):
        # transformers and huggingface_hub raise OSError for a path or id they cannot load.
        hint = "; check its path or hub id (CONVEYOR_MODELS, or the stage's model=)"
        return (
            f"stage {stage.name!r}: cannot load model {options['model']!r} with {runner}: "
            f"{one_line(exc)}{hint if isinstance(exc, OSError) else ''}"
        )
    given = ", ".join(options) or "no arguments"
    return f"stage {stage.name!r}: cannot build {runner} (given {given}): {one_line(exc)}"


def prepare_shapes(model: Model, stage: Stage, settings: WorkerSettings) -> None:
    """Give the model its shape buckets, capture a CUDA graph per bucket where asked, and
    run each bucket once, logging a line for each (runs in the model thread, at load: the
    worker joins its group after it, so no request meets a cold shape). A model without
    buckets (:class:`~workers.models.buckets.Bucketed`) runs its ``warm_paths(max_items)``
    where it has one (a generator's: greedy, sampled, streamed), else is left as it is.

    Graphs that cannot be captured never stop the worker: one line says why, and the
    model runs eager (:mod:`workers.models.graphs`).

    Args:
        model: the stage's built model.
        stage: the stage served (``buckets``, ``bucket_lengths``, ``max_batch_size``).
        settings: the worker's settings (``buckets`` over the stage's, ``cuda_graphs``,
            ``warmup``, ``max_batch_size``).
    """
    max_items = settings.max_batch_size or stage.max_batch_size
    if not isinstance(model, Bucketed):
        if settings.cuda_graphs:
            logger.info("stage %s: no CUDA graphs: its runner has no shape buckets", stage.name)
        warm = getattr(model, "warm_paths", None)
        if settings.warmup and callable(warm):
            # A model without buckets (one that generates) runs each of its paths once
            # instead: the first request would pay for them otherwise (torch's first
            # call of each kernel, the tokenizer's, the sampler's).
            started = time.perf_counter()
            warm(max_items)
            took = time.perf_counter() - started
            logger.info("stage %s: every generation path warmed in %.2fs", stage.name, took)
        return
    enabled = stage.buckets if settings.buckets is None else settings.buckets
    buckets = model.use_buckets(enabled, max_items, stage.bucket_lengths)
    if settings.cuda_graphs:
        _capture_graphs(model, stage)
    if buckets is None:
        return
    shape = f"{len(buckets.rows)} batch sizes x {len(buckets.lengths)} lengths"
    if not settings.warmup:
        logger.info("stage %s: buckets %s, not warmed (warmup off)", stage.name, shape)
        return
    runs = model.warm_up()
    if runs:
        logger.info("stage %s: buckets %s: %s", stage.name, shape, summary(runs))


def _capture_graphs(model: Bucketed, stage: Stage) -> None:
    started = time.perf_counter()
    try:
        captured = model.use_graphs()
    except CannotCapture as exc:
        logger.warning("stage %s: no CUDA graphs, eager forward passes: %s", stage.name, exc)
        return
    logger.info(
        "stage %s: %d CUDA graphs captured (one per bucket) in %.2fs",
        stage.name,
        captured,
        time.perf_counter() - started,
    )
