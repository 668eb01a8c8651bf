"""Pipelines: named graphs of steps over stage streams.

A pipeline has a pydantic input model and steps. A step runs on a stage: a model stage
(batched, served by its own worker pool, shared by every pipeline that names it) or a
function stage (plain sync or async Python, private to its pipeline). Edges:

- chain: ``then="b"``;
- fan-out: ``then=("b", "c")``, into a join step that declares ``join=("b", "c")`` and
  runs once, when every branch has finished (the meeting is atomic in Redis);
- conditional: ``route=fn``, where ``fn(output, ctx)`` returns the next step's name, a
  tuple of names (fan-out), or :class:`End` to finish the request with a response.
  ``routes_to`` lists the names it may return, so the graph can be checked and drawn.

A request ends exactly once, so the graph is held to one rule, checked when the pipeline
is built: a step hands over to one step, or fans out to exactly the branches of one join
(then every branch leads to that join and nowhere else, by ``then``, never by a route
that could end the request on the side). A route picks one of ``routes_to``, or all of one
join's branches at once (a fan-out): ``routes_to`` holds every branch of a join it names,
and a choice that is neither one step nor one join's branches fails the request.

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
    """A step served by a (shared) model stage; see :class:`Step` for the arguments."""
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
) -> Step:
    """A step running ``fn(input) -> dict`` (sync or async) on its own function stage.

    Items of a batch run concurrently (``concurrency`` at a time); one that raises
    fails alone. The stage is named ``<pipeline>.<name>`` when the pipeline is built.
    Other arguments: see :class:`Step` and :class:`~pipelines.stages.Stage`.
    """
    stage = Stage(
        name,
        AnyIn,
        runner="workers.models.function:FunctionRunner",
        options={"fn": fn, "concurrency": concurrency},
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        max_backlog=max_backlog,
        summary=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name,
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

    Raises:
        ConfigError: at construction, naming the step, for an unknown successor, a
            cycle, a join whose branches do not all lead to it (and only to it), a
            fan-out that is not exactly one join's branches, or a step that cannot be
            reached (see the module doc).
    """

    name: str
    input_model: type[BaseModel]
    steps: tuple[Step, ...]
    summary: str = ""
    by_name: Mapping[str, Step] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError(f"pipeline {self.name!r} has no steps")
        Stage(self.name, AnyIn, runner="-")  # the same naming rule as stages
        steps = []
        for step in self.steps:
            if step.stage.runner == "workers.models.function:FunctionRunner":
                # Function stages belong to their pipeline: one stream per pipeline step.
                stage = replace(step.stage, name=f"{self.name}.{step.name}")
                step = Step(step.name, stage, step.input, step.then, step.route,
                            step.routes_to, step.join)  # fmt: skip
            steps.append(step)
        object.__setattr__(self, "steps", tuple(steps))
        by_name: dict[str, Step] = {}
        for step in steps:
            if step.name in by_name or step.name == "input":
                raise ConfigError(f"pipeline {self.name!r}: step name {step.name!r} is taken")
            by_name[step.name] = step
        object.__setattr__(self, "by_name", by_name)
        self._validate()

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

    def _validate(self) -> None:
        where = f"pipeline {self.name!r}"
        for step in self.steps:
            for succ in step.successors:
                if succ not in self.by_name:
                    raise ConfigError(f"{where}: step {step.name!r} leads to unknown {succ!r}")
            if step.route is None and step.routes_to:
                raise ConfigError(f"{where}: step {step.name!r} has routes_to but no route")
            if step.route is not None and step.then:
                raise ConfigError(
                    f"{where}: step {step.name!r} has both then and route; "
                    "its route picks the next step (list them in routes_to)"
                )
            if len(set(step.join)) != len(step.join):
                raise ConfigError(f"{where}: join {step.name!r} names a branch twice")
            for branch in step.join:
                if branch not in self.by_name:
                    raise ConfigError(f"{where}: join {step.name!r} waits for unknown {branch!r}")
                if self.by_name[branch].then != (step.name,) or self.by_name[branch].route:
                    raise ConfigError(
                        f"{where}: join {step.name!r} waits for {branch!r}, "
                        f"which must lead to {step.name!r} and nowhere else (by then=, "
                        "not a route: ending the request there would answer it twice)"
                    )
            feeders = {s.name for s in self.steps if step.name in s.successors}
            if step.join and feeders != set(step.join):
                raise ConfigError(
                    f"{where}: join {step.name!r} is fed by {sorted(feeders)}, "
                    f"but waits for {sorted(step.join)}"
                )
        for step in self.steps:
            self._check_hand_over(where, step)
        self._check_acyclic_and_reachable(where)

    def _join_of(self, branch: str) -> Step | None:
        """The join that ``branch`` is a branch of, if any."""
        return next((s for s in self.steps if branch in s.join), None)

    def branch_end(self, name: str) -> tuple[Step, str] | None:
        """Where the chain of steps starting at ``name`` meets a join: the join and the
        branch step that feeds it; None when it meets none. A branch may be several
        steps long (``b -> b2 -> join``), each handing over to one step by ``then``."""
        seen: set[str] = set()
        while name not in seen and name in self.by_name:
            seen.add(name)
            join = self._join_of(name)
            if join is not None:
                return join, name
            step = self.by_name[name]
            if step.route is not None or len(step.then) != 1:
                return None
            name = step.then[0]
        return None

    def _fans_out_to_one_join(self, names: tuple[str, ...]) -> bool:
        ends = [self.branch_end(n) for n in names]
        if not ends or any(e is None for e in ends):
            return False
        joins = {e[0].name for e in ends if e is not None}
        join = self.by_name[joins.pop()] if len(joins) == 1 else None
        return join is not None and sorted(e[1] for e in ends if e) == sorted(join.join)

    def _in_a_branch(self, name: str) -> bool:
        """Whether ``name`` is a step of some fan-out's branch (reached from a ``then``
        fan-out by single hand-overs; a route fans out to a join's branches only)."""
        for step in self.steps:
            fan = step.then if step.route is None else ()
            if len(fan) > 1 and self._fans_out_to_one_join(fan):
                for start in fan:
                    current: str | None = start
                    while current is not None and self._join_of(current) is None:
                        if current == name:
                            return True
                        nxt = self.by_name[current].then
                        current = nxt[0] if len(nxt) == 1 else None
        return False

    def _check_hand_over(self, where: str, step: Step) -> None:
        """A request ends once: a step hands over to one step, or to exactly the
        branches of one join (each of which meets the others there)."""
        if step.route is None:
            inside = len(step.then) == 1 and self._in_a_branch(step.name)
            split = len(step.then) > 1 or any(self._join_of(n) for n in step.then)
            if split and not inside and not self._fans_out_to_one_join(step.then):
                if len(step.then) == 1:
                    join = self._join_of(step.then[0])
                    assert join is not None
                    raise ConfigError(
                        f"{where}: step {step.name!r} leads to {step.then[0]!r} alone, a "
                        f"branch of join {join.name!r}, which would wait forever for the "
                        f"others; fan out to all of {list(join.join)}"
                    )
                raise ConfigError(
                    f"{where}: step {step.name!r} fans out to {list(step.then)}, which must "
                    "be exactly the branches of one join (join=...): each branch that "
                    "finished on its own would answer the request again"
                )
            return
        for name in step.routes_to:
            join = self._join_of(name)
            if join is not None and not set(join.join) <= set(step.routes_to):
                raise ConfigError(
                    f"{where}: route of {step.name!r} may choose {name!r}, a branch of join "
                    f"{join.name!r}, so its routes_to must hold all of {list(join.join)} "
                    "(chosen together, as a fan-out)"
                )

    def _check_acyclic_and_reachable(self, where: str) -> None:
        state: dict[str, int] = {}  # 1: on the current path, 2: done

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == 1:
                cycle = " -> ".join([*path[path.index(name) :], name])
                raise ConfigError(f"{where}: cycle {cycle}")
            if state.get(name) == 2:
                return
            state[name] = 1
            for succ in self.by_name[name].successors:
                visit(succ, [*path, name])
            state[name] = 2

        visit(self.entry.name, [])
        unreachable = [s.name for s in self.steps if s.name not in state]
        if unreachable:
            raise ConfigError(f"{where}: steps {unreachable} cannot be reached from the entry")

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
            :class:`End` with the response, or the names of the next steps (empty: the
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
        unknown = [n for n in names if n not in step.routes_to]
        if unknown:
            raise ConfigError(
                f"pipeline {self.name!r}: route of {step.name!r} chose {unknown}, "
                f"not among routes_to {list(step.routes_to)}"
            )
        single = len(names) == 1 and self._join_of(names[0]) is None
        if names and not single and not self._fans_out_to_one_join(names):
            raise ConfigError(
                f"pipeline {self.name!r}: route of {step.name!r} chose {list(names)}: "
                "a route picks one step, or all the branches of one join at once"
            )
        return names

    def describe(self) -> str:
        """A text drawing of the graph, one line per step."""
        lines = [f"pipeline {self.name} (input: {self.input_model.__name__})"]
        for step in self.steps:
            kind = "function" if step.stage.name.startswith(self.name + ".") else "model"
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
                f"  {step.name:<12} [{kind} stage {step.stage.name}, batch<="
                f"{step.stage.max_batch_size}]  " + "; ".join(edges)
            )
        return "\n".join(lines)


def single(stage: Stage) -> Pipeline:
    """The one-step pipeline that serves ``stage`` under its own name."""
    return Pipeline(stage.name, stage.input_model, (model(stage.name, stage),), stage.summary)
