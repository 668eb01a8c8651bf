"""OpenAI-compatible routes: ``POST /v1/embeddings``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` (and ``GET /v1/models/{name}``).

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
  checked at start, a POST route's endpoint, each item validated and run, usage counted;
- :mod:`~gateway.routes.openai.answers`: a completion's answer, whole or streamed (SSE);
- :mod:`~gateway.routes.openai.embeddings`: the answers of ``/v1/embeddings`` and
  ``/v1/models``;
- :mod:`~gateway.routes.openai.completions`: the answers of ``/v1/completions`` and
  ``/v1/chat/completions``;

and every route is added here, from one table (:func:`add_openai_routes`).
"""

from typing import Any

from fastapi import FastAPI

from gateway.responses import declared
from gateway.routes.openai.completions import chat, completions
from gateway.routes.openai.embeddings import embeddings, model_routes
from gateway.routes.openai.errors import openai_errors, post_errors
from gateway.routes.openai.serving import Direct, posted
from gateway.routes.openai.wire import ChatIn, CompletionsIn, EmbeddingsIn
from gateway.service import Gateway
from gateway.share import Shares


def add_openai_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> dict[str, Direct[Any]]:
    """Add the OpenAI-compatible routes; returns the POST routes as the hot path answers
    them (:class:`~gateway.routes.openai.serving.Direct`), by path.

    Args:
        app: the application.
        gw: the gateway that runs their requests.
        edge: the statuses the edge can answer first.
    """
    sent, listed = post_errors(edge), declared(edge)
    models, model = model_routes(gw)
    # A stage's window, whichever route fills it; the share is the host's, split among
    # its gateway processes (each holds its own window).
    shares = Shares(gw.settings.request_share / gw.settings.gateways)
    posts = (
        ("/v1/embeddings", Direct(gw, shares, EmbeddingsIn, embeddings), "Embeddings"),
        ("/v1/completions", Direct(gw, shares, CompletionsIn, completions), "Completions"),
        ("/v1/chat/completions", Direct(gw, shares, ChatIn, chat), "Chat completions"),
    )
    for method, path, endpoint, summary, responses in (
        *(("POST", p, posted(d), s, sent) for p, d, s in posts),
        ("GET", "/v1/models", models, "Models", listed),
        ("GET", "/v1/models/{name}", model, "A model", {**listed, **openai_errors((404,))}),
    ):
        app.add_api_route(
            path,
            endpoint,
            methods=[method],
            summary=f"{summary} (OpenAI-compatible)",
            tags=["openai"],
            responses=responses,
        )
    return {path: direct for path, direct, _ in posts}
