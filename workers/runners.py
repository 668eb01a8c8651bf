"""Building a stage's model, and the runners that need no ML framework."""

from __future__ import annotations

import logging
from typing import Any

from pipelines.errors import ConfigError
from pipelines.model import Item, Model, Result
from pipelines.stages import Stage
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)


class Echo:
    """Returns each item unchanged: measures serving overhead without a model.

    Args:
        options: accepted and ignored, so it takes the same arguments as every runner.
    """

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """Return the batch as it came."""
        return list(items)


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
    _set_threads(settings.threads)
    factory = stage.factory(settings.model_profile)
    options: dict[str, Any] = {
        "model": settings.models.get(stage.name, stage.model_for(settings.model_profile)),
        "device": settings.device,
        "dtype": settings.dtype,
        "cache_dir": settings.cache_dir,
        **stage.options,
    }
    model = factory(**options)
    if not callable(getattr(model, "predict", None)):
        raise ConfigError(
            f"stage {stage.name!r}: runner built {type(model).__name__}, no predict()"
        )
    logger.info("stage %s: model %s ready", stage.name, options["model"] or type(model).__name__)
    return model
