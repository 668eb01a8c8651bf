"""The OpenAPI document declares every status each route can return, with its body."""

from __future__ import annotations

from typing import Any

import pytest

from pipelines.registry import load_registry
from tests.helpers import Harness

ERROR = {"$ref": "#/components/schemas/ErrorBody"}
INVALID = {"$ref": "#/components/schemas/ValidationErrorBody"}
FINISHED = {"$ref": "#/components/schemas/JobFinished"}
PIPELINE = {404, 408, 413, 422, 500, 502, 503, 504}
OPENAI = ("/v1/models", "/v1/embeddings", "/v1/completions", "/v1/chat/")
OPENAI_POSTS = {"/v1/embeddings", "/v1/completions", "/v1/chat/completions"}
OPENAI_ERRORS = {400, 404, 500, 502, 503, 504}  # the edge's 401, 408, 413: the gateway's


def expected(path: str, method: str) -> set[int]:
    """The error statuses each kind of route can answer (besides 401 with keys on)."""
    if path in {"/healthz", "/readyz"}:
        return {413} | ({503} if path == "/readyz" else set())
    if path in {"/metrics"}:
        return {413}
    if path.startswith("/status"):
        return {413, 503}
    if path == "/v1/models":
        return {413}
    if path == "/v1/models/{name}":
        return {404, 413}
    if path in OPENAI_POSTS:
        return {400, 404, 408, 413, 500, 502, 503, 504}
    if path == "/v1/jobs/{job_id}":
        return {404, 413, 422, 503} | ({409} if method == "delete" else set())
    if path.startswith("/v1/jobs/") or path.endswith("/stream"):
        return {408, 413, 422, 503}
    return PIPELINE - ({408} if method == "get" else set())


@pytest.mark.parametrize("keys", [[], ["k1"]])
async def test_every_route_declares_its_statuses_and_bodies(
    harness: Harness, keys: list[str]
) -> None:
    registry = load_registry(None, "echo,generate,chain,hello,wiki-summary")
    http = await harness.gateway(registry, api_keys=keys)
    doc: dict[str, Any] = (await http.get("/openapi.json", headers={"X-API-Key": "k1"})).json()
    schemas = doc["components"]["schemas"]
    assert set(schemas["ErrorBody"]["properties"]) == {"detail", "request_id"}
    assert schemas["ErrorBody"]["required"] == ["detail"]
    issue = schemas["ValidationIssue"]
    assert set(issue["required"]) == {"loc", "msg", "type"}
    assert "input" not in issue["properties"]
    seen = 0
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            seen += 1
            responses = op["responses"]
            codes = {int(c) for c in responses if not c.startswith("2")}
            want = expected(path, method)
            if keys and path not in {"/healthz", "/readyz"}:
                want |= {401}
                assert op["security"], path
            assert codes == want, (method, path)
            for code in codes:
                content = responses[str(code)]["content"]
                if path == "/readyz" and code == 503:
                    continue  # its own body: {"status": ...}
                body = {422: INVALID, 409: FINISHED}.get(code, ERROR)
                if path.startswith(OPENAI) and code in OPENAI_ERRORS:  # OpenAI's shape
                    body = {"$ref": "#/components/schemas/OpenAIErrorBody"}
                assert content == {"application/json": {"schema": body}}, (method, path, code)
            if path.endswith("/stream"):
                assert set(responses["200"]["content"]) == {"text/event-stream"}
            if path == "/v1/jobs/{job_id}":  # GET reads a job, DELETE cancels it: its view
                ref = responses["200"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/JobView"), method
            if path.startswith("/v1/jobs/") and method == "post":
                assert set(responses) & {"200", "202"} == {"202"}
                ref = responses["202"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/JobAccepted")
    assert seen >= 16
    finished = schemas["JobFinished"]
    assert set(finished["required"]) == {"detail", "job"}
    assert finished["properties"]["job"] == {"$ref": "#/components/schemas/JobView"}
    assert "cancelled" in schemas["JobView"]["properties"]["status"]["enum"]


async def test_a_pipeline_answer_has_its_schema_and_its_input_a_sensible_example(
    harness: Harness,
) -> None:
    http = await harness.gateway(load_registry(None, "chain,broadcast,hello,echo"))
    doc: dict[str, Any] = (await http.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]

    def answer(path: str) -> dict[str, Any]:
        ref = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        return dict(schemas[ref["schema"]["$ref"].rsplit("/", 1)[1]])

    # Issue 25: the 200 had an empty schema, and Swagger's example for chain was
    # {"value": -1e+300} (the lower bound) for want of an example.
    assert answer("/v1/chain")["properties"]["value"]["type"] == "number"
    assert answer("/v1/broadcast")["properties"]["results"]["type"] == "array"
    assert answer("/v1/hello")["required"] == ["message"]
    assert answer("/v1/echo")["type"] == "object"  # no output model: a JSON object
    assert schemas["ValueIn"]["properties"]["value"]["examples"] == [5]
    for name in ("ValueIn", "HelloIn"):
        model = schemas[name]
        for field in model["required"]:
            assert model["properties"][field].get("examples"), (name, field)


async def test_an_unknown_pipeline_is_a_json_404_naming_the_known_ones(harness: Harness) -> None:
    http = await harness.gateway(load_registry(None, "chain,hello"))
    for method, path in (
        ("POST", "/v1/nope"),
        ("GET", "/v1/nope"),
        ("POST", "/v1/nope/stream"),
        ("POST", "/v1/jobs/nope"),
    ):
        resp = await http.request(method, path, json={"value": 1})
        assert resp.status_code == 404, (method, path, resp.text)
        assert resp.headers["content-type"] == "application/json"
        body = resp.json()
        assert body["pipelines"] == ["chain", "hello"]
        assert "no pipeline 'nope'" in body["detail"]
        assert "chain, hello" in body["detail"]
    resp = await http.get("/no/such/path")  # not a pipeline's path: FastAPI's own 404
    assert resp.status_code == 404
    assert resp.json() == {"detail": "Not Found"}
