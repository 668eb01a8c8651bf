"""A step's own ConveyorError reaches the client with its status and Retry-After, however
the subclass is written: through a real worker and the gateway."""

from __future__ import annotations

from typing import Any

from pipelines.errors import ConveyorError
from pipelines.graph import Pipeline, function
from pipelines.registry import Registry
from pipelines.stages import AnyIn
from tests.helpers import Harness


class QuotaExceeded(ConveyorError):
    """Written as user code often is: its defaults on the class, and an ``__init__`` that
    does not call ConveyorError's."""

    status = 429
    retry_after = 30

    def __init__(self, user: str) -> None:
        Exception.__init__(self, f"quota exceeded for {user}")


def over_quota(payload: dict[str, Any]) -> dict[str, Any]:
    raise QuotaExceeded(str(payload.get("user", "?")))


def ok(payload: dict[str, Any]) -> dict[str, Any]:
    return {"fine": True}


async def test_a_subclass_skipping_the_base_init_keeps_its_status_and_retry_after(
    harness: Harness,
) -> None:
    quota = Pipeline("quota", AnyIn, (function("limit", over_quota),))
    fine = Pipeline("fine", AnyIn, (function("pass", ok),))
    http = await harness.serve(Registry([quota, fine]))
    refused = await http.post("/v1/quota", json={"user": "bob"})
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "30"
    assert refused.json()["detail"] == "step 'quota.limit' failed: quota exceeded for bob"
    # The worker survived the item: the stage's next request, and another's, are answered.
    again = await http.post("/v1/quota", json={"user": "amy"})
    assert again.status_code == 429
    assert (await http.post("/v1/fine", json={})).json() == {"fine": True}


def test_retry_after_given_to_the_constructor_wins_over_the_class_default() -> None:
    assert ConveyorError("busy", retry_after=7).retry_after == 7
    assert ConveyorError("busy").retry_after is None
    assert QuotaExceeded("x").retry_after == 30
    assert QuotaExceeded("x").request_id is None
