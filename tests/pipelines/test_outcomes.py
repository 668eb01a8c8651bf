"""One Outcome: the HTTP status, job status and stats field of each way a request ends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelines.envelope import Reply, decode_reply, dumps
from pipelines.errors import Cancelled, DeadlineExceeded
from pipelines.outcomes import CANCELLED, DONE, EXPIRED, FAILED, Outcome
from pipelines.records import JobField, job_finished

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("outcome", "http", "job", "field"),
    [
        (Outcome.OK, 200, DONE, "items:ok"),
        (Outcome.ERROR, 500, FAILED, "items:error"),
        (Outcome.EXPIRED, DeadlineExceeded.status, EXPIRED, "items:expired"),
        (Outcome.CANCELLED, Cancelled.status, CANCELLED, "items:cancelled"),
    ],
)
def test_each_outcome_knows_its_http_status_job_status_and_stats_field(
    outcome: Outcome, http: int, job: str, field: str
) -> None:
    assert (outcome.http_status, outcome.job_status, outcome.stats_field) == (http, job, field)
    ok = outcome is Outcome.OK
    reply = Reply(
        id="r",
        stage="s",
        outcome=outcome,
        result={"v": 1} if ok else None,
        error=None if ok else "why",
        status=200 if outcome is not Outcome.ERROR else 500,
    )
    # What crosses the wire is the plain value, read back as the Outcome.
    back = decode_reply(dumps(reply))
    assert back.outcome is outcome
    assert back.http_status == http
    assert job_finished(back)[JobField.STATUS] == job
    assert job_finished(back)[JobField.HTTP_STATUS] == str(http)


def test_an_error_answers_with_what_its_worker_mapped_it_to() -> None:
    reply = Reply(id="r", stage="s", outcome=Outcome.ERROR, error="busy", status=503)
    assert reply.http_status == 503
    assert job_finished(reply)[JobField.HTTP_STATUS] == "503"


def test_nobody_spells_a_stats_field_or_the_outcome_set_by_hand() -> None:
    # Issue 25: `items:<outcome>` was built in four modules and the outcomes listed in
    # three; pipelines/outcomes.py is the one home.
    spelled = re.compile(r"""["']items:|OUTCOMES\s*=|Literal\["ok", "error\"""")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("conveyor", "gateway", "pipelines", "workers")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "outcomes.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert found == []
