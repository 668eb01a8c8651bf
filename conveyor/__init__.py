"""conveyor: what a user imports and runs.

The ``conveyor`` command (``python -m conveyor``) starts and supervises a stack, scales it,
replays dead letters and prints queue state; :class:`Client` and :class:`AsyncClient` call a
running gateway over HTTP. The authoring API is here too: a pipeline is written with
``from conveyor import Pipeline, Stage, model, function, End`` (implemented in
:mod:`pipelines.graph` and :mod:`pipelines.stages`, the contract gateway and workers share).
"""

from conveyor.client import AsyncClient, Client, ConveyorHTTPError
from pipelines.graph import End, Pipeline, function, model, single
from pipelines.model import Item, Result
from pipelines.stages import BUILTIN, Stage, TextIn

__all__ = [
    "BUILTIN",
    "AsyncClient",
    "Client",
    "ConveyorHTTPError",
    "End",
    "Item",
    "Pipeline",
    "Result",
    "Stage",
    "TextIn",
    "function",
    "model",
    "single",
]
