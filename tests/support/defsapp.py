"""One stage name, two definitions (``CONVEYOR_APP=tests.support.defsapp:first`` or
``:second``): the same name, ``shape``, with another input schema, as two apps (or two
versions of one) would define it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipelines.graph import Pipeline, single
from pipelines.stages import Stage
from tests.helpers import NumberIn


class WordIn(BaseModel):
    """``shape``'s input in the second definition: ``value`` is a string."""

    model_config = ConfigDict(extra="forbid")
    value: str


FIRST = Stage("shape", NumberIn, "tests.support.faultapp:Sleepy", batch_wait_ms=0)
first: list[Pipeline] = [single(FIRST)]
"""``shape`` on numbers (``value``: an integer)."""

SECOND = Stage("shape", WordIn, "tests.support.faultapp:Sleepy", batch_wait_ms=0)
second: list[Pipeline] = [single(SECOND)]
"""``shape`` on words (``value``: a string), its runner the same."""

tuned: list[Pipeline] = [
    single(Stage("shape", NumberIn, "tests.support.faultapp:Sleepy", max_batch_size=4))
]
"""``shape`` as :data:`first` defines it, its batching tuned apart (no other contract)."""
