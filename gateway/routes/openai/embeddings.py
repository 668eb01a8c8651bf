"""``POST /v1/embeddings`` (each text one request to a stage marked
``openai="embeddings"``) and ``GET /v1/models`` (what these routes serve).

``usage.prompt_tokens`` is the sum of each text's ``prompt_tokens`` as the stage counted
them: a stage whose input has a ``usage`` flag (:class:`~pipelines.stages.EmbedIn`) is
asked for them. Where a result carries no count (a user stage without ``usage``), that text's
tokens are estimated (:func:`pipelines.tokens.estimate`).
"""

import base64
import struct
from typing import Annotated, Any

from fastapi.responses import Response
from pydantic import Field, TypeAdapter, ValidationError

from gateway.routes import json_response
from gateway.routes.openai.errors import Refused
from gateway.routes.openai.serving import Asked, Endpoint, checked, count, openai_kind, usage
from gateway.routes.openai.wire import EmbeddingsIn, texts, unsupported
from gateway.service import Gateway
from pipelines.errors import ItemFailed
from pipelines.graph import Pipeline
from pipelines.tokens import estimate


async def embeddings(asked: Asked, body: EmbeddingsIn) -> Response:
    """Answer ``POST /v1/embeddings``: each text one request."""
    inputs = texts(body.input, "input")
    unsupported(dimensions=body.dimensions is not None)
    ask = {"usage": True} if _counts(asked.pipeline) else {}
    payloads = [checked(asked.pipeline, {"text": t, **ask}, "input") for t in inputs]
    results = await asked.run_all(payloads)
    as_base64 = body.encoding_format == "base64"
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(r, as_base64)}
        for i, r in enumerate(results)
    ]
    tokens = sum(
        count(r, "prompt_tokens", estimate({"text": t}))
        for r, t in zip(results, inputs, strict=True)
    )
    answer = {"object": "list", "data": data, "model": body.model, "usage": usage(tokens)}
    return json_response(answer)


def model_routes(gw: Gateway) -> tuple[Endpoint, Endpoint]:
    """The endpoints of ``GET /v1/models`` and ``GET /v1/models/{name}``: the pipelines
    these routes serve, and one of them.

    Args:
        gw: the gateway whose pipelines they list.
    """

    async def models() -> Response:
        data = [_model(p) for p in gw.registry.pipelines.values() if openai_kind(p)]
        return json_response({"object": "list", "data": data})

    async def model(name: str) -> Response:
        pipeline = gw.registry.pipelines.get(name)
        if pipeline is None or not openai_kind(pipeline):
            raise Refused(
                f"the model {name!r} does not exist here", 404, "model", "model_not_found"
            )
        return json_response(_model(pipeline))

    return models, model


def _counts(pipeline: Pipeline) -> bool:
    """Whether the pipeline's stage counts a text's tokens when asked: its input has a
    ``usage`` flag (as :class:`~pipelines.stages.EmbedIn`)."""
    field = pipeline.input_model.model_fields.get("usage")
    return field is not None and field.annotation is bool


def _model(pipeline: Pipeline) -> dict[str, Any]:
    return {"id": pipeline.name, "object": "model", "created": 0, "owned_by": "conveyor"}


_VECTOR = TypeAdapter(list[Annotated[float, Field(strict=True, allow_inf_nan=False)]])
"""An embedding as a stage's reply must hold it: a list of finite numbers (ints taken as
floats; a bool, a string, a number past a float's range refused). Checked in one pass of
pydantic's core: a Python loop over a 384-float vector cost ~0.2 ms a text."""


def _vector(result: dict[str, Any], base64_: bool) -> list[float] | str:
    try:
        vector = _VECTOR.validate_python(result.get("embedding"))
    except ValidationError:
        raise ItemFailed(
            "the stage answered no embedding (a list of finite numbers)", status=502
        ) from None
    if base64_:  # OpenAI's: little-endian float32, base64
        try:
            packed = struct.pack(f"<{len(vector)}f", *vector)
        except OverflowError:  # finite, but past float32's range
            raise ItemFailed(
                "the stage answered an embedding past float32's range (base64)", status=502
            ) from None
        return base64.b64encode(packed).decode()
    return vector
