"""``python -m workers STAGE[,STAGE...]``: serve stages until SIGTERM or Ctrl-C.

One process usually serves one model stage, or the stages on one model's weights (the
built-in embed, sentiment and summarize: one copy of MiniLM, their batches taking turns in
one model thread); the light function stages of pipelines can share a process. Each stage
keeps its own stream, batch loop and metrics. ``CONVEYOR_RESOURCES`` overrides a stage's
``threads`` and ``device`` here (:class:`~pipelines.stages.Resources`).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import logging
import os
import signal
from collections.abc import MutableMapping

from redis.exceptions import RedisError

from pipelines.registry import load_registry
from pipelines.settings import load_settings
from runtime import tracing
from runtime.exits import exit_on_config_error
from runtime.logs import configure_logging, quiet_model_libraries
from workers.build import process_threads
from workers.partitions import partition_workers
from workers.settings import WorkerSettings
from workers.threads import count_host_workers, share_host

logger = logging.getLogger(__name__)


def configure_openmp(settings: WorkerSettings, environ: MutableMapping[str, str]) -> None:
    """Set how torch's idle OpenMP threads wait (see ``spin_wait`` and
    ``openmp_spin_count`` in :class:`WorkerSettings`); what ``environ`` sets already wins."""
    environ.setdefault("OMP_WAIT_POLICY", "ACTIVE" if settings.spin_wait else "PASSIVE")
    if not settings.spin_wait:
        environ.setdefault("GOMP_SPINCOUNT", str(settings.openmp_spin_count))


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``).

    Loading a model frees as much as it keeps (checkpoint buffers, a dtype's conversion,
    the import machinery); glibc keeps those pages, so without this they stay in the
    worker's RSS for its lifetime (``python -m bench.rss``). Elsewhere than glibc: nothing.
    """
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


async def _serve(stage_names: list[str]) -> None:
    settings = load_settings(WorkerSettings)
    # Read once, when torch loads its OpenMP runtime: before any model or app import.
    configure_openmp(settings, os.environ)
    registry = load_registry(settings.app, settings.pipelines)
    stages = [registry.stage(n).with_resources(settings.resources.get(n)) for n in stage_names]
    settings = settings.model_copy(update={"threads": process_threads(stages, settings)})
    if settings.threads is None:  # not up's (it says how many): share the host's cores
        try:
            share_host(await count_host_workers(settings))
        except (RedisError, OSError) as exc:  # the worker says so itself when it connects
            logger.warning("could not count this host's workers: %s", exc)
    workers = [w for stage in stages for w in partition_workers(stage, settings, registry)]
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for w in workers:
            w.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        await asyncio.gather(*(w.start() for w in workers))
        # What is loaded now (torch, transformers, the models: ~400k objects) lives as long
        # as the process: left to the collector, each full collection walks it all, a
        # 100-150 ms pause of every batch in flight.
        gc.freeze()
        release_freed_memory()
        runs = [asyncio.create_task(w.run()) for w in workers]
        try:
            await asyncio.gather(*runs)
        except BaseException:
            # One loop failing stops its siblings in this process too, and they finish
            # before the model and the connections they share are closed.
            stop_all()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
    except BaseException:
        stop_all()
        raise
    finally:
        for w in workers:
            await w.close()


def parse_stages(raw: str) -> list[str]:
    """An argparse ``type``: comma-separated stage names, at least one (an empty list would
    serve nothing and exit 0, as if it had done its work)."""
    names = [s.strip() for s in raw.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{raw!r} names no stage (e.g. embed, or embed,ner)")
    return names


def main(argv: list[str] | None = None) -> None:
    """Entry point of one worker process; a bad setting or stage ends it with one line and
    exit status 2."""
    parser = argparse.ArgumentParser(prog="conveyor worker", description=__doc__)
    parser.add_argument(
        "stages", type=parse_stages, help="comma-separated stages to serve, e.g. embed"
    )
    args = parser.parse_args(argv)
    # Before any model library is imported (the app's module, a runner's).
    quiet_model_libraries(os.environ)
    with exit_on_config_error():
        configure_logging()
    tracing.configure("conveyor-worker")  # OTEL_* variables; off unless they say
    try:
        with exit_on_config_error():
            try:  # uvloop where it exists: less per-command overhead on the Redis round trips
                import uvloop
            except ImportError:
                asyncio.run(_serve(args.stages))
            else:
                uvloop.run(_serve(args.stages))
    finally:
        tracing.shutdown()  # the spans still batched go out


if __name__ == "__main__":
    main()
