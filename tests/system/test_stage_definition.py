"""A worker whose stage definition differs from the one its group serves (issue 36,
lesser h): it refused half the requests the gateway had validated. Now it refuses to
start, naming the difference, while a worker of the recorded definition is live; a
redeploy (the old workers stopped) or the setting replaces the definition.

Real worker processes (``python -m workers``) and a real redis-server.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from pipelines.errors import ConfigError
from pipelines.stages import Stage
from runtime.definitions import agree_on_definition, definition, digest
from runtime.status import live_workers
from tests.helpers import Harness, NumberIn, until, wait_for_line
from tests.support.defsapp import FIRST, SECOND
from tests.support.faultapp import spawn, stop

APP = "tests.support.defsapp:"


def _worker(tmp_path: Path, variant: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{variant}-{len(list(tmp_path.iterdir()))}.log"
    return spawn("workers", "shape", log=log, CONVEYOR_APP=APP + variant, **env), log


async def _live(redis: aioredis.Redis, harness: Harness, n: int) -> None:
    async def enough() -> bool:
        return len(await live_workers(redis, harness.keys, "shape")) >= n

    await until(enough, 60)


@pytest.mark.timeout(120)
async def test_a_worker_of_another_definition_refuses_to_start_naming_the_difference(
    tmp_path: Path, harness: Harness, redis: aioredis.Redis
) -> None:
    # BREAK (issue 36, h): a worker started with another definition of a stage's name
    # joined its group unchecked and refused with 422 half of the requests the gateway
    # had validated. Now it exits (2) with one line naming what differs; the live worker
    # serves every request.
    first, first_log = _worker(tmp_path, "first")
    try:
        await _live(redis, harness, 1)
        other, other_log = _worker(tmp_path, "second")
        try:
            code = other.wait(timeout=60)
        finally:
            stop(other)
        said = other_log.read_text()
        assert code == 2, said
        lines = [line for line in said.splitlines() if "definition differs" in line]
        assert len(lines) == 1, said
        line = lines[0]
        assert "input field 'value'" in line, line
        assert "integer" in line, line
        assert "string" in line, line
        assert "CONVEYOR_REPLACE_STAGE_DEFINITION" in line, line
        # The same definition, its batching tuned apart, joins.
        tuned, tuned_log = _worker(tmp_path, "tuned")
        try:
            await _live(redis, harness, 2)
            assert tuned.poll() is None, tuned_log.read_text()
        finally:
            stop(tuned)
        http = await harness.gateway([FIRST])
        for value in range(6):
            resp = await http.post("/v1/shape", json={"value": value})
            assert resp.status_code == 200, resp.text
            assert resp.json() == {"value": 2 * value}
    finally:
        stop(first)
    assert first.returncode in (0, -15), first_log.read_text()


@pytest.mark.timeout(120)
async def test_a_redeploy_or_the_setting_replaces_the_definition(
    tmp_path: Path, harness: Harness, redis: aioredis.Redis
) -> None:
    # A deliberate change must stay possible: once no worker of the recorded definition
    # is live (all stopped), a worker of the new one replaces it; while one is, the
    # setting does.
    first, _ = _worker(tmp_path, "first")
    try:
        await _live(redis, harness, 1)
        forced, forced_log = _worker(tmp_path, "second", CONVEYOR_REPLACE_STAGE_DEFINITION="true")
        try:
            wait_for_line(forced_log, "definition replaced (by setting)", forced, limit_s=60)
            assert forced.poll() is None
        finally:
            stop(forced)
    finally:
        stop(first)
    # Now nothing is live: the old definition comes back, as a redeploy would.
    again, again_log = _worker(tmp_path, "first")
    try:
        wait_for_line(again_log, "no worker of the old one is live", again, limit_s=60)
        await _live(redis, harness, 1)
        assert again.poll() is None, again_log.read_text()
    finally:
        stop(again)


@pytest.mark.timeout(120)
async def test_a_gateway_with_another_definition_says_so_as_it_starts(
    tmp_path: Path, harness: Harness, redis: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The gateway validates with its own copy of a stage: one whose copy differs from
    # the definition the workers serve says so, naming the difference, as it starts.
    first, _ = _worker(tmp_path, "first")
    try:
        await _live(redis, harness, 1)
        await harness.gateway([SECOND])
    finally:
        stop(first)
    said = [r.getMessage() for r in caplog.records if "definition differs" in r.getMessage()]
    assert len(said) == 1, said
    assert "this gateway's definition" in said[0], said
    assert "input field 'value'" in said[0], said


def test_what_counts_as_another_definition() -> None:
    # The wire contract only: a docstring, a title or a field's description edited, or
    # the batching tuned, is the same definition; a field's type or the runner is not.
    class Doc(BaseModel):
        """Another docstring."""

        model_config = ConfigDict(extra="forbid")
        value: int = Field(description="a number", title="Value!")
        fail: bool = False

    same = [FIRST, Stage("shape", Doc, FIRST.runner, max_batch_size=3, batch_wait_ms=9)]
    assert len({digest(definition(s)) for s in same}) == 1
    other = [SECOND, Stage("shape", NumberIn, "tests.support.faultapp:Crashy")]
    assert len({digest(definition(s)) for s in [FIRST, *other]}) == 3


async def _beat(redis: aioredis.Redis, harness: Harness, consumer: str) -> None:
    seconds, micros = await redis.time()
    until_ms = int(seconds) * 1000 + int(micros) // 1000 + 60_000
    await redis.hset(harness.keys.alive("shape"), consumer, str(until_ms))


async def test_two_workers_starting_together_with_two_definitions_are_not_both_accepted(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Each beats before it checks (as a worker joins): the second to check sees the
    # first live, holding the definition it recorded, and is refused, whichever order
    # their checks run in; before, the second replaced the record (no beat yet) and
    # both served.
    await _beat(redis, harness, "a")
    await _beat(redis, harness, "b")
    await agree_on_definition(redis, harness.keys, FIRST, "a")
    with pytest.raises(ConfigError, match="definition differs"):
        await agree_on_definition(redis, harness.keys, SECOND, "b")


async def test_new_replicas_of_a_redeploy_agree_with_each_other(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # The old definition's workers are gone; two replicas of the new one start together
    # and each sees the other live: live workers of the *recorded* definition are what
    # refuse, so the first replaces it and the second agrees.
    await _beat(redis, harness, "old")
    await agree_on_definition(redis, harness.keys, FIRST, "old")
    await redis.hdel(harness.keys.alive("shape"), "old")
    await _beat(redis, harness, "new-1")
    await _beat(redis, harness, "new-2")
    await agree_on_definition(redis, harness.keys, SECOND, "new-1")
    await agree_on_definition(redis, harness.keys, SECOND, "new-2")
    raw = await redis.get(harness.keys.stage_definition("shape"))
    assert raw is not None
    assert digest(definition(SECOND)).encode() in raw
    holders = await redis.hgetall(harness.keys.definition_holders("shape"))
    assert set(holders) == {b"new-1", b"new-2"}  # the old one's entry dropped
    # An old worker still live keeps a third definition out.
    with pytest.raises(ConfigError, match="new-1, new-2"):
        await agree_on_definition(redis, harness.keys, FIRST, "third")
