"""The shape of a pipeline's graph: its joins and branches, and the rule that holds it.

A request ends exactly once, so the graph is held to one rule, checked when the pipeline
is built (:func:`validate`): a step hands over to one step, or fans out to exactly the
branches of one join (then every branch leads to that join and nowhere else, by ``then``,
never by a route that could end the request on the side). A route picks one of
``routes_to``, or all of one join's branches at once (a fan-out): ``routes_to`` holds
every branch of a join it names, and a choice that is neither one step nor one join's
branches fails the request (:func:`check_choice`).

Every function takes the pipeline's steps by name, entry first (``Pipeline.by_name``),
each seen as a :class:`Node`: what a step says of its edges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from pipelines.errors import ConfigError


class Node(Protocol):
    """A step as the graph's rule sees it (``pipelines.graph.Step`` is one)."""

    @property
    def name(self) -> str:
        """Its name, unique within the pipeline."""

    @property
    def then(self) -> tuple[str, ...]:
        """The step it hands over to, or several (a fan-out)."""

    @property
    def route(self) -> Callable[..., object] | None:
        """What picks its next step(s) instead, if anything."""

    @property
    def routes_to(self) -> tuple[str, ...]:
        """Every name its route may pick."""

    @property
    def join(self) -> tuple[str, ...]:
        """For a join, the branches it waits for."""

    @property
    def successors(self) -> tuple[str, ...]:
        """Every step it may hand over to."""


N = TypeVar("N", bound=Node)

Steps = Mapping[str, N]
"""A pipeline's steps by name, entry first."""


def join_of(steps: Steps[N], branch: str) -> N | None:
    """The join that ``branch`` is a branch of, if any."""
    return next((s for s in steps.values() if branch in s.join), None)


def branch_end(steps: Steps[N], name: str) -> tuple[N, str] | None:
    """Where the chain of steps starting at ``name`` meets a join: the join and the branch
    step that feeds it; None when it meets none. A branch may be several steps long
    (``b -> b2 -> join``), each handing over to one step by ``then``."""
    seen: set[str] = set()
    while name not in seen and name in steps:
        seen.add(name)
        join = join_of(steps, name)
        if join is not None:
            return join, name
        step = steps[name]
        if step.route is not None or len(step.then) != 1:
            return None
        name = step.then[0]
    return None


def fans_out_to_one_join(steps: Steps[Node], names: tuple[str, ...]) -> bool:
    """Whether ``names`` start exactly the branches of one join."""
    ends = [branch_end(steps, n) for n in names]
    if not ends or any(e is None for e in ends):
        return False
    joins = {e[0].name for e in ends if e is not None}
    join = steps[joins.pop()] if len(joins) == 1 else None
    return join is not None and sorted(e[1] for e in ends if e) == sorted(join.join)


def check_choice(where: str, steps: Steps[Node], step: Node, names: tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` unless ``names``, the choice of ``step``'s route, is
    among its ``routes_to`` and is one step or all the branches of one join."""
    unknown = [n for n in names if n not in step.routes_to]
    if unknown:
        raise ConfigError(
            f"{where}: route of {step.name!r} chose {unknown}, "
            f"not among routes_to {list(step.routes_to)}"
        )
    single = len(names) == 1 and join_of(steps, names[0]) is None
    if names and not single and not fans_out_to_one_join(steps, names):
        raise ConfigError(
            f"{where}: route of {step.name!r} chose {list(names)}: "
            "a route picks one step, or all the branches of one join at once"
        )


def validate(where: str, steps: Steps[Node]) -> None:
    """Raise :class:`ConfigError`, naming the step, for an unknown successor, a cycle, a
    join whose branches do not all lead to it (and only to it), a fan-out that is not
    exactly one join's branches, or a step that cannot be reached (see the module doc).

    Args:
        where: how errors name the pipeline.
        steps: its steps by name, entry first.
    """
    for step in steps.values():
        _check_edges(where, steps, step)
    for step in steps.values():
        _check_hand_over(where, steps, step)
    _check_acyclic_and_reachable(where, steps)


def _check_edges(where: str, steps: Steps[Node], step: Node) -> None:
    for succ in step.successors:
        if succ not in steps:
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
        if branch not in steps:
            raise ConfigError(f"{where}: join {step.name!r} waits for unknown {branch!r}")
        if steps[branch].then != (step.name,) or steps[branch].route:
            raise ConfigError(
                f"{where}: join {step.name!r} waits for {branch!r}, "
                f"which must lead to {step.name!r} and nowhere else (by then=, "
                "not a route: ending the request there would answer it twice)"
            )
    feeders = {s.name for s in steps.values() if step.name in s.successors}
    if step.join and feeders != set(step.join):
        raise ConfigError(
            f"{where}: join {step.name!r} is fed by {sorted(feeders)}, "
            f"but waits for {sorted(step.join)}"
        )


def _in_a_branch(steps: Steps[Node], name: str) -> bool:
    """Whether ``name`` is a step of some fan-out's branch (reached from a ``then``
    fan-out by single hand-overs; a route fans out to a join's branches only)."""
    for step in steps.values():
        fan = step.then if step.route is None else ()
        if len(fan) > 1 and fans_out_to_one_join(steps, fan):
            for start in fan:
                current: str | None = start
                while current is not None and join_of(steps, current) is None:
                    if current == name:
                        return True
                    nxt = steps[current].then
                    current = nxt[0] if len(nxt) == 1 else None
    return False


def _check_hand_over(where: str, steps: Steps[Node], step: Node) -> None:
    """A request ends once: a step hands over to one step, or to exactly the branches of
    one join (each of which meets the others there)."""
    if step.route is None:
        inside = len(step.then) == 1 and _in_a_branch(steps, step.name)
        split = len(step.then) > 1 or any(join_of(steps, n) for n in step.then)
        if split and not inside and not fans_out_to_one_join(steps, step.then):
            if len(step.then) == 1:
                join = join_of(steps, step.then[0])
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
        join = join_of(steps, name)
        if join is not None and not set(join.join) <= set(step.routes_to):
            raise ConfigError(
                f"{where}: route of {step.name!r} may choose {name!r}, a branch of join "
                f"{join.name!r}, so its routes_to must hold all of {list(join.join)} "
                "(chosen together, as a fan-out)"
            )


def _check_acyclic_and_reachable(where: str, steps: Steps[Node]) -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 1:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise ConfigError(f"{where}: cycle {cycle}")
        if state.get(name) == 2:
            return
        state[name] = 1
        for succ in steps[name].successors:
            visit(succ, [*path, name])
        state[name] = 2

    visit(next(iter(steps)), [])
    unreachable = [name for name in steps if name not in state]
    if unreachable:
        raise ConfigError(f"{where}: steps {unreachable} cannot be reached from the entry")
