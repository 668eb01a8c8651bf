"""The shared-prefix workload of the generate stage: prompt starts reused against prefilled
again (``python -m bench.generate prefix``).

``--requests`` requests share one long system prompt (about ``--system`` tokens of
sentences), each followed by a question of its own (one sentence), each asking for
``--max-new-tokens``; they come one every ``--gap`` seconds. Two measures, each with the
prefix cache on (``CONVEYOR_DECODE_PREFIX_CACHE_TOKENS`` at ``--cache-tokens``) and off
(``0``), the two alternating over ``--rounds`` rounds (pooled), since on a shared machine
the speed drifts by more than what is measured:

- **in process**, the decoder alone (``--model``, on the CPU): the requests join
  the running batch one at a time, ``--steps`` decoding steps apart; it counts the prompt
  tokens prefilled and times each join's prefill (the forward over what is not cached,
  the first token's pick, the join), the prefill time saved; and it checks that every
  answer is the same both ways (greedy);
- **over HTTP** (not with ``--no-http``): a conveyor (redis-server, the gateway, one
  ``generate`` worker decoding continuously) per setting, one at a time, the requests
  streamed on the schedule (``/v1/generate/stream``, as ``bench.generate`` sends them);
  time to first token p50 and latency p50 from each request's scheduled arrival.

It prints one Markdown section (``--out`` also writes it to a file). It reports; it does
not judge.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from bench.generate import APP, STAGE, Arrival, Run, drive
from bench.report import machine
from bench.systems import HOST, Options, conveyor
from bench.workloads import texts
from workers.settings import WorkerSettings

if TYPE_CHECKING:  # torch: imported once the arguments are good
    from transformers import PreTrainedTokenizerBase

    from workers.models.hf import Generator

SIDES = ("on", "off")


@dataclass
class Side:
    """One setting's in-process measures, pooled over rounds.

    Attributes:
        prefilled: prompt tokens the model ran.
        prompt_tokens: every prompt's tokens.
        prefill_s: each join's prefill, in seconds.
        answers: each request's new token ids, of the last round.
    """

    prefilled: int = 0
    prompt_tokens: int = 0
    prefill_s: list[float] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)


def requests(args: argparse.Namespace, count_tokens: PreTrainedTokenizerBase) -> list[Arrival]:
    """The workload: a system prompt of about ``args.system`` tokens (counted by
    ``count_tokens``, a tokenizer) shared by every request, each with its own question."""
    sentences = texts(args.requests + 400)
    questions, pool = sentences[: args.requests], sentences[args.requests :]
    system: list[str] = []
    while len(count_tokens(". ".join(system))["input_ids"]) < args.system:
        system.append(pool[len(system)])
    prompt = ". ".join(system)
    return [
        Arrival(i * args.gap, args.max_new_tokens, f"{prompt}. {question}?")
        for i, question in enumerate(questions)
    ]


def in_process(
    arrivals: list[Arrival], args: argparse.Namespace, generator: Generator
) -> dict[str, Side]:
    """Each setting's prefills of ``arrivals``, the decoder alone (see the module)."""
    sides = {side: Side() for side in SIDES}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            decoder = generator.continuous_decoder(1 << 30)
            assert decoder is not None, "the tiny GPT-2 decodes continuously"
            decoder.warm_up(2)
            decoder.share_prefixes(args.cache_tokens if side == "on" else 0)
            items = [{"text": a.text, "max_new_tokens": a.max_new_tokens} for a in arrivals]
            generations = [g for g in decoder.open(items) if not isinstance(g, BaseException)]
            into = sides[side]
            for generation in generations:
                started = time.perf_counter()
                decoder.prefill([generation])
                into.prefill_s.append(time.perf_counter() - started)
                for _ in range(args.steps):
                    decoder.advance()
            while decoder.rows:
                decoder.advance()
            prompts = sum(len(g.prompt) for g in generations)
            into.prompt_tokens += prompts
            into.prefilled += prompts if decoder.prefixes is None else decoder.prefixes.prefilled
            into.answers = [g.ids for g in generations]
    return sides


def over_http(
    arrivals: list[Arrival], args: argparse.Namespace, workdir: Path, folder: str | None
) -> dict[str, Run]:
    """Each setting's streamed answers to ``arrivals`` through a conveyor (see the module),
    its worker's model saved in ``folder`` (None: the built-in one)."""
    runs = {side: Run(side, 0.0, 0.0) for side in SIDES}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            tokens = args.cache_tokens if side == "on" else 0
            env = {
                "CONVEYOR_DECODING": "continuous",
                "CONVEYOR_DECODE_PREFIX_CACHE_TOKENS": str(tokens),
            }
            if folder is not None:
                env["CONVEYOR_MODELS"] = orjson.dumps({STAGE: folder}).decode()
            options = Options(env=env)
            log = f"generate-prefix-{side}-{round_ + 1}"
            with conveyor([STAGE], options, workdir, log_name=log, name=side, app=APP) as server:
                run = asyncio.run(drive(f"http://{HOST}:{server.port}", arrivals, side, 0.0))
            print(f"round {round_ + 1}: cache {side}: {run.errors} errors", file=sys.stderr)
            runs[side].seconds += run.seconds
            runs[side].answers.extend(run.answers)
    return runs


def generator_of(shape: str) -> tuple[Generator, str | None]:
    """The model, and the folder it is saved in (None: the built-in one): the built-in tiny
    GPT-2 (``tiny``: 2 layers, 32 wide, where a forward's fixed cost outweighs its tokens)
    or one of GPT-2 small's shape (``gpt2-small``: 12 layers, 768 wide, random weights,
    made from its config offline, the tiny one's tokenizer)."""
    import torch  # the model's imports: only once the arguments are good
    from transformers import GPT2Config, GPT2LMHeadModel

    from workers.models.hf import Generator

    tiny = Generator(model="tiny:generate", device="cpu", cache_dir=WorkerSettings().cache_dir)
    if shape == "tiny":
        return tiny, None
    folder = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpt2-small-"))
    torch.manual_seed(0)
    ids = tiny.model.config
    config = GPT2Config(
        vocab_size=ids.vocab_size,
        bos_token_id=ids.bos_token_id,
        eos_token_id=ids.eos_token_id,
        pad_token_id=ids.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    model.generation_config = tiny.model.generation_config
    model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return Generator(model=str(folder), device="cpu", cache_dir=str(folder)), str(folder)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def report(
    sides: dict[str, Side], runs: dict[str, Run] | None, args: argparse.Namespace, command: str
) -> str:
    """The Markdown section."""
    on, off = sides["on"], sides["off"]
    p50 = {side: statistics.median(sides[side].prefill_s) for side in SIDES}
    lines = [
        "## Shared prefix (generate, continuous decoding)",
        "",
        f"`{command}`: {args.requests} requests sharing a system prompt of "
        f"about {args.system} tokens, each with its own question, {args.max_new_tokens} new "
        f"tokens each, one every {args.gap:g} s; {args.rounds} rounds, cache on "
        f"(`CONVEYOR_DECODE_PREFIX_CACHE_TOKENS={args.cache_tokens}`) and off (`=0`) "
        f"alternating; the {args.model} model (`generator_of`). In process: the decoder alone, "
        f"{args.steps} steps between joins; HTTP: a conveyor.",
        "",
        "| prefix cache | prompt tokens prefilled | prefill p50 (one join) | TTFT p50 (HTTP) "
        "| latency p50 (HTTP) | errors |",
        "|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        got = sides[side]
        share = (
            f"{got.prefilled:,} of {got.prompt_tokens:,} ({got.prefilled / got.prompt_tokens:.0%})"
        )
        http = ["-", "-", "-"]
        if runs is not None:
            run = runs[side]
            http = [_ms(run.pct("ttft", 0.5)), _ms(run.pct("latency", 0.5)), str(run.errors)]
        lines.append(f"| {side} | {share} | {_ms(p50[side])} | {' | '.join(http)} |")
    saved = 1 - p50["on"] / p50["off"] if p50["off"] > 0 else 0.0
    lines += [
        "",
        f"Prefill time saved a join (p50): {_ms(p50['off'] - p50['on'])} ({saved:.0%}); "
        f"prompt tokens prefilled: {on.prefilled / max(off.prefilled, 1):.2f}x. Same greedy "
        f"answers both ways: {'yes' if on.answers == off.answers else 'NO'}.",
    ]
    if runs is not None:
        ratio = runs["on"].pct("ttft", 0.5) / runs["off"].pct("ttft", 0.5)
        lines.append(f"TTFT p50 over HTTP, on over off: {ratio:.2f}x.")
    lines += ["", *machine()]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench.generate prefix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--requests", type=int, default=16, help="requests sharing the prefix (default 16)")
    add("--system", type=int, default=384, help="system prompt tokens, about (default 384)")
    add("--max-new-tokens", type=int, default=8, help="new tokens a request (default 8)")
    add("--gap", type=float, default=0.25, help="seconds between requests (default 0.25)")
    add("--steps", type=int, default=2, help="in process: steps between joins (default 2)")
    add("--rounds", type=int, default=2, help="rounds, pooled (default 2)")
    add(
        "--cache-tokens",
        type=int,
        default=WorkerSettings().decode_prefix_cache_tokens,
        help="the cache's bound when on (default the setting's default)",
    )
    add(
        "--model",
        choices=("tiny", "gpt2-small"),
        default="tiny",
        help="the model (see generator_of; default tiny)",
    )
    add("--no-http", action="store_true", help="the in-process measure only")
    add("--out", type=Path, help="also write the section to this file")
    return p


def main(argv: list[str]) -> None:
    """Measure and print the section."""
    args = parser().parse_args(argv)
    if min(args.requests, args.system, args.max_new_tokens, args.rounds, args.cache_tokens) < 1:
        parser().error("--requests, --system, --max-new-tokens, --rounds, --cache-tokens: >= 1")
    if args.gap < 0 or args.steps < 0:
        parser().error("--gap and --steps must not be negative")
    generator, folder = generator_of(args.model)
    arrivals = requests(args, generator.tokenizer)
    command = " ".join(["python -m bench.generate prefix", *argv])
    sides = in_process(arrivals, args, generator)
    runs = None
    if not args.no_http:
        workdir = Path(tempfile.mkdtemp(prefix="conveyor-bench-prefix-"))
        print(f"process logs in {workdir}", file=sys.stderr)
        runs = over_http(arrivals, args, workdir, folder)
    text = report(sides, runs, args, command)
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
