"""Async jobs: ``POST /v1/jobs/{pipeline}`` queues one (202); ``GET /v1/jobs/{id}`` reads it;
``DELETE /v1/jobs/{id}`` cancels it."""

from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import Scope

from gateway.edge import principal
from gateway.headers import Sent, sent_on
from gateway.responses import JobAccepted, JobView, declared
from gateway.routes import BODY_ERRORS, json_response
from gateway.service import Gateway
from pipelines.graph import Pipeline
from pipelines.outcomes import QUEUED
from pipelines.records import JobField

JobId = Annotated[str, Path(max_length=128)]


def add_job_routes(app: FastAPI, gw: Gateway, edge: list[int]) -> None:
    """Route reading a job, and submitting one to each of ``gw``'s pipelines.

    Args:
        app: the application to add the routes to.
        gw: the gateway that queues and reads the jobs.
        edge: the statuses the edge can answer first (413, and 401 with API keys on).
    """

    @app.get(
        "/v1/jobs/{job_id}",
        tags=["jobs"],
        response_model=JobView,
        responses=declared([*edge, 404, 422, 503]),
    )
    async def job(request: Request, job_id: JobId) -> Response:
        """An async job: ``queued``, or ``done`` with the result the sync call returns, or
        ``failed`` / ``expired`` / ``cancelled`` with the error. Only the API key that
        submitted it (or, with keys off, no key) can read it; to any other it is 404, like
        an unknown id."""
        return json_response(await gw.job(job_id, principal(request.scope)))

    @app.delete(
        "/v1/jobs/{job_id}",
        tags=["jobs"],
        response_model=JobView,
        responses=declared([*edge, 404, 409, 422, 503]),
    )
    async def cancel(request: Request, job_id: JobId) -> Response:
        """Cancel an async job: no stage starts it any more, and a batch already running
        it discards its output. Answers the job, ``cancelled`` (its ``http_status`` 499);
        409 if it had already finished (done, failed, expired, or cancelled before), with
        the job as it is under ``job``. Only the job's owner may cancel it; to any other
        it is 404, as for ``GET``."""
        cancelled, view = await gw.cancel_job(job_id, principal(request.scope))
        if cancelled:
            return json_response(view)
        detail = f"job {job_id!r} has already finished ({view[JobField.STATUS]})"
        body = {"detail": detail, "request_id": job_id, "job": view}
        return json_response(body, 409, {"X-Request-Id": job_id})

    for pipeline in gw.registry.pipelines.values():
        _add_submit_route(app, gw, pipeline, edge)


def submission_path(pipeline: str) -> str:
    """Where a job of ``pipeline`` is submitted (``POST``)."""
    return f"/v1/jobs/{pipeline}"


async def submit_job(
    gw: Gateway, pipeline: Pipeline, data: dict[str, Any], sent: Sent, scope: Scope
) -> Response:
    """Queue a job of ``pipeline`` (its validated input ``data``), owned by the caller
    the edge named in ``scope``: its 202, as the route answers it and the hot path
    (:mod:`gateway.fastpath`) too.

    Raises:
        ConveyorError: refused, as :meth:`Gateway.enqueue` refuses (nothing was queued).
    """
    request = await gw.enqueue(pipeline, data, sent, job=True, owner=principal(scope))
    location = f"/v1/jobs/{request.id}"
    body = {JobField.ID: request.id, JobField.STATUS: QUEUED, "url": location}
    return json_response(body, 202, {"Location": location, "X-Request-Id": request.id})


def _add_submit_route(app: FastAPI, gw: Gateway, pipeline: Pipeline, edge: list[int]) -> None:
    async def submit(
        http: Request, payload: BaseModel, sent: Annotated[Sent, sent_on("job")]
    ) -> Response:
        return await submit_job(gw, pipeline, payload.model_dump(mode="json"), sent, http.scope)

    submit.__annotations__["payload"] = Annotated[pipeline.input_model, Body()]
    app.add_api_route(
        submission_path(pipeline.name),
        submit,
        methods=["POST"],
        status_code=202,
        tags=["jobs"],
        summary=f"Submit an async {pipeline.name} job",
        name=f"job_{pipeline.name}",
        response_model=JobAccepted,
        responses=declared([*edge, *BODY_ERRORS, 503]),
    )
