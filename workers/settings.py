"""The worker process's settings, read from ``CONVEYOR_*`` environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from pipelines.settings import CommonSettings
from pipelines.stages import Resources
from workers.threads import CUDA_THREADS

MAX_RESULT_BYTES = 8 * 1024 * 1024
"""The default bound of what one request's step writes to Redis, encoded."""


def _default_cache() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "conveyor")


class WorkerSettings(CommonSettings):
    """Settings of one worker process (one stage, one model).

    Attributes:
        model_profile: ``offline`` loads models that need no network (MiniLM from its
            PyPI package, tiny generated models); ``hub`` loads the real HF models.
        models: per-stage model override, e.g. ``{"generate": "gpt2"}`` (JSON in env).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``auto``, ``float32``, ``float16`` or ``bfloat16``.
        threads: torch intra-op threads for this process (unset: on cuda
            ``cuda_threads``, on cpu torch's default); a stage's own ``threads`` wins
            (`workers.threads`).
        cuda_threads: torch intra-op threads of a process whose models run on cuda, when
            neither ``threads`` nor a stage says: the host only launches kernels and waits,
            and more threads spin (`workers.threads`).
        resources: per-stage resources over the stages' own (``threads``, ``device``,
            ``gpus``, ``memory_mb``), e.g. ``{"embed": {"gpus": 0.5, "threads": 2}}``
            (JSON in env); [`Resources`][pipelines.stages.Resources].
        spin_wait: let torch's idle OpenMP threads spin between parallel regions
            (``OMP_WAIT_POLICY=ACTIVE``). Off by default: they sleep when idle
            (``PASSIVE``), leaving the cores to the event loop, Redis and the gateway,
            which on a small CPU host serves ~5% more (bench/README.md). An
            ``OMP_WAIT_POLICY`` already in the environment wins.
        openmp_spin_count: with ``spin_wait`` off, how many times an idle OpenMP thread
            looks for work before it sleeps (libgomp's ``GOMP_SPINCOUNT``, the runtime
            of PyPI's torch for Linux; about 0.1 ms at 10,000). Long enough to bridge
            the gaps between one forward pass's operators, where a sleeping thread
            would be woken at every one (``python -m bench.idle``: +6 ms per MiniLM
            call after 20 ms idle with none), short enough to free the cores between
            batches. 0: sleep at once. A ``GOMP_SPINCOUNT`` in the environment wins.
        buckets: pad batches to shape buckets and warm them at load, for every stage
            served (None: each stage's own `buckets`,
            which by default is on for an accelerator and off on the CPU).
        warmup: with buckets on, run every bucket once at load, before the worker joins
            its stage's group (off: the first batch of each shape pays its cold cost).
        cuda_graphs: capture a CUDA graph per shape bucket at load and replay it instead
            of the eager forward pass, for every stage served whose runner has buckets
            (`workers.models.graphs`). Off until measured faster on a GPU; where a
            runner cannot capture (not on cuda, buckets off, a capture fails), one log
            line says why and it runs eager.
        cache_dir: where generated models are kept.
        max_batch_size: overrides the stage's bound when set.
        batch_wait_ms: overrides the stage's window when set.
        max_batch_tokens: overrides the stage's token bound when set; 0 turns
            length-aware batching off (batches bounded by items alone).
        max_concurrent_batches: batches read ahead and in flight at once (the model
            itself runs one batch at a time; the next is assembled meanwhile); with
            several partitions, each partition's loop gets its share, rounded up.
        bulk_every: bulk's guaranteed share of a batch while both lanes have work: one
            slot in this many (rounded up); interactive takes the rest first.
        adaptive_batching: go before the window closes when waiting would not raise
            throughput (workers/policy.py); off: always wait out the window.
        block_ms: how long one idle read blocks (also bounds how fast a stop is seen).
        reply_maxlen: approximate cap on each reply stream's length (in entries).
        reply_ttl_s: a reply stream nobody writes to expires after this long.
        consumer_name: a stable consumer name (e.g. a StatefulSet pod's); a worker
            restarted under it first finishes its own pending entries. Unset: unique
            host-pid-random.
        min_idle_ms: an entry pending this long without its worker touching it is
            reclaimed by another worker (a live worker touches its batch every third).
        reclaim_interval_ms: how often a worker looks for idle entries to reclaim.
        max_deliveries: an entry delivered more often goes to the dead-letter stream (a
            delivery: its first read, and each crash of a worker while it was on the
            model, `workers.claims`).
        trim_interval_s: how often a worker trims its stage stream (done work only).
        prune_gone_s: a consumer of the stage's groups with no live heartbeat and nothing
            delivered this long is a gone worker's: a live worker removes it (once it
            holds nothing pending; its entries are reclaimed first), so ``conveyor
            status`` and ``/status`` stop listing it; looked for every half of it, at
            most every minute (`workers.prune`).
        alive_file: a file the worker's loop touches each time it comes round, for a
            liveness probe (`workers.alive`); unset: none.
        alive_stale_s: the worker's heartbeat in Redis (what ``/metrics``, ``/status``
            and ``conveyor status`` count as a live worker) runs out this long after its
            last beat; it beats every third of it (`workers.alive.Presence`).
        stats_flush_s: how long a worker may hold back its batches' counts and histograms
            (sent with a later publish, or when idle); 0: with every publish.
        replace_stage_definition: a worker whose stage's definition (its input schema,
            runner, kind: what the wire contract depends on) differs from the one its
            live workers serve replaces it instead of refusing to start
            (`runtime.definitions`); with none live it is replaced anyway (a redeploy).
        max_result_bytes: the most one request's step may write to Redis, encoded (its
            reply or job result, or what it hands on to the next steps): a larger one
            is not written, and its caller gets 422 naming the bound (its batch-mates
            are answered as usual).
        max_call_s: the longest one model call may run, over every stage's own
            ``max_call_s`` (None: the stage's).
        hung_grace_s: a model call still running this long past every deadline of its
            batch is hung: the worker logs it and exits (`workers.runner.hung`),
            to be restarted, since the model thread it holds can never be freed.
        suspects_in_child: the entries of a batch that crashed its worker run again in a
            short-lived child process forked from the worker (its model loaded, no second
            load), so an input that kills its process kills the child, not the worker:
            a crashing input costs one restart (`workers.suspects`). Only where a fork
            is safe (Linux, not on an accelerator); off: they run in the worker.
        quarantine_s: once a crash is charged to the entries a worker takes back, each
            batch it runs for this long runs in a child too (as suspects do), so a
            stream of inputs that crash costs no further restarts (0: only suspects).
        decoding: how a stage whose model generates token by token (a causal
            language model: ``generate``; an encoder-decoder: the hub ``summarize``)
            batches: ``continuous`` (sequences join and
            leave the running batch between decoding steps: `workers.decoding`) or
            ``static`` (a batch generates to its longest request, then the next).
        decode_token_budget: with continuous decoding, the most token positions the
            running batch's cache may hold (rows x their longest prompt + max_new_tokens);
            a request that could never fit is refused (422).
        decode_prefix_cache_tokens: with continuous decoding of a causal language model,
            the most prompt positions whose keys and values are kept for reuse: a prompt
            that starts as an earlier one did (a chat's system prompt) runs only the rest
            (`workers.models.prefixes`; 16-token blocks, least recently used out). 0: off.
        log_summary_s: each stage's INFO summary line comes this often while it works
            (batches, items, outcomes, mean batch size, items/s; nothing while idle);
            each batch's own line is DEBUG (``CONVEYOR_LOG_LEVEL``). 0: no summaries.
    """

    model_profile: Literal["offline", "hub"] = "offline"
    models: dict[str, str] = Field(default_factory=dict)
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = Field(default=None, ge=1)
    cuda_threads: int = Field(default=CUDA_THREADS, ge=1, le=1024)
    resources: dict[str, Resources] = Field(default_factory=dict)
    spin_wait: bool = False
    openmp_spin_count: int = Field(default=10_000, ge=0)
    buckets: bool | None = None
    warmup: bool = True
    cuda_graphs: bool = False
    cache_dir: str = Field(default_factory=_default_cache)
    max_batch_size: int | None = Field(default=None, ge=1, le=4096)
    batch_wait_ms: float | None = Field(default=None, ge=0, le=60_000)
    max_batch_tokens: int | None = Field(default=None, ge=0, le=10_000_000)
    max_concurrent_batches: int = Field(default=2, ge=1, le=64)
    bulk_every: int = Field(default=4, ge=1, le=1000)
    adaptive_batching: bool = True
    block_ms: int = Field(default=1000, ge=1, le=30_000)
    reply_maxlen: int = Field(default=100_000, ge=100)
    reply_ttl_s: int = Field(default=3600, ge=1)
    consumer_name: str | None = Field(default=None, min_length=1, max_length=200)
    min_idle_ms: int = Field(default=10_000, ge=10)
    reclaim_interval_ms: int = Field(default=2_000, ge=10)
    max_deliveries: int = Field(default=3, ge=1)
    trim_interval_s: float = Field(default=10.0, gt=0)
    prune_gone_s: float = Field(default=3600.0, gt=0, le=30 * 86_400, allow_inf_nan=False)
    alive_file: str | None = Field(default=None, min_length=1)
    alive_stale_s: float = Field(default=30.0, ge=0.3, le=86_400, allow_inf_nan=False)
    hung_grace_s: float = Field(default=30.0, gt=0, le=86_400, allow_inf_nan=False)
    suspects_in_child: bool = True
    quarantine_s: float = Field(default=30.0, ge=0, le=86_400, allow_inf_nan=False)
    max_call_s: float | None = Field(default=None, gt=0, le=86_400, allow_inf_nan=False)
    stats_flush_s: float = Field(default=1.0, ge=0, le=3600, allow_inf_nan=False)
    max_result_bytes: int = Field(default=MAX_RESULT_BYTES, ge=1024, le=512 * 1024 * 1024)
    replace_stage_definition: bool = False
    log_summary_s: float = Field(default=30.0, ge=0, le=86_400, allow_inf_nan=False)
    decoding: Literal["continuous", "static"] = "continuous"
    decode_token_budget: int = Field(default=16_384, ge=2, le=100_000_000)
    decode_prefix_cache_tokens: int = Field(default=4096, ge=0, le=100_000_000)

    @field_validator("device")
    @classmethod
    def _device_ok(cls, value: str) -> str:
        head, _, index = value.partition(":")
        if head not in {"auto", "cpu", "cuda"} or (
            index and (head != "cuda" or not index.isdigit())
        ):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype_ok(cls, value: str) -> str:
        if value not in {"auto", "float32", "float16", "bfloat16"}:
            raise ValueError("must be auto, float32, float16 or bfloat16")
        return value
