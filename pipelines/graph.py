"""Pipelines: named graphs of steps over stage streams.

A pipeline has a pydantic input model and steps. A step runs on a stage: a model stage
(batched, served by its own worker pool, shared by every pipeline that names it) or a
function stage (plain sync or async Python, private to its pipeline). Edges:

- chain: ``then="b"``;
- fan-out: ``then=("b", "c")``, into a join step that declares ``join=("b", "c")`` and
  runs once, when every branch has finished (the meeting is atomic in Redis);
- conditional: ``route=fn``, where ``fn(output, ctx)`` returns the next step's name, a
  tuple of names (fan-out), or [`End`][] to finish the request with a response.
  ``routes_to`` lists the names it may return, so the graph can be checked and drawn.

A request ends exactly once, so the graph is held to one rule, checked when the pipeline
is built (`pipelines.topology`): a step hands over to one step, or fans out to
exactly the branches of one join.

A step's input is built from the request's context: ``ctx["input"]`` is the validated
request and ``ctx[step]`` each finished step's output. By default a step takes the
output of the step before it (the request for the first step; for a join step, the
branch outputs by branch name). A step without a successor ends the request: its output
is the response.

The same definition drives the gateway (routes, OpenAPI schema, the first step) and the
workers (what to run, where each output goes next).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel

from pipelines import topology
from pipelines.errors import ConfigError, UnknownStage
from pipelines.stages import AnyIn, Stage

Context = dict[str, Any]
"""``{"input": request, <step>: output, ...}`` for one request."""

InputFn = Callable[[Context], dict[str, Any]]
RouteFn = Callable[[dict[str, Any], Context], "str | tuple[str, ...] | End"]


@dataclass(frozen=True)
class End:
    """Finish the request now with ``response`` (later steps never see it).

    Attributes:
        response: the JSON object the client receives (HTTP 200).
    """

    response: dict[str, Any]


@dataclass(frozen=True)
class Step:
    """One node of a pipeline.

    Attributes:
        name: unique within the pipeline; the key of its output in the context.
        stage: the stage that runs it.
        input: builds the step's input from the context (default: see module doc).
        then: the next step, or several (fan-out).
        route: picks the next step(s) or ends the request, from this step's output.
        routes_to: every name ``route`` may return.
        join: for a join step, the branches it waits for.
    """

    name: str
    stage: Stage
    input: InputFn | None = None
    then: tuple[str, ...] = ()
    route: RouteFn | None = None
    routes_to: tuple[str, ...] = ()
    join: tuple[str, ...] = ()

    @property
    def successors(self) -> tuple[str, ...]:
        """Every step this one may hand over to."""
        return self.then + self.routes_to


def _names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def model(
    name: str,
    stage: Stage,
    *,
    input: InputFn | None = None,
    then: str | Iterable[str] | None = None,
    route: RouteFn | None = None,
    routes_to: Iterable[str] = (),
) -> Step:
    """A step served by a (shared) model stage; see [`Step`][] for the arguments."""
    return Step(name, stage, input, _names(then), route, tuple(routes_to))


def function(
    name: str,
    fn: Callable[[dict[str, Any]], Any],
    *,
    input: InputFn | None = None,
    then: str | Iterable[str] | None = None,
    route: RouteFn | None = None,
    routes_to: Iterable[str] = (),
    join: Iterable[str] = (),
    max_batch_size: int = 32,
    batch_wait_ms: float = 0.0,
    max_backlog: int = 1024,
    concurrency: int = 16,
    setup: Callable[[], object] | None = None,
) -> Step:
    """A step running ``fn(input) -> dict`` (sync or async) on its own function stage.

    Each item is a call of its own (``concurrency`` at a time in one worker), answered as
    soon as it ends: one slow call holds only its own request. One that raises fails
    alone; one still running at its request's deadline, or when the request is
    cancelled, ends there (an async call is cancelled, a sync one's result dropped:
    `FunctionRunner`). The stage is named
    ``<pipeline>.<name>`` when the pipeline is built.
    ``setup`` runs once in each worker serving the step, when it starts: what it raises
    stops that worker there (check the step's settings, warm a client), not a request
    later. Other arguments: see [`Step`][] and [`Stage`][pipelines.stages.Stage].
    """
    stage = Stage(
        name,
        AnyIn,
        runner="workers.models.function:FunctionRunner",
        options={"fn": fn, "concurrency": concurrency, "setup": setup},
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        max_backlog=max_backlog,
        summary=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name,
        kind="function",
    )
    return Step(name, stage, input, _names(then), route, tuple(routes_to), tuple(join))


@dataclass(frozen=True)
class Pipeline:
    """A named graph of steps; the first step is the entry.

    Attributes:
        name: route name (``/v1/{name}``).
        input_model: pydantic model of a request.
        steps: the steps, entry first.
        summary: one line for the API docs.
        output_model: what its answer holds, for the API docs only (the answer is the
            last step's output, not validated against it); None: a JSON object.

    Raises:
        ConfigError: at construction, naming the step, for an unknown successor, a
            cycle, a join whose branches do not all lead to it (and only to it), a
            fan-out that is not exactly one join's branches, or a step that cannot be
            reached (see `pipelines.topology`).
    """

    name: str
    input_model: type[BaseModel]
    steps: tuple[Step, ...]
    summary: str = ""
    output_model: type[BaseModel] | None = None
    by_name: Mapping[str, Step] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError(f"pipeline {self.name!r} has no steps")
        Stage(self.name, AnyIn, runner="-")  # the same naming rule as stages
        steps = []
        for step in self.steps:
            if step.stage.kind == "function":
                # Function stages belong to their pipeline: one stream per pipeline step.
                step = replace(step, stage=replace(step.stage, name=f"{self.name}.{step.name}"))
            steps.append(step)
        object.__setattr__(self, "steps", tuple(steps))
        by_name: dict[str, Step] = {}
        for step in steps:
            if step.name in by_name or step.name == "input":
                raise ConfigError(f"pipeline {self.name!r}: step name {step.name!r} is taken")
            by_name[step.name] = step
        object.__setattr__(self, "by_name", by_name)
        topology.validate(f"pipeline {self.name!r}", by_name)

    @property
    def entry(self) -> Step:
        """The first step."""
        return self.steps[0]

    def step(self, name: str) -> Step:
        """The step called ``name``."""
        try:
            return self.by_name[name]
        except KeyError:
            raise UnknownStage(f"pipeline {self.name!r} has no step {name!r}") from None

    def branch_end(self, name: str) -> tuple[Step, str] | None:
        """Where the chain of steps starting at ``name`` meets a join: the join and the
        branch step that feeds it; None when it meets none (see
        `pipelines.topology.branch_end`)."""
        return topology.branch_end(self.by_name, name)

    def stages(self) -> list[Stage]:
        """The stages this pipeline's steps run on, each once."""
        seen: dict[str, Stage] = {}
        for step in self.steps:
            seen.setdefault(step.stage.name, step.stage)
        return list(seen.values())

    def input_of(self, step: Step, ctx: Context, previous: str | None) -> dict[str, Any]:
        """Build ``step``'s input from the context.

        Args:
            step: the step about to run.
            ctx: the request's context.
            previous: the step that handed over (None for the entry).
        """
        if step.input is not None:
            return step.input(ctx)
        if step.join:
            return {branch: ctx[branch] for branch in step.join}
        value: dict[str, Any] = ctx["input"] if previous is None else ctx[previous]
        return value

    def after(self, step: Step, output: dict[str, Any], ctx: Context) -> End | tuple[str, ...]:
        """Where the request goes once ``step`` produced ``output``.

        Returns:
            [`End`][] with the response, or the names of the next steps (empty: the
            output is the response).

        Raises:
            ConfigError: ``route`` returned a name outside ``routes_to``.
        """
        if step.route is None:
            return step.then
        choice = step.route(output, ctx)
        if isinstance(choice, End):
            return choice
        names = _names(choice)
        topology.check_choice(f"pipeline {self.name!r}", self.by_name, step, names)
        return names

    def describe(self) -> str:
        """A text drawing of the graph, one line per step."""
        lines = [f"pipeline {self.name} (input: {self.input_model.__name__})"]
        for step in self.steps:
            edges = []
            if step.then:
                edges.append(
                    ("-> " if len(step.then) == 1 else "fan-out -> ") + ", ".join(step.then)
                )
            if step.route is not None:
                edges.append("route -> " + " | ".join([*step.routes_to, "end"]))
            if step.join:
                edges.append("joins " + " + ".join(step.join))
            if not step.successors:
                edges.append("-> response")
            lines.append(
                f"  {step.name:<12} [{step.stage.kind} stage {step.stage.name}, batch<="
                f"{step.stage.max_batch_size}]  " + "; ".join(edges)
            )
        return "\n".join(lines)


def single(stage: Stage) -> Pipeline:
    """The one-step pipeline that serves ``stage`` under its own name."""
    return Pipeline(stage.name, stage.input_model, (model(stage.name, stage),), stage.summary)
