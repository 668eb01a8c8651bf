"""Static against continuous decoding in the generate stage, under Poisson arrivals.

``python -m bench.generate`` starts a conveyor per mode, one at a time (each: redis-server,
the gateway, one ``generate`` worker: the built-in tiny GPT-2, offline), one with the worker
setting ``CONVEYOR_DECODING=static`` and one with ``CONVEYOR_DECODING=continuous``, and
drives each over real HTTP at every rate of ``--rates`` (requests/s). Requests arrive as a
Poisson process (exponential gaps) for ``--duration`` seconds, each asking for a
long-tailed ``max_new_tokens``: log-uniform over ``--tokens`` (8..400: the median about
57, one in ten above 270), so most answers are short and a few are long. Both modes get
the same requests at the same offsets (drawn from ``--seed``, the round and the rate), and
the two are measured in alternation for ``--rounds`` rounds (pooled; odd rounds run the
modes in the other order), so that their ratio is taken in the same minutes: on a shared
2-core machine the speed drifts by more than what is measured.

Every request streams (``POST /v1/generate/stream``, Server-Sent Events: ``token`` events,
then ``done``) with ``usage`` on, so that:

- time to first token is from the request's scheduled arrival to its first ``token``
  event (to ``done`` for an answer with no token: the model ended at once);
- latency is from the scheduled arrival to ``done`` (open loop: a client that fell behind
  its schedule counts against the server, not hidden);
- completion tokens are the ``completion_tokens`` of the ``done`` result, as the model's
  tokenizer counted them; tokens/s is their sum over the wall time from the first arrival
  to the last answer;
- errors are non-200 statuses, ``error`` events, broken streams and streams that end
  without ``done``.

It prints one Markdown table (``--out`` also writes it to a file) with both modes' rows and,
on each continuous row, its ratios to static at the same rate, next to the issue's CPU
targets (time to first token p50 <= 0.3x, latency p50 <= 0.5x, tokens/s >= 1.0x). It reports
them; it does not judge them. A worker that does not know ``CONVEYOR_DECODING`` ignores it
(both static then); the header says whether this checkout's worker knows it.
``python -m bench.generate prefix ...``: the shared-prefix workload (`bench.generate_prefix`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from bench.report import machine
from bench.systems import HOST, ConveyorServer, Options, conveyor
from bench.workloads import texts
from pipelines.stages import BUILTIN
from workers.settings import WorkerSettings

STAGE = "generate"
APP = "pipelines.builtin:builtin_pipelines"
MODES = ("static", "continuous")
TARGETS = {"ttft": 0.3, "latency": 0.5, "tokens": 1.0}
"""The issue's CPU targets, continuous over static at the same load: time to first token
p50 and latency p50 at most, tokens/s at least."""

PROMPTS = texts(97)
"""The prompts requests draw from: sentences of 8 to 24 words."""


@dataclass(frozen=True)
class Arrival:
    """One request of a run.

    Attributes:
        at: seconds after the run's start at which it is sent.
        max_new_tokens: how many tokens it asks for.
        text: its prompt.
    """

    at: float
    max_new_tokens: int
    text: str


def arrivals(rate: float, duration: float, seed: int, tokens: tuple[int, int]) -> list[Arrival]:
    """A Poisson process of ``rate`` per second over ``duration`` seconds (at least one
    arrival), each asking for a log-uniform ``max_new_tokens`` in ``tokens``.

    Args:
        rate: mean arrivals per second.
        duration: the span arrivals fall in, in seconds.
        seed: with ``rate``, fixes the sequence: the same for every mode.
        tokens: the least and the most ``max_new_tokens``.
    """
    rng = random.Random(f"{seed}:{rate:g}")  # a str seed is hashed the same in every process
    low, high = math.log(tokens[0]), math.log(tokens[1])
    out: list[Arrival] = []
    at = 0.0
    while not out or at < duration:
        tokens_asked = round(math.exp(rng.uniform(low, high)))
        out.append(Arrival(at, tokens_asked, rng.choice(PROMPTS)))
        at += rng.expovariate(rate)
    return out


@dataclass
class Answer:
    """What one request got.

    Attributes:
        ok: a ``done`` event arrived (status 200, no ``error`` event).
        ttft: seconds from its arrival to its first token (to ``done`` with no token).
        latency: seconds from its arrival to its last event.
        tokens: ``completion_tokens`` of its result (0 on error).
        detail: what went wrong, for an error.
    """

    ok: bool
    ttft: float
    latency: float
    tokens: int = 0
    detail: str = ""


async def stream_one(http: httpx.AsyncClient, arrival: Arrival, sent_at: float) -> Answer:
    """Send ``arrival`` to ``/v1/generate/stream`` and read its events to the end.

    Args:
        http: a client whose base URL is the gateway.
        arrival: the request.
        sent_at: its scheduled arrival on :func:`time.perf_counter`'s clock.
    """
    body = {"text": arrival.text, "max_new_tokens": arrival.max_new_tokens, "usage": True}
    first: float | None = None
    event = ""
    try:
        async with http.stream("POST", f"/v1/{STAGE}/stream", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                elapsed = time.perf_counter() - sent_at
                return Answer(False, elapsed, elapsed, detail=f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                    if event == "token" and first is None:
                        first = time.perf_counter() - sent_at
                elif line.startswith("data: ") and event in ("done", "error"):
                    elapsed = time.perf_counter() - sent_at
                    data = orjson.loads(line.removeprefix("data: "))
                    if event == "error" or not isinstance(data, dict):
                        return Answer(False, elapsed, elapsed, detail=str(data))
                    tokens = data.get("completion_tokens")
                    if not isinstance(tokens, int):
                        return Answer(False, elapsed, elapsed, detail=f"no usage in {data}")
                    return Answer(True, elapsed if first is None else first, elapsed, tokens)
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        elapsed = time.perf_counter() - sent_at
        return Answer(False, elapsed, elapsed, detail=f"{type(exc).__name__}: {exc}")
    elapsed = time.perf_counter() - sent_at
    return Answer(False, elapsed, elapsed, detail="stream ended without done")


@dataclass
class Run:
    """One mode at one rate, over every round.

    Attributes:
        mode: ``static`` or ``continuous``.
        rate: the offered load, requests/s.
        seconds: wall time from the first arrival to the last answer, summed over rounds.
        answers: one per request, in arrival order, round after round.
    """

    mode: str
    rate: float
    seconds: float
    answers: list[Answer] = field(default_factory=list)

    @property
    def errors(self) -> int:
        """Requests that got no ``done``."""
        return sum(not a.ok for a in self.answers)

    @property
    def tokens(self) -> int:
        """Completion tokens of every answered request."""
        return sum(a.tokens for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of wall time."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def pct(self, what: str, q: float) -> float:
        """Quantile ``q`` (0..1) of ``ttft`` or ``latency`` over the answered requests, in
        seconds (NaN: none answered)."""
        values: list[float] = [getattr(a, what) for a in self.answers if a.ok]
        if len(values) < 2:
            return values[0] if values else math.nan
        # Inclusive: the 99th percentile of fewer than 100 values lies within them.
        return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


async def drive(base: str, requests: Sequence[Arrival], mode: str, rate: float) -> Run:
    """Send ``requests`` on their schedule (open loop: whatever the answers), each on its
    own stream; return once every one has ended."""
    # No pool bound: a request must never wait for a connection, or the client's queue
    # would be measured as the server's.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
        began = time.perf_counter()
        tasks: list[asyncio.Task[Answer]] = []
        for arrival in requests:
            sent_at = began + arrival.at
            delay = sent_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule is the point of an open loop
            tasks.append(asyncio.create_task(stream_one(http, arrival, sent_at)))
        answers = list(await asyncio.gather(*tasks))
        return Run(mode, rate, time.perf_counter() - began, answers)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:,.0f}"


def _ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base <= 0:
        return "-"
    return f"{value / base:.2f}"


def table(runs: Sequence[Run]) -> list[str]:
    """The Markdown table: one row per run, static and continuous at each rate; a
    continuous row also gives its ratios to the static row of its rate."""
    head = (
        "| mode | load req/s | requests | errors | completion tokens | tokens/s "
        "| TTFT p50 ms | TTFT p99 ms | latency p50 ms | latency p99 ms "
        f"| TTFT p50 / static (<= {TARGETS['ttft']}) "
        f"| latency p50 / static (<= {TARGETS['latency']}) "
        f"| tokens/s / static (>= {TARGETS['tokens']}) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    static = {run.rate: run for run in runs if run.mode == "static"}
    for run in runs:
        base = static.get(run.rate)
        if run.mode == "static" or base is None:
            ratios = "- | - | -"
        else:
            ratios = " | ".join(
                (
                    _ratio(run.pct("ttft", 0.5), base.pct("ttft", 0.5)),
                    _ratio(run.pct("latency", 0.5), base.pct("latency", 0.5)),
                    _ratio(run.tokens_per_s, base.tokens_per_s),
                )
            )
        lines.append(
            f"| {run.mode} | {run.rate:g} | {len(run.answers)} | {run.errors} | {run.tokens:,} "
            f"| {run.tokens_per_s:,.0f} | {_ms(run.pct('ttft', 0.5))} "
            f"| {_ms(run.pct('ttft', 0.99))} | {_ms(run.pct('latency', 0.5))} "
            f"| {_ms(run.pct('latency', 0.99))} | {ratios} |"
        )
    return lines


def report(runs: Sequence[Run], args: argparse.Namespace, command: str) -> str:
    """The whole Markdown report: the command, what was measured, the table, the machine."""
    knows = "decoding" in WorkerSettings.model_fields
    said = (
        "this checkout's worker has the `CONVEYOR_DECODING` setting"
        if knows
        else "this checkout's worker has no `CONVEYOR_DECODING` setting: both modes ran "
        "static decoding"
    )
    low, high = args.tokens
    lines = [
        f"`{command}`",
        "",
        f"Built-in `generate` (tiny GPT-2, CPU), max batch {args.max_batch}, {said}. Poisson "
        f"arrivals for {args.duration:g} s per rate and round, {args.rounds} round(s) pooled "
        "(a fresh stack per mode and round, modes alternating which goes first), "
        "`max_new_tokens` log-uniform in "
        f"{low}..{high} (seed {args.seed} + round, the same requests for both modes), "
        "streamed (SSE); "
        "completion tokens from each result's `usage`; times from the scheduled arrival.",
        "",
        *table(runs),
        "",
        *machine(),
    ]
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, workdir: Path) -> list[Run]:
    """Each round, start one conveyor per mode in turn, drive it at every rate and stop it;
    each mode's rounds at a rate are pooled into one :class:`Run`.

    Round r draws its requests from seed ``args.seed + r`` (the same for every mode) and
    takes the modes in reverse order on odd rounds: on a shared machine the speed drifts
    by more than what is measured, and with both stacks up side by side the one started
    second came out slower whatever its mode (up to 3.7x in TTFT p50, static against
    static), so only one stack runs at a time.
    """
    pooled = {(mode, rate): Run(mode, rate, 0.0) for rate in args.rates for mode in args.modes}
    for round_ in range(args.rounds):
        order = args.modes if round_ % 2 == 0 else args.modes[::-1]
        for mode in order:
            with _stack(mode, args, workdir, round_) as server:
                for rate in args.rates:
                    requests = arrivals(rate, args.duration, args.seed + round_, args.tokens)
                    run = asyncio.run(drive(f"http://{HOST}:{server.port}", requests, mode, rate))
                    failed = [a.detail for a in run.answers if not a.ok][:3]
                    print(
                        f"round {round_ + 1}: {mode} at {rate:g}/s: {len(run.answers)} "
                        f"requests, {run.errors} errors {failed}, {run.tokens_per_s:,.0f} "
                        "tokens/s",
                        file=sys.stderr,
                    )
                    into = pooled[mode, rate]
                    into.seconds += run.seconds
                    into.answers.extend(run.answers)
    return list(pooled.values())


def _stack(
    mode: str, args: argparse.Namespace, workdir: Path, round_: int
) -> AbstractContextManager[ConveyorServer]:
    """A conveyor serving ``generate`` whose worker decodes in ``mode``."""
    options = Options(max_batch=args.max_batch, env={"CONVEYOR_DECODING": mode})
    log = f"generate-{mode}-{round_ + 1}"
    return conveyor([STAGE], options, workdir, log_name=log, name=mode, app=APP)


def _floats(value: str) -> list[float]:
    try:
        numbers = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list") from None
    if not numbers or any(not 0 < n < math.inf for n in numbers):
        raise argparse.ArgumentTypeError(f"{value!r}: every rate must be a positive number")
    return numbers


def _tokens(value: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not 'least,most'") from None
    if not 1 <= low <= high <= 512:
        raise argparse.ArgumentTypeError(f"{value!r}: need 1 <= least <= most <= 512")
    return low, high


def _modes(value: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    if not chosen or any(m not in MODES for m in chosen):
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {','.join(MODES)}")
    return chosen


@dataclass(frozen=True)
class Preset:
    """The loads of a run unless flags say otherwise.

    Attributes:
        rates: requests/s, one measurement each per mode.
        duration: seconds of arrivals per measurement.
        rounds: measurements per mode and rate, pooled.
    """

    rates: tuple[float, ...]
    duration: float
    rounds: int


QUICK = Preset((1.0, 2.0), 3.0, 1)
"""The smoke run (CI): light enough that neither mode queues much on a busy 2-core box."""
FULL = Preset((1.5, 3.0), 20.0, 2)
"""Moderate and heavy for static decoding of the tiny GPT-2 on 2 CPU cores: at 1.5/s its
batches rarely fill; at 3/s it runs close to what it can carry (at 4/s its queue grew
through the run and the gateway refused some requests, 503)."""


def _listed(rates: Sequence[float]) -> str:
    return ",".join(f"{r:g}" for r in rates)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add(
        "--rates",
        type=_floats,
        help=f"requests/s, comma-separated (default {_listed(FULL.rates)})",
    )
    add(
        "--duration",
        type=float,
        help=f"seconds of arrivals per rate (default {FULL.duration:g})",
    )
    add("--rounds", type=int, help=f"rounds, pooled (default {FULL.rounds})")
    add("--seed", type=int, default=31, help="fixes the requests (default 31)")
    add("--tokens", type=_tokens, default=(8, 400), help="max_new_tokens range (default 8,400)")
    add("--modes", type=_modes, default=list(MODES), help="static,continuous (default both)")
    add(
        "--max-batch",
        type=int,
        default=BUILTIN[STAGE].max_batch_size,
        help="the stage's max batch, sequences in flight (default the stage's own)",
    )
    add("--out", type=Path, help="also write the report to this file")
    add(
        "--quick",
        action="store_true",
        help=f"smoke run (CI): rates {_listed(QUICK.rates)}, {QUICK.duration:g} s each",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Measure and print the report."""
    if (argv := sys.argv[1:] if argv is None else argv)[:1] == ["prefix"]:
        from bench.generate_prefix import main as prefix  # it imports this module

        return prefix(argv[1:])
    args = parser().parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.rates = args.rates or list(preset.rates)
    args.duration = preset.duration if args.duration is None else args.duration
    args.rounds = preset.rounds if args.rounds is None else args.rounds
    if args.rounds < 1:
        parser().error("--rounds must be at least 1")
    if args.duration <= 0:
        parser().error("--duration must be positive")
    if args.max_batch < 1:
        parser().error("--max-batch must be at least 1")
    command = " ".join(["python -m bench.generate", *argv])
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-generate-"))
    print(f"process logs in {workdir}", file=sys.stderr)
    text = report(measure(args, workdir), args, command)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
