"""What a stage is, and the built-in stages.

A stage is one model served by its own pool of workers reading one stream. It names
its input model (validated at the gateway and again at the worker), the runner that
builds the model, the model to load, and its batching bounds. The runner is named by
an import path (``"workers.models.hf:Embedder"``) so this package never imports the worker
runtime; user code may pass a factory callable instead.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipelines.errors import ConfigError
from pipelines.model import Model

_NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,100}$")

Profile = Literal["offline", "hub"]

OpenAIKind = Literal["embeddings", "completions"]
"""Which OpenAI-compatible route serves a stage's one-step pipeline (``gateway.routes.openai``):
``embeddings`` takes ``{"text"}`` and answers ``{"embedding": [float, ...]}`` (and
``prompt_tokens`` where its input has ``usage``, as [`EmbedIn`][]); ``completions``
takes [`GenerateIn`][] and answers ``{"generated_text"}``."""

Kind = Literal["model", "function"]
"""A model stage is shared by every pipeline naming it and served by its own workers; a
function stage runs one pipeline step's plain Python and belongs to that pipeline."""


class TextIn(BaseModel):
    """Input of the single-text built-ins."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=100_000, description="The input text.")


class EmbedIn(TextIn):
    """Input of ``embed``."""

    usage: bool = Field(
        default=False,
        description="Also answer `prompt_tokens`: the text's tokens as the model read it "
        "(counted by its tokenizer, special tokens included, after truncation).",
    )


class ChatMessage(BaseModel):
    """One message of a chat, as a chat template reads it."""

    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1, max_length=40, examples=["user"])
    content: str = Field(max_length=100_000, examples=["Hello!"])


# The sampling fields' descriptions (the API docs show them).
_TEMPERATURE = (
    "Sample at this temperature (0: greedy). Unset: the stage's own decoding (greedy for "
    "the built-in one)."
)
_TOP_P = (
    "When sampling, draw only from the most likely tokens that make up this much of the "
    "probability."
)
_SEED = (
    "When sampling, the seed of this request's own random source: the same request with the "
    "same seed gets the same text, whatever else runs beside it."
)
_STOP = (
    "The text ends before the first occurrence of any of these strings (which it does not "
    "include; `finish_reason` is `stop`); a stream never shows one."
)
MAX_STOPS = 4
"""The most stop strings one request may give (OpenAI's bound)."""
StopString = Annotated[str, Field(min_length=1, max_length=200)]
"""One stop string."""


class GenerateIn(TextIn):
    """Input of ``generate``."""

    max_new_tokens: int = Field(
        default=32, ge=1, le=512, description="At most this many tokens are generated."
    )
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="A chat: the prompt is these messages rendered by the model's chat "
        "template (then `text` is not read); where the tokenizer has none, as `role: "
        "content` lines ending in `assistant:`.",
    )
    usage: bool = Field(
        default=False,
        description="Also answer `prompt_tokens` and `completion_tokens` (counted by the "
        "model's tokenizer) and `finish_reason` (`length` or `stop`).",
    )
    temperature: float | None = Field(default=None, ge=0, le=2, description=_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1, description=_TOP_P)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description=_SEED)
    stop: list[StopString] | None = Field(
        default=None, min_length=1, max_length=MAX_STOPS, description=_STOP
    )


class AnyIn(BaseModel):
    """Input of ``echo``: any JSON object."""

    model_config = ConfigDict(extra="allow")


DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?", re.ASCII)
"""A device setting: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""


class Resources(BaseModel):
    """A stage's resources as ``CONVEYOR_RESOURCES`` overrides them, per stage:
    ``{"embed": {"gpus": 0.5, "threads": 2}}``; the fields are [`Stage`][]'s."""

    model_config = ConfigDict(extra="forbid")

    threads: int | None = Field(default=None, ge=1, le=1024)
    device: str | None = None
    gpus: float = Field(default=0, ge=0, le=64, allow_inf_nan=False)
    memory_mb: int | None = Field(default=None, ge=1)

    @field_validator("device")
    @classmethod
    def _device_ok(cls, value: str | None) -> str | None:
        if value is not None and not DEVICE_RE.fullmatch(value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus_ok(cls, value: float) -> float:
        if value > 1 and value != int(value):
            raise ValueError("above 1 must be a whole number of GPUs (a model spanning them)")
        return value


def resource_errors(exc: ValidationError) -> str:
    """``exc``'s errors as one line naming each field."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )


@dataclass(frozen=True)
class Stage:
    """One model stage, served by workers reading the stage's stream.

    Attributes:
        name: lower-case route and stream name (``/v1/{name}``).
        input_model: pydantic model of one request's payload.
        runner: ``"module:attr"`` or a callable returning a [`Model`][pipelines.model.Model].
        model: the model the offline profile loads (HF id, path, ``minilm``, ``tiny:kind``).
        hub_model: the model the ``hub`` profile loads (defaults to ``model``).
        hub_runner: the runner of the ``hub`` profile (defaults to ``runner``).
        options: extra keyword arguments for the runner.
        max_batch_size: at most this many items per model call.
        batch_wait_ms: a batch waits at most this long after its oldest item arrived.
        max_batch_tokens: bound a batch by padded tokens too (its items times its longest
            item's estimated tokens, `pipelines.tokens`), and group what a window
            took into batches of similar length (length-aware batching,
            `workers.lengths`). None: batches are bounded by items alone.
        max_backlog: the gateway refuses new requests (503) once the stage's backlog
            (undelivered + in flight, `runtime.status.StageStatus.backlog`) is this.
        summary: one line for the API docs.
        replicas: worker processes ``conveyor up`` starts for it.
        streaming: its runner can stream output (``/v1/{name}/stream`` is offered).
        kind: ``"function"`` for a pipeline's function step (set by
            [`pipelines.graph.function`][pipelines.graph.function]), else ``"model"``.
        threads: torch intra-op threads of a worker process serving it (None: what
            ``conveyor up`` divides the cores into, else ``CONVEYOR_THREADS``, else
            torch's default).
        device: where its model runs, over the process's ``CONVEYOR_DEVICE``: ``auto``,
            ``cpu``, ``cuda`` or ``cuda:N`` (None: the process's setting).
        gpus: the GPU share one worker of it reserves: ``0.5`` (two such workers share a
            GPU), ``1``, or a whole number above 1 for a model spanning that many GPUs.
            0: none reserved (on a GPU host ``conveyor up`` still spreads such workers
            over the GPUs, unless its device is ``cpu``); `conveyor.placement`.
        memory_mb: what one worker of it holds (MiB), for the deploy files' requests.
        buckets: pad each batch to a shape bucket (rows to a power of two up to the max
            batch, tokens as ``bucket_lengths`` says) and run every bucket once at load,
            so an accelerator meets no new shape once the worker reads (runners that
            support it: the encoder runners, `workers.models.buckets`). None: on
            where the model runs on an accelerator, off on the CPU, where a new shape
            costs little and padding costs its full compute. ``CONVEYOR_BUCKETS`` wins.
        bucket_lengths: how ``buckets`` pads tokens: an int, up to a multiple of it; a
            tuple, up to the least of its lengths that fits (the model's ``max_length``
            is always a bucket too).
        openai: the OpenAI-compatible route its one-step pipeline is served on
            ([`OpenAIKind`][]); None: none.
        max_call_s: the longest one model call may run, whatever its requests' deadlines
            (a job's may be an hour): past it the call is hung, the worker restarts and
            the input that hung is dead-lettered. ``CONVEYOR_MAX_CALL_S`` wins.
    """

    name: str
    input_model: type[BaseModel]
    runner: str | Callable[..., Model]
    model: str = ""
    hub_model: str | None = None
    hub_runner: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    max_batch_tokens: int | None = None
    max_backlog: int = 1024
    summary: str = ""
    replicas: int = 1
    streaming: bool = False
    kind: Kind = "model"
    threads: int | None = None
    device: str | None = None
    gpus: float = 0
    memory_mb: int | None = None
    buckets: bool | None = None
    bucket_lengths: int | tuple[int, ...] = 16
    openai: OpenAIKind | None = None
    max_call_s: float = 60.0

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(
                f"stage name {self.name!r} must be lower-case letters, digits, '-', '_' or '.'"
            )
        if self.max_batch_size < 1:
            raise ConfigError(f"stage {self.name!r}: max_batch_size must be >= 1")
        if self.batch_wait_ms < 0:
            raise ConfigError(f"stage {self.name!r}: batch_wait_ms must be >= 0")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ConfigError(f"stage {self.name!r}: max_batch_tokens must be >= 1 (or None)")
        if self.replicas < 1:
            raise ConfigError(f"stage {self.name!r}: replicas must be >= 1")
        if not 0 < self.max_call_s <= 86_400:
            raise ConfigError(f"stage {self.name!r}: max_call_s must be in (0, 86400]")
        if self.max_backlog < 1:
            raise ConfigError(f"stage {self.name!r}: max_backlog must be >= 1")
        lengths = (
            (self.bucket_lengths,) if isinstance(self.bucket_lengths, int) else self.bucket_lengths
        )
        if not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
            raise ConfigError(
                f"stage {self.name!r}: bucket_lengths must be a length >= 1 (a multiple) "
                f"or a non-empty tuple of them, got {self.bucket_lengths!r}"
            )
        if self.openai not in (None, "embeddings", "completions"):
            raise ConfigError(
                f"stage {self.name!r}: openai must be 'embeddings', 'completions' or None"
            )
        if self.kind not in ("model", "function"):
            raise ConfigError(f"stage {self.name!r}: kind must be 'model' or 'function'")
        try:
            Resources(
                threads=self.threads, device=self.device, gpus=self.gpus, memory_mb=self.memory_mb
            )
        except ValidationError as exc:
            raise ConfigError(f"stage {self.name!r}: {resource_errors(exc)}") from None

    def with_resources(self, resources: Resources | None) -> Stage:
        """This stage with the fields ``resources`` sets (from ``CONVEYOR_RESOURCES``)
        replacing its own.

        Args:
            resources: the stage's entry of the resources setting (None: none).
        """
        if resources is None:
            return self
        return replace(self, **resources.model_dump(exclude_unset=True))

    def model_for(self, profile: Profile) -> str:
        """The model spec to load under ``profile``."""
        if profile == "hub" and self.hub_model:
            return self.hub_model
        return self.model

    def factory(self, profile: Profile = "offline") -> Callable[..., Model]:
        """Resolve the runner of ``profile`` to a callable (importing it if named by path)."""
        runner = self.hub_runner if profile == "hub" and self.hub_runner else self.runner
        if not isinstance(runner, str):
            return runner
        module_name, _, attr = runner.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"stage {self.name!r}: runner {runner!r} is not 'module:attr'")
        try:
            found: Callable[..., Model] = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            moved = MOVED_RUNNERS.get(module_name)
            hint = f" (the built-in runners moved to {moved})" if moved else ""
            raise ConfigError(
                f"stage {self.name!r}: cannot import runner {runner!r}: {exc}{hint}"
            ) from exc
        return found


MOVED_RUNNERS = {
    "workers.hf": "workers.models.hf",
    "workers.zeroshot": "workers.models.zeroshot",
    "workers.tiny": "workers.models.tiny",
    "workers.runners": "workers.models.toy (Echo, Adder, Multiplier) and "
    "workers.models.function (FunctionRunner)",
}
"""Where the runners of release 0.1's layout went: named in the error of a stage that still
names the old module."""


_model_stage = partial(Stage, memory_mb=1024)
"""A built-in stage serving a model: one worker of it holds about 1 GiB."""

BUILTIN: dict[str, Stage] = {
    s.name: s
    for s in (
        _model_stage(
            "embed",
            EmbedIn,
            "workers.models.hf:Embedder",
            model="minilm",
            hub_model="sentence-transformers/all-MiniLM-L6-v2",
            max_batch_size=32,
            max_batch_tokens=8192,
            openai="embeddings",
            summary="Sentence embedding (mean-pooled, L2-normalised).",
        ),
        _model_stage(
            "sentiment",
            TextIn,
            "workers.models.zeroshot:AnchorSentiment",
            model="minilm",
            hub_model="distilbert-base-uncased-finetuned-sst-2-english",
            hub_runner="workers.models.hf:TextClassifier",
            max_batch_tokens=8192,
            summary="Sentiment: POSITIVE or NEGATIVE with a score.",
        ),
        _model_stage(
            "ner",
            TextIn,
            "workers.models.hf:TokenClassifier",
            model="tiny:ner",
            hub_model="dslim/bert-base-NER",
            max_batch_tokens=8192,
            summary="Named entities, aggregated over sub-words.",
        ),
        _model_stage(
            "summarize",
            TextIn,
            "workers.models.hf:ExtractiveSummarizer",
            model="minilm",
            hub_model="sshleifer/distilbart-cnn-12-6",
            hub_runner="workers.models.hf:Summarizer",
            max_batch_size=8,
            summary="Summary of a text.",
        ),
        _model_stage(
            "generate",
            GenerateIn,
            "workers.models.hf:Generator",
            model="tiny:generate",
            hub_model="gpt2",
            max_batch_size=8,
            streaming=True,
            openai="completions",
            summary="Text continuation.",
        ),
        Stage(
            "echo",
            AnyIn,
            "workers.models.toy:Echo",
            summary="Returns its input: measures serving overhead without a model.",
        ),
    )
}
