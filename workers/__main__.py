"""``python -m workers STAGE``: serve one stage until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from pipelines.stages import get_stage
from workers.loop import Worker
from workers.settings import WorkerSettings


async def _serve(stage_name: str) -> None:
    worker = Worker(get_stage(stage_name), WorkerSettings())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        await worker.run()
    finally:
        await worker.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of one worker process."""
    parser = argparse.ArgumentParser(prog="conveyor worker", description=__doc__)
    parser.add_argument("stage", help="the stage to serve, e.g. embed")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(_serve(args.stage))


if __name__ == "__main__":
    main()
