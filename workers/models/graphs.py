"""CUDA graphs per shape bucket: each bucket's forward pass captured once at load, then
replayed for every batch of that shape (``CONVEYOR_CUDA_GRAPHS``).

An eager forward pass launches each of the model's kernels from Python, one at a time;
for a small encoder on a fast GPU that host side is much of a batch's time (on an H100,
~70% of a worker's profile samples were in the attention call's host side). A CUDA graph
records the kernels of one forward pass at one input shape and launches them all with one
call. A graph holds one shape, and the shape buckets
(:mod:`workers.models.buckets`) bound the shapes a runner ever runs, so every one of them
can be captured at load.

How, after torch's recipe (the "CUDA Graphs" notes of torch.cuda): per bucket, static
input tensors of that shape; a few eager runs on a side stream (the kernels' lazy setup
happens outside the capture); then the capture, on that same stream, into one memory pool.
Graphs belong to the weights, not to a runner (:class:`WeightsGraphs`, kept on
:class:`~workers.models.hf_base.Weights`): the stages on one copy of the weights (embed,
sentiment and summarize all sit on MiniLM) capture each shape once and share its graph and
one pool. Sharing is safe in any replay order here: every graph's static inputs and
outputs stay held, so what one graph keeps is never another's scratch, and the graphs
replay one at a time (the stages on one copy of the weights share one model thread,
which runs one batch at a time).
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

import threading
from collections.abc import Callable, Collection, Mapping
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
    """A runner's CUDA graphs, one per bucket shape (:func:`capture` builds them), shared
    with the other runners on its weights (:class:`WeightsGraphs`).

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
    shared: WeightsGraphs,
) -> BucketGraphs:
    """One graph per bucket of ``model``'s forward pass: all of them, or none. A shape
    already captured on the same weights (by another stage on them) is not captured again.

    Args:
        model: called with an encoding's tensors as keywords; returns a model output
            object (``.last_hidden_state``, ``.logits``).
        device: where it runs.
        buckets: the shapes to capture.
        example: a batch of a given (rows, tokens) shape on ``device``, as the runner's
            tokenizer makes one (its values serve only the warm runs and the capture).
        shared: the graphs of ``model``'s weights, which hold the ones captured.

    Raises:
        CannotCapture: why not, in one line: ``model`` is not on cuda, there are no
            buckets, or a capture raised (the cause is chained).
    """
    reason = unsupported(device, buckets)
    if reason is not None:
        raise CannotCapture(reason)
    assert buckets is not None  # unsupported() said so
    try:
        return BucketGraphs(device, shared.graphs(model, device, buckets.shapes(), example))
    except Exception as exc:  # any failure leaves the eager path, which still works
        first = next(iter(str(exc).strip().splitlines()), "")
        raise CannotCapture(f"capture failed: {type(exc).__name__}: {first}") from exc


class WeightsGraphs:
    """The CUDA graphs of one copy of weights, one per shape, in one memory pool: each
    shape captured once, by the first runner on the weights that asks for it (the embed
    stage's 192 buckets took ~0.4 GB and their capture time once per stage before).

    Kept on :class:`~workers.models.hf_base.Weights`, so the graphs live as long as the
    weights. Holds no CUDA object until a capture.
    """

    def __init__(self) -> None:
        self._graphs: dict[Shape, ShapeGraph] = {}
        self._pool: Any = None
        self._stream: Any = None
        self._lock = threading.Lock()

    def graphs(
        self,
        model: Callable[..., Any],
        device: torch.device,
        shapes: Collection[Shape],
        example: Callable[[int, int], Mapping[str, torch.Tensor]],
    ) -> dict[Shape, ShapeGraph]:
        """The graph of each of ``shapes``, captured where not yet (see :func:`capture`).

        Raises:
            Exception: what a capture raised; the shapes captured before it are kept.
        """
        with self._lock, torch.inference_mode(), torch.cuda.device(device):
            if self._stream is None:
                self._pool = torch.cuda.graph_pool_handle()
                # One stream for every warm run and capture: a pool shared across
                # captures is reused best when they run on the same stream
                # (torch.cuda.graph's note). Its constructor (a __new__) carries no
                # annotations.
                self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            # The largest first: the smaller ones' intermediates then fit in what the pool
            # already holds.
            for rows, length in sorted(set(shapes) - set(self._graphs), reverse=True):
                inputs = {key: value.clone() for key, value in example(rows, length).items()}
                self._graphs[rows, length] = self._capture(model, device, inputs)
            return {shape: self._graphs[shape] for shape in shapes}

    def _capture(
        self, model: Callable[..., Any], device: torch.device, inputs: dict[str, torch.Tensor]
    ) -> ShapeGraph:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARM_RUNS):
                model(**inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other model threads of the process may use the device meanwhile.
        mode = "thread_local"
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode=mode):
            outputs = model(**inputs)
        return ShapeGraph(graph, inputs, outputs)
