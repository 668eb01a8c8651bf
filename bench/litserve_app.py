"""LitServe (PyPI ``litserve``) serving the benchmark's models, as a peer system.

One :class:`ModelAPI` per stage, each a ``litserve.LitAPI`` with ``max_batch_size=32`` and
``batch_timeout=0.01`` (LitServe's own dynamic batching: a batch closes when it is full or
10 ms after the worker began collecting it), served at ``/v1/STAGE`` by one
``litserve.LitServer`` on 127.0.0.1 with its defaults otherwise (the multiprocessing
transport, ``fast_queue`` off). LitServe runs this as processes: this one (the launcher), a
``multiprocessing.Manager`` server holding the request and response queues, one
inference worker per API (``workers_per_device=1``, started with ``spawn``; its
``setup`` loads the model with :func:`bench.workloads.load_model`), and one uvicorn API
server (``num_api_servers=1``, forked). The benchmark counts the CPU of all of them.

The body is validated by the same pydantic model as the other systems' (``TextIn``,
through ``decode_request``'s annotation) and the answer is encoded with orjson in
``encode_response``, as theirs are. ``GET /stats`` reports per stage the items and batches
run and their real and padded tokens (:func:`bench.workloads.count_tokens`), kept in shared
memory the inference workers write and the API server reads.

Run by the benchmark (``bench/systems.py``)::

    BENCH_WORKLOADS=echo,embed BENCH_PORT=8003 python -m bench.litserve_app

Environment: ``BENCH_WORKLOADS`` (comma-separated stages), ``BENCH_PORT``, ``BENCH_DEVICE``
(``auto``, ``cpu``, ``cuda``), ``BENCH_MAX_BATCH`` (32), ``BENCH_BATCH_TIMEOUT_MS`` (10).
"""

# No `from __future__ import annotations`: LitServe reads decode_request's annotation at
# run time to choose the request body's type, and a string would not do.

import logging
import multiprocessing
import os
import signal
from typing import Any

import litserve as ls  # type: ignore[import-untyped, import-not-found, unused-ignore]
import orjson
from fastapi import HTTPException
from fastapi.responses import Response

from bench.workloads import WORKLOADS, count_tokens, load_model, stages_of
from pipelines.model import Item, Result
from pipelines.stages import TextIn

HOST = "127.0.0.1"
DEVICE = os.environ.get("BENCH_DEVICE", "auto")
MAX_BATCH = int(os.environ.get("BENCH_MAX_BATCH", "32"))
BATCH_TIMEOUT_S = float(os.environ.get("BENCH_BATCH_TIMEOUT_MS", "10")) / 1000
COUNTERS = ("items", "batches", "real_tokens", "padded_tokens")
"""What each stage's shared counter array holds, in order."""


class ModelAPI(ls.LitAPI):  # type: ignore[misc]
    """One stage's model behind LitServe's batching loop.

    Args:
        stage: which model (a :data:`bench.workloads.WORKLOADS` name), served at
            ``/v1/{stage}``.
        counters: shared memory for :data:`COUNTERS`, written by the inference worker.
    """

    def __init__(self, stage: str, counters: Any) -> None:
        super().__init__(
            max_batch_size=MAX_BATCH, batch_timeout=BATCH_TIMEOUT_S, api_path=f"/v1/{stage}"
        )
        self.stage = stage
        self.counters = counters

    def setup(self, device: str) -> None:
        """Load the model in the inference worker (``device`` is LitServe's choice;
        :func:`load_model` takes ``BENCH_DEVICE``, as in the other systems)."""
        del device
        self.model = load_model(self.stage, DEVICE)
        self.tokens = count_tokens(self.model)

    def decode_request(self, request: TextIn) -> Item:
        """The validated body as the model's item."""
        return request.model_dump()

    def predict(self, x: list[Item]) -> list[Result | BaseException]:
        """The model on one batch; counts it."""
        results = list(self.model.predict(x))
        self.counters[0] += len(x)
        self.counters[1] += 1
        if self.tokens is not None:
            self.counters[2] = self.tokens.real
            self.counters[3] = self.tokens.padded
        return results

    def encode_response(self, output: Result | BaseException) -> Response:
        """The result as JSON (orjson, as the other systems answer)."""
        if isinstance(output, BaseException):
            raise HTTPException(500, f"{type(output).__name__}: {output}")
        return Response(orjson.dumps(output), media_type="application/json")


def _accelerator() -> str:
    if DEVICE == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _on_sigterm(launcher: int) -> None:
    """SIGTERM stops LitServer.run as Ctrl-C does (it shuts its processes down on
    KeyboardInterrupt only). Its forked API server inherits the handler and re-raises the
    signal once uvicorn has stopped: there it just exits."""

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != launcher:
            raise SystemExit(0)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main() -> None:
    """Serve ``BENCH_WORKLOADS`` on ``BENCH_PORT`` until SIGTERM or Ctrl-C."""
    logging.basicConfig(level=logging.WARNING)
    _on_sigterm(os.getpid())
    names = os.environ.get("BENCH_WORKLOADS", ",".join(stages_of(list(WORKLOADS))))
    stages = [n.strip() for n in names.split(",") if n.strip()]
    shared = multiprocessing.get_context("spawn")
    counters = {stage: shared.RawArray("q", len(COUNTERS)) for stage in stages}
    server = ls.LitServer(
        [ModelAPI(stage, counters[stage]) for stage in stages],
        accelerator=_accelerator(),
        devices=1,
        workers_per_device=1,
    )

    async def stats() -> dict[str, dict[str, int]]:
        """Items, batches and tokens run so far, per stage."""
        return {stage: dict(zip(COUNTERS, c[:], strict=True)) for stage, c in counters.items()}

    server.app.add_api_route("/stats", stats, methods=["GET"])
    server.run(
        host=HOST,
        port=int(os.environ["BENCH_PORT"]),
        num_api_servers=1,
        log_level="warning",
        generate_client_file=False,
    )


if __name__ == "__main__":
    main()
