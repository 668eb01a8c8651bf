"""Building a stage's model once, as the worker's settings ask."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pipelines.errors import ConfigError
from pipelines.model import Model
from pipelines.stages import Stage
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)
_LOAD_LOCK = threading.Lock()


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    try:
        import torch
    except ImportError:  # a framework-free runner: nothing to set
        return
    torch.set_num_threads(threads)


def build_model(stage: Stage, settings: WorkerSettings) -> Model:
    """Load the stage's model once, as the settings ask (runs in a thread).

    Args:
        stage: the stage to serve.
        settings: the worker's settings (profile, overrides, device, dtype, threads).

    Raises:
        ConfigError: the runner cannot be imported or does not return a model.
    """
    factory = stage.factory(settings.model_profile)
    options: dict[str, Any] = {
        "model": settings.models.get(stage.name, stage.model_for(settings.model_profile)),
        "device": settings.device,
        "dtype": settings.dtype,
        "cache_dir": settings.cache_dir,
        **stage.options,
    }
    # transformers builds models under a process-wide "meta device" context, which two
    # threads loading at once corrupt; one process may host several stages, so loads queue.
    with _LOAD_LOCK:
        _set_threads(settings.threads)
        model = factory(**options)
    if not callable(getattr(model, "predict", None)):
        raise ConfigError(
            f"stage {stage.name!r}: runner built {type(model).__name__}, no predict()"
        )
    logger.info("stage %s: model %s ready", stage.name, options["model"] or type(model).__name__)
    return model
