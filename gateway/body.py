"""Request bodies checked against what the envelope can carry, before anything else.

The body is parsed permissively (the standard library's parser keeps ``NaN``,
``Infinity`` and lone surrogates such as ``"\\ud800"`` as they are), so that
:func:`~pipelines.envelope.wire_problem` can refuse each of them with a 422 naming the
field, before pydantic or the queue ever see the value. Nesting past the parser's own
limit is refused as too deep.

An integer literal outside the 64-bit range the envelope carries exactly is read as the
nearest float, as JavaScript and most JSON parsers (orjson included) read it: JSON Schema
calls it a valid ``number``, so a ``number`` field takes it; a field declared ``integer``
refuses the float (422).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from pipelines.envelope import INT_RANGE, MAX_DEPTH, WireProblem, wire_problem


def problem_detail(problem: WireProblem, root: str = "body") -> dict[str, Any]:
    """A problem as one entry of a 422's ``detail`` list (FastAPI's shape)."""
    return {"loc": [root, *problem.loc], "msg": problem.msg, "type": problem.type}


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body, refused with a 422 where the envelope could not
    carry it.

    Raises:
        json.JSONDecodeError: not JSON (FastAPI answers 422 ``json_invalid``).
        HTTPException: 422 with FastAPI's ``detail`` list, naming the field.
    """
    try:
        value = json.loads(raw, parse_constant=float, parse_int=_integer)
    except RecursionError:
        problem = WireProblem((), f"nested deeper than {MAX_DEPTH} levels", "too_deep")
        raise HTTPException(422, [problem_detail(problem)]) from None
    except UnicodeDecodeError:
        problem = WireProblem((), "body is not valid UTF-8", "json_invalid")
        raise HTTPException(422, [problem_detail(problem)]) from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise
        # An integer literal of thousands of digits: Python refuses to convert it.
        problem = WireProblem((), str(exc).split(";")[0], "int_range")
        raise HTTPException(422, [problem_detail(problem)]) from None
    found = wire_problem(value)
    if found is not None:
        # HTTPException passes FastAPI's body reader untouched; any other exception there
        # would become a 400 without the field.
        raise HTTPException(422, [problem_detail(found)])
    return value


def _integer(literal: str) -> int | float:
    # Nineteen digits always fit in 64 bits; only longer literals need the range check.
    if len(literal) < 19:
        return int(literal)
    value = int(literal) if len(literal) < 4300 else None
    if value is not None and INT_RANGE[0] <= value <= INT_RANGE[1]:
        return value
    return float(literal)  # past ~1e308 it is infinite, which wire_problem refuses


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
