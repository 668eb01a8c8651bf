"""conveyor: what a user imports and runs.

The ``conveyor`` command (``python -m conveyor``) starts and supervises a stack, scales it,
replays dead letters and prints queue state; :class:`Client` and :class:`AsyncClient` call a
running gateway over HTTP.
"""

from conveyor.client import AsyncClient, Client, ConveyorHTTPError

__all__ = ["AsyncClient", "Client", "ConveyorHTTPError"]
