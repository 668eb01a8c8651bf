"""Building a stage's model, and the runners that need no ML framework."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel

from pipelines.errors import ConfigError
from pipelines.model import Item, Model, Result
from pipelines.stages import Stage
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)
_LOAD_LOCK = threading.Lock()


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


class Adder:
    """Adds one to ``value`` (a batched model without ML, for the built-in pipelines)."""

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """``value + 1`` for each item."""
        return [{"value": item["value"] + 1} for item in items]


class Multiplier:
    """Doubles ``value`` (a batched model without ML, for the built-in pipelines)."""

    def __init__(self, **options: Any) -> None:
        del options

    def predict(self, items: list[Item]) -> list[Result]:
        """``value * 2`` for each item."""
        return [{"value": item["value"] * 2} for item in items]


class FunctionRunner:
    """Runs a function stage: ``fn(item)`` for every item of a batch, concurrently.

    Sync functions run on a thread pool, async ones on an event loop owned by the model
    thread; at most ``concurrency`` at a time either way. An item whose call raises
    gets its exception in its place, so it fails alone.

    Args:
        fn: ``fn(dict) -> dict`` (or a pydantic model), sync or async.
        concurrency: calls in flight at once.
        options: the common runner arguments, unused.
    """

    def __init__(self, *, fn: Callable[[Item], Any], concurrency: int = 16, **options: Any) -> None:
        del options
        self.fn = fn
        self.concurrency = concurrency
        self.is_async = inspect.iscoroutinefunction(fn)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="fn")
        self._loop = asyncio.new_event_loop() if self.is_async else None

    def predict(self, items: list[Item]) -> list[Result | BaseException]:
        """Call the function on each item; failures are returned in place."""
        if self._loop is not None:
            return self._loop.run_until_complete(self._gather(items))
        futures = [self._pool.submit(self._call_sync, item) for item in items]
        return [f.result() for f in futures]

    def _call_sync(self, item: Item) -> Result | BaseException:
        try:
            return _as_dict(self.fn(item))
        except Exception as exc:
            return exc

    async def _gather(self, items: list[Item]) -> list[Result | BaseException]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(item: Item) -> Result | BaseException:
            async with gate:
                try:
                    return _as_dict(await self.fn(item))
                except Exception as exc:
                    return exc

        return list(await asyncio.gather(*(one(item) for item in items)))


def _as_dict(value: Any) -> Result:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    result: Result = value  # checked to be a JSON object by the worker
    return result


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
