"""Request bodies checked against what the envelope can carry, before anything else.

A body is parsed by orjson, the envelope's own codec, which refuses ``NaN``,
``Infinity``, lone surrogates (``"\\ud800"``), invalid UTF-8 and nesting past 1024; what
it admits is then held to :func:`~pipelines.envelope.wire_problem` (nesting past 64).
When orjson refuses, the body is parsed again permissively (the standard library keeps
those values as they are) only to name the field in the 422; a body neither parser
reads is FastAPI's own 422 ``json_invalid``.

An integer literal outside the 64-bit range the envelope carries exactly is read as the
nearest float, as JavaScript and orjson read it: JSON Schema calls it a valid ``number``,
so a ``number`` field takes it; a field declared ``integer`` refuses the float (422).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from gateway.responses import validation_issues
from pipelines.envelope import INT_RANGE, MAX_DEPTH, WireProblem, wire_problem


def problem_detail(problem: WireProblem, root: str = "body") -> dict[str, Any]:
    """A problem as one entry of a 422's ``detail`` list (FastAPI's shape; keys the
    client chose are clipped, so the input is never echoed back)."""
    issue = {"loc": [root, *problem.loc], "msg": problem.msg, "type": problem.type}
    return validation_issues([issue])[0]


def refuse(problem: WireProblem) -> HTTPException:
    """The 422 for ``problem``. An HTTPException passes FastAPI's body reader untouched;
    any other exception there would become a 400 without the field."""
    return HTTPException(422, [problem_detail(problem)])


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body, refused with a 422 where the envelope could not
    carry it.

    Raises:
        json.JSONDecodeError: not JSON (FastAPI answers 422 ``json_invalid``).
        HTTPException: 422 with FastAPI's ``detail`` list, naming the field.
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _located(raw) or exc from None
    problem = wire_problem(value)
    if problem is not None:
        raise refuse(problem)
    return value


def _located(raw: bytes) -> HTTPException | None:
    """The 422 naming what orjson refused, from a permissive parse; None when the body is
    not JSON at all."""
    try:
        value = json.loads(raw, parse_constant=float, parse_int=_integer)
    except RecursionError:
        return refuse(WireProblem((), f"nested deeper than {MAX_DEPTH} levels", "too_deep"))
    except UnicodeDecodeError:
        return refuse(WireProblem((), "body is not valid UTF-8", "json_invalid"))
    except ValueError:  # json.JSONDecodeError among them
        return None
    problem = wire_problem(value)
    return None if problem is None else refuse(problem)


def _integer(literal: str) -> int | float:
    # As orjson reads them: past the 64-bit range, the nearest float (infinite past ~1e308,
    # which wire_problem refuses). Python refuses int() of 4300 digits or more.
    value = int(literal) if len(literal) < 4300 else None
    if value is not None and INT_RANGE[0] <= value <= INT_RANGE[1]:
        return value
    return float(literal)


class WireRequest(Request):
    """A request whose JSON body is read by :func:`parse_body`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class WireRoute(APIRoute):
    """An API route whose handlers see :class:`WireRequest` bodies."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(WireRequest(request.scope, request.receive))

        return handle
