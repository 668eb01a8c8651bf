"""CUDA graphs per shape bucket: each bucket's forward pass captured once at load, then
replayed for every batch of that shape (issue 24, item 5; ``CONVEYOR_CUDA_GRAPHS``).

An eager forward pass launches each of the model's kernels from Python, one at a time;
for a small encoder on a fast GPU that host side is much of a batch's time (issue 24: on
an H100, ~70% of a worker's profile samples were in the attention call's host side). A
CUDA graph records the kernels of one forward pass at one input shape and launches them
all with one call. A graph holds one shape, and the shape buckets
(:mod:`workers.models.buckets`) bound the shapes a runner ever runs, so every one of them
can be captured at load.

How, after torch's recipe (the "CUDA Graphs" notes of torch.cuda): per bucket, static
input tensors of that shape; a few eager runs on a side stream (the kernels' lazy setup
happens outside the capture); then the capture, on that same stream, into one memory pool
shared by all of the runner's graphs. Sharing is safe in any replay order here: every
graph's static inputs and outputs stay held, so what one graph keeps is never another's
scratch, and the graphs replay one at a time (the model thread runs one batch at a time).
At run time the batch is copied into its shape's static inputs, the graph replays, and
its outputs are cloned: the next replay of the shape overwrites the static ones, and a
caller may hold a result past it.

The cost is memory: each graph keeps its static outputs (the embed stage's 192 buckets
of MiniLM: about 0.4 GB of hidden states in fp16), and the pool keeps the largest
bucket's intermediates. Capturing takes a few eager runs and one capture per bucket.

Off by default: unproven until measured faster on a GPU with equal answers
(``tests/workers/test_graphs.py`` checks the answers where CUDA is). Where a runner
cannot capture (its model is not on cuda, its buckets are off, or a capture raises: an
operation that reads the device from the host, out of memory), :func:`capture` raises
:class:`~workers.models.buckets.CannotCapture` saying why; the worker logs that in one
line and runs eager (:func:`workers.build.prepare_shapes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from workers.models.buckets import Buckets, CannotCapture

Shape = tuple[int, int]
"""A bucket: (rows, tokens)."""

WARM_RUNS = 3
"""Eager runs of a shape on the side stream before its capture (torch's recipe runs a
few, so that kernel selection and workspaces are set up outside the capture)."""


class ShapeGraph:
    """One bucket's captured forward pass.

    Args:
        graph: the captured graph.
        inputs: the static inputs it reads, by keyword (``input_ids``, ...).
        outputs: the model's output object whose tensors the graph writes.
    """

    def __init__(
        self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor], outputs: Any
    ) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def replay(self, encoding: Mapping[str, torch.Tensor]) -> Any:
        """Run the graph on ``encoding`` (of the graph's shape and keys).

        Returns:
            An output object of the model's own type, its tensors copies of the static
            outputs, so the next replay does not change them.
        """
        for key, static in self.inputs.items():
            static.copy_(encoding[key], non_blocking=True)
        self.graph.replay()
        return type(self.outputs)(
            **{
                key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in self.outputs.items()
            }
        )


class BucketGraphs:
    """A runner's CUDA graphs, one per bucket shape (:func:`capture` builds them).

    Args:
        device: the cuda device they run on.
        graphs: each bucket's graph.

    Attributes:
        replays: batches run by a graph so far (not eager).
    """

    def __init__(self, device: torch.device, graphs: dict[Shape, ShapeGraph]) -> None:
        self.device = device
        self._graphs = graphs
        self.replays = 0

    @property
    def shapes(self) -> set[Shape]:
        """The shapes captured."""
        return set(self._graphs)

    def run(self, encoding: Mapping[str, torch.Tensor]) -> Any | None:
        """The model's outputs on ``encoding`` by its shape's graph; None where no graph
        fits it (a shape or tensors other than those captured): run it eager.

        Args:
            encoding: a padded batch on the graphs' device.
        """
        rows, length = encoding["input_ids"].shape[:2]
        graph = self._graphs.get((rows, length))
        if graph is None or set(encoding.keys()) != set(graph.inputs):
            return None
        with torch.inference_mode(), torch.cuda.device(self.device):
            outputs = graph.replay(encoding)
        self.replays += 1
        return outputs


def unsupported(device: torch.device, buckets: Buckets | None) -> str | None:
    """Why a runner on ``device`` with ``buckets`` cannot capture graphs (None: it can).

    Args:
        device: where the runner's model runs.
        buckets: the runner's buckets (None: off).
    """
    if buckets is None:
        return "shape buckets are off (a graph holds one shape; CONVEYOR_BUCKETS)"
    if device.type != "cuda":
        return f"the model runs on {device}, not cuda"
    return None


def capture(
    model: Callable[..., Any],
    device: torch.device,
    buckets: Buckets | None,
    example: Callable[[int, int], Mapping[str, torch.Tensor]],
) -> BucketGraphs:
    """Capture one graph per bucket of ``model``'s forward pass: all of them, or none.

    Args:
        model: called with an encoding's tensors as keywords; returns a model output
            object (``.last_hidden_state``, ``.logits``).
        device: where it runs.
        buckets: the shapes to capture.
        example: a batch of a given (rows, tokens) shape on ``device``, as the runner's
            tokenizer makes one (its values serve only the warm runs and the capture).

    Raises:
        CannotCapture: why not, in one line: ``model`` is not on cuda, there are no
            buckets, or a capture raised (the cause is chained).
    """
    reason = unsupported(device, buckets)
    if reason is not None:
        raise CannotCapture(reason)
    assert buckets is not None  # unsupported() said so
    try:
        return _capture_all(model, device, buckets, example)
    except Exception as exc:  # any failure leaves the eager path, which still works
        first = next(iter(str(exc).strip().splitlines()), "")
        raise CannotCapture(f"capture failed: {type(exc).__name__}: {first}") from exc


def _capture_all(
    model: Callable[..., Any],
    device: torch.device,
    buckets: Buckets,
    example: Callable[[int, int], Mapping[str, torch.Tensor]],
) -> BucketGraphs:
    graphs: dict[Shape, ShapeGraph] = {}
    with torch.inference_mode(), torch.cuda.device(device):
        pool = torch.cuda.graph_pool_handle()
        # One stream for every warm run and capture: a pool shared across captures is
        # reused best when they run on the same stream (torch.cuda.graph's note). Its
        # constructor (a __new__) carries no annotations.
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # The largest first: the smaller ones' intermediates then fit in what the pool
        # already holds.
        for rows, length in sorted(buckets.shapes(), reverse=True):
            inputs = {key: value.clone() for key, value in example(rows, length).items()}
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(WARM_RUNS):
                    model(**inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other model threads of the process may use the device meanwhile.
            mode = "thread_local"
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                outputs = model(**inputs)
            graphs[rows, length] = ShapeGraph(graph, inputs, outputs)
    return BucketGraphs(device, graphs)
