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


def expected(path: str, method: str) -> set[int]:
    """The error statuses each kind of route can answer (besides 401 with keys on)."""
    if path in {"/healthz", "/readyz"}:
        return {413} | ({503} if path == "/readyz" else set())
    if path in {"/metrics"}:
        return {413}
    if path.startswith("/status"):
        return {413, 503}
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
