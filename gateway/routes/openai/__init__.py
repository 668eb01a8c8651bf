"""OpenAI-compatible routes: ``POST /v1/embeddings``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` (and ``GET /v1/models/{model}``).

``model`` names a pipeline: a one-step pipeline whose stage declares
``openai="embeddings"`` or ``openai="completions"`` (:data:`pipelines.stages.OpenAIKind`).
Each input becomes one request through :meth:`Gateway.call <gateway.service.Gateway.call>`
(or a streamed one, :func:`~gateway.routes.pipelines.open_stream`): the same admission,
lanes, deadlines, cancellation, API keys and limits as ``POST /v1/{name}``. Errors are
answered in OpenAI's shape.

One module each, imported one way (each only from those listed before it):

- :mod:`~gateway.routes.openai.errors`: the error shape, and which paths answer in it;
- :mod:`~gateway.routes.openai.wire`: the request bodies and how their fields are read;
- :mod:`~gateway.routes.openai.serving`: which pipeline serves a ``model``, the names
  checked at start, each item validated and run, usage counted;
- :mod:`~gateway.routes.openai.answers`: a completion's answer, whole or streamed (SSE);
- :mod:`~gateway.routes.openai.embeddings`: ``/v1/embeddings`` and ``/v1/models``;
- :mod:`~gateway.routes.openai.completions`: ``/v1/completions`` and
  ``/v1/chat/completions``.
"""

from fastapi import FastAPI

from gateway.routes.openai.completions import add_completion_routes
from gateway.routes.openai.embeddings import add_embedding_routes, add_model_routes
from gateway.service import Gateway


def add_openai_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> None:
    """Add the OpenAI-compatible routes.

    Args:
        app: the application.
        gw: the gateway that runs their requests.
        edge: the statuses the edge can answer first.
    """
    add_embedding_routes(app, gw, edge)
    add_completion_routes(app, gw, edge)
    add_model_routes(app, gw, edge)
