"""Pipelines end to end: chain, fan-out/join, routing, and the graph's validation."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from pipelines.builtin import ADDER, MULTIPLIER, ValueIn, builtin_pipelines
from pipelines.envelope import Request, decode_replies, decode_request, encode
from pipelines.errors import ConfigError
from pipelines.graph import End, Pipeline, function, model
from pipelines.keys import GROUP
from pipelines.registry import Registry
from pipelines.settings import CommonSettings
from runtime.redisio import RedisClock, connect, ensure_group
from tests.helpers import Harness, until
from workers.plan import Call
from workers.publish import publish
from workers.route import Router
from workers.values import Outbox


def builtins(*names: str) -> Registry:
    return Registry(builtin_pipelines()).select(names)


async def test_chain_adds_then_multiplies(harness: Harness) -> None:
    http = await harness.serve(builtins("chain"))
    resp = await http.post("/v1/chain", json={"value": 5})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"value": 12}


async def test_broadcast_lists_both_outputs(harness: Harness) -> None:
    http = await harness.serve(builtins("broadcast"))
    resps = await asyncio.gather(
        *(http.post("/v1/broadcast", json={"value": v}) for v in range(20))
    )
    assert [r.json() for r in resps] == [
        {"results": [{"value": v + 1}, {"value": v * 2}]} for v in range(20)
    ]


async def test_shared_model_stage_is_one_stream(harness: Harness) -> None:
    registry = builtins("chain", "broadcast")
    assert registry.stages["adder"] is ADDER  # one stage, one stream, one worker pool
    http = await harness.serve(registry)
    assert (await http.post("/v1/chain", json={"value": 1})).json() == {"value": 4}
    assert (await http.post("/v1/broadcast", json={"value": 1})).status_code == 200
    assert (await harness.stats("adder"))["items:ok"] == 2


@pytest.mark.parametrize(
    ("language", "message"),
    [("spanish", "Hola Ada"), ("French", "Bonjour Ada"), ("klingon", "Please try again.")],
)
async def test_hello_routes_by_language(harness: Harness, language: str, message: str) -> None:
    http = await harness.serve(builtins("hello"))
    resp = await http.post("/v1/hello", json={"language": language, "name": "Ada"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"message": message}


async def test_a_request_ended_early_never_reaches_later_steps(harness: Harness) -> None:
    http = await harness.serve(builtins("hello"))
    for _ in range(3):
        await http.post("/v1/hello", json={"language": "klingon", "name": "x"})
    await http.post("/v1/hello", json={"language": "french", "name": "x"})
    assert (await harness.stats("hello.detect"))["items:ok"] == 4
    assert (await harness.stats("hello.french"))["items:ok"] == 1
    assert await harness.stats("hello.spanish") == {}


def _boom(payload: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("branch exploded")


def _failing_fanout() -> Registry:
    return Registry(
        [
            Pipeline(
                "fragile",
                ValueIn,
                (
                    function("start", lambda p: p, then=("good", "bad")),
                    model("good", ADDER, then="join"),
                    function("bad", _boom, then="join"),
                    function("join", lambda p: p, join=("good", "bad")),
                ),
            )
        ]
    )


async def test_branch_error_ends_the_request_and_join_never_fires(
    harness: Harness, redis: aioredis.Redis
) -> None:
    http = await harness.serve(_failing_fanout())
    resp = await http.post("/v1/fragile", json={"value": 1})
    assert resp.status_code == 500
    assert "branch exploded" in resp.json()["detail"]
    assert "Traceback" not in resp.text
    # the good branch finishes too (maybe after the answer), but the join never runs

    async def good_branch_done() -> bool:
        return (await harness.stats("adder")).get("items:ok") == 1

    await until(good_branch_done)
    assert await redis.xlen(harness.keys.stage_stream("fragile.join")) == 0


def _boom_too(payload: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("the other branch exploded too")


async def test_both_branches_failing_answer_the_request_once(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # Each failing branch ends the request; between them they answer it once (the first
    # to publish), and each stage counts the error it had: one items:error per stage.
    steps = (
        function("start", lambda p: p, then=("left", "right")),
        function("left", _boom, then="join"),
        function("right", _boom_too, then="join"),
        function("join", lambda p: p, join=("left", "right")),
    )
    registry = Registry([Pipeline("doomed", ValueIn, steps)])
    replies = harness.keys.reply_stream("test")
    req = Request(
        id=uuid.uuid4().hex,
        pipeline="doomed",
        stage="doomed.start",
        step="start",
        payload={"value": 1},
        state={"input": {"value": 1}},
        deadline=time.time() + 60,
        reply_to=replies,
    )
    await redis.xadd(harness.keys.stage_stream("doomed.start"), encode(req))
    workers = {
        step: harness.worker(registry.stage(f"doomed.{step}"), registry=registry)
        for step in ("start", "left", "right")
    }
    await workers["start"].run(burst=True)
    (right,) = await redis.xrange(harness.keys.stage_stream("doomed.right")) or []
    await workers["left"].run(burst=True)
    await workers["right"].run(burst=True)
    # the right branch run again (a slow worker and the one that reclaimed it)
    again = decode_request(right[1] or {})
    await redis.xadd(harness.keys.stage_stream("doomed.right"), encode(again))
    await workers["right"].run(burst=True)

    got = [one for _, f in await redis.xrange(replies) or [] for one in decode_replies(f or {})]
    assert [(r.id, r.outcome, r.status) for r in got] == [(req.id, "error", 500)]
    assert "branch exploded" in (got[0].error or "")  # the first to fail answered
    for stage in ("doomed.left", "doomed.right"):
        items = {k: v for k, v in (await harness.stats(stage)).items() if k.startswith("items:")}
        assert items == {"items:error": 1}, (stage, items)
    assert (await harness.stats("doomed.start"))["items:ok"] == 1
    assert await redis.xlen(harness.keys.stage_stream("doomed.join")) == 0


async def test_join_fires_exactly_once_under_concurrent_arrivals(
    harness: Harness, redis: aioredis.Redis
) -> None:
    registry = builtins("broadcast")
    pipeline = registry.pipeline("broadcast")
    settings = CommonSettings()
    router = Router(registry, settings.keys, "adder")
    requests = [
        Request(
            id=f"r{i}",
            pipeline="broadcast",
            stage="adder",
            step=step,
            payload={"value": i},
            state={"input": {"value": i}, "start": {"value": i}},
            deadline=9e9,
            reply_to=settings.keys.reply_stream("t"),
        )
        for i in range(200)
        for step in ("add", "multiply")
    ]
    clients = [connect(settings) for _ in range(2)]

    async def arrive(req: Request, client: aioredis.Redis) -> None:
        out = Outbox()
        router.succeed(out, req, {"value": 0}, now=0.0)
        assert [len(e.joins) for e in out.effects.values()] == [1]
        token = harness.keys.publish_token(uuid.uuid4().hex)
        call = Call(out, {}, "unused-stats", {}, token, reply_maxlen=1000, reply_ttl_s=60)
        await publish(client, call)

    # both branches of each request land at the same moment, over two connections
    await asyncio.gather(*(arrive(r, clients[i % 2]) for i, r in enumerate(requests)))
    stream = harness.keys.stage_stream(pipeline.step("collect").stage.name)
    assert await redis.xlen(stream) == 200
    # and a late duplicate arrival (a branch run twice) does not fire it again
    await arrive(requests[0], clients[0])
    assert await redis.xlen(stream) == 200
    for c in clients:
        await c.aclose()


async def test_deadline_travels_through_every_stage(harness: Harness) -> None:
    registry = builtins("chain")
    add = harness.worker(ADDER, registry=registry)
    await add.start()
    harness.run(add)  # no multiplier worker: the request waits at step 2
    http = await harness.gateway(registry)
    resp = await http.post("/v1/chain", json={"value": 1}, headers={"X-Conveyor-Timeout": "1.5"})
    assert resp.status_code == 504
    entries = await harness.redis.xrange(harness.keys.stage_stream("multiplier"))
    (entry,) = entries or []
    forwarded = decode_request(entry[1] or {})
    assert forwarded.step == "multiply"
    assert forwarded.state["add"] == {"value": 2.0}
    (first,) = await harness.redis.xrange(harness.keys.stage_stream("adder")) or []
    assert forwarded.deadline == decode_request(first[1] or {}).deadline
    # the worker of step 2 finds it expired and does not run it
    mult = harness.worker(MULTIPLIER, registry=registry)
    await mult.run(burst=True)
    assert (await harness.stats("multiplier")).get("items:expired") == 1


def _route_nowhere(output: dict[str, Any], ctx: dict[str, Any]) -> str | End:
    return "nowhere"


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ((function("a", lambda p: p, then="b"),), "leads to unknown 'b'"),
        (
            (function("a", lambda p: p, then="b"), function("b", lambda p: p, then="a")),
            "cycle a -> b -> a",
        ),
        (
            (
                function("a", lambda p: p, then=("b", "c")),
                function("b", lambda p: p, then="j"),
                function("c", lambda p: p),
                function("j", lambda p: p, join=("b", "c")),
            ),
            "join 'j' waits for 'c', which must lead to 'j'",
        ),
        (
            (function("a", lambda p: p), function("b", lambda p: p)),
            "steps ['b'] cannot be reached",
        ),
        ((function("a", lambda p: p, routes_to=("a",)),), "has routes_to but no route"),
        (
            (
                function("a", lambda p: p, then=("b", "c")),
                function("b", lambda p: p),
                function("c", lambda p: p),
            ),
            "step 'a' fans out to ['b', 'c'], which must be exactly the branches of one join",
        ),
        (
            (
                function("a", lambda p: p, route=_route_nowhere, routes_to=("x", "y")),
                function("x", lambda p: p, then="b"),
                function("y", lambda p: p, then="c"),
                function("b", lambda p: p, then="j"),
                function("c", lambda p: p, then="j"),
                function("j", lambda p: p, join=("b", "c")),
            ),
            "step 'x' leads to 'b' alone, a branch of join 'j', which would wait forever",
        ),
        (
            (
                function("a", lambda p: p, route=_route_nowhere, routes_to=("b", "d")),
                function("b", lambda p: p, then="j"),
                function("c", lambda p: p, then="j"),
                function("d", lambda p: p, then=("b", "c")),
                function("j", lambda p: p, join=("b", "c")),
            ),
            "route of 'a' may choose 'b', a branch of join 'j'",
        ),
        (
            (
                function("a", lambda p: p, then=("b", "c")),
                function("b", lambda p: p, route=_route_nowhere, routes_to=("j",)),
                function("c", lambda p: p, then="j"),
                function("j", lambda p: p, join=("b", "c")),
            ),
            "join 'j' waits for 'b', which must lead to 'j' and nowhere else (by then=",
        ),
        (
            (
                function("a", lambda p: p, then="b", route=_route_nowhere, routes_to=("b",)),
                function("b", lambda p: p),
            ),
            "step 'a' has both then and route",
        ),
        ((function("input", lambda p: p),), "step name 'input' is taken"),
    ],
)
def test_graph_is_validated_when_built(steps: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ConfigError, match="pipeline 'p'") as err:
        Pipeline("p", ValueIn, steps)
    assert message in str(err.value)


def _one_branch(output: dict[str, Any], ctx: dict[str, Any]) -> str | tuple[str, ...]:
    return ctx["input"]["pick"]  # type: ignore[no-any-return]


def test_a_route_picks_one_step_or_one_joins_branches_together() -> None:
    steps = (
        function("a", lambda p: p, route=_one_branch, routes_to=("b", "c", "d")),
        function("b", lambda p: p, then="j"),
        function("c", lambda p: p, then="j"),
        function("d", lambda p: p),
        function("j", lambda p: p, join=("b", "c")),
    )
    pipeline = Pipeline("p", ValueIn, steps)
    a = pipeline.step("a")
    for pick in ("d", ("c", "b"), ()):
        assert pipeline.after(a, {}, {"input": {"pick": pick}}) in (("d",), ("c", "b"), ())
    for pick in ("b", ("b", "d"), ("d", "d")):  # j would wait forever; two answers
        with pytest.raises(ConfigError, match="a route picks one step, or all the branches"):
            pipeline.after(a, {}, {"input": {"pick": pick}})


async def test_route_outside_its_declared_targets_is_a_clear_error(harness: Harness) -> None:
    registry = Registry(
        [
            Pipeline(
                "lost",
                ValueIn,
                (
                    function("a", lambda p: p, route=_route_nowhere, routes_to=("b",)),
                    function("b", lambda p: p),
                ),
            )
        ]
    )
    http = await harness.serve(registry)
    resp = await http.post("/v1/lost", json={"value": 1})
    assert resp.status_code == 500
    assert "not among routes_to" in resp.json()["detail"]


async def test_openapi_and_get_use_the_pipeline_input(harness: Harness) -> None:
    http: httpx.AsyncClient = await harness.serve(builtins("chain", "hello"))
    schema = (await http.get("/openapi.json")).json()
    assert {"/v1/chain", "/v1/hello"} <= set(schema["paths"])
    resp = await http.post("/v1/hello", json={"language": "french"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "name"]


async def test_the_readme_example_pipeline(harness: Harness) -> None:
    from tests.support.userapp import review

    http = await harness.serve(Registry([review]))
    resp = await http.post("/v1/review", json={"text": "A wonderful, joyful film. I loved it."})
    assert resp.status_code == 200, resp.text
    assert set(resp.json()) == {"summary", "entities"}
    resp = await http.post("/v1/review", json={"text": "Awful. A painful, horrible disaster."})
    assert resp.json() == {"skipped": True}


async def test_clock_calibration_is_not_skewed_by_connecting(env: None) -> None:
    # Same host, same clock: the offset must be zero to within the measured error. The
    # first command on a new client also connects; timing that one would skew it.
    client = connect(CommonSettings())
    clock = RedisClock()
    await clock.calibrate(client)
    await client.aclose()
    assert clock.error < 0.5
    assert abs(clock.offset) <= clock.error + 1e-4


async def test_publish_acks_more_entries_than_one_script_command_can_take(
    harness: Harness, redis: aioredis.Redis
) -> None:
    # The batch's XACK goes through Lua's unpack(), which takes a few thousand values at
    # most: a huge batch (CONVEYOR_MAX_BATCH_SIZE up to 4096) must still be acked whole.
    stream = harness.keys.stage_stream("big")
    await ensure_group(redis, stream)
    pipe = redis.pipeline(transaction=False)
    for i in range(4096):
        pipe.xadd(stream, {"e": str(i)})
    ids = await pipe.execute()
    read: Any = await redis.xreadgroup(GROUP, "c1", {stream: ">"}, count=5000)
    assert len(read[0][1]) == 4096
    stats = harness.keys.stage_stats("big")
    counts = {"batches": 1, "run_seconds:sum": 0.25}
    token = harness.keys.publish_token("big")
    call = Call(Outbox(), {stream: ids}, stats, counts, token, reply_maxlen=1000, reply_ttl_s=60)
    await publish(redis, call)
    assert (await redis.xpending(stream, GROUP))["pending"] == 0
    assert await redis.hget(stats, "batches") == b"1"
    assert await redis.hget(stats, "run_seconds:sum") == b"0.25"


async def test_a_branch_of_several_steps_still_meets_its_join(harness: Harness) -> None:
    # Review found the exactly-once graph rule refusing b -> b2 -> join, which ran before.
    steps = (
        function("a", lambda p: p, then=("b", "c")),
        function("b", lambda p: {"value": p["value"] + 1}, then="b2"),
        function("b2", lambda p: {"value": p["value"] * 10}, then="j"),
        function("c", lambda p: p, then="j"),
        function("j", lambda both: {"b2": both["b2"], "c": both["c"]}, join=("b2", "c")),
    )
    pipeline = Pipeline("long", ValueIn, steps)
    assert pipeline.branch_end("b") == (pipeline.step("j"), "b2")
    http = await harness.serve(Registry([pipeline]))
    resp = await http.post("/v1/long", json={"value": 1})
    assert resp.json() == {"b2": {"value": 20.0}, "c": {"value": 1.0}}, resp.text


def test_a_function_step_runs_on_its_pipelines_function_stage() -> None:
    shared = replace(ADDER, name="p.shared")  # a model stage, whatever its name looks like
    steps = (model("add", ADDER, then="f"), function("f", lambda p: p, then="m"))
    pipeline = Pipeline("p", ValueIn, (*steps, model("m", shared)))
    kinds = {s.name: (s.stage.kind, s.stage.name) for s in pipeline.steps}
    assert kinds == {
        "add": ("model", "adder"),
        "f": ("function", "p.f"),
        "m": ("model", "p.shared"),
    }
    drawn = pipeline.describe()
    assert "[model stage adder," in drawn
    assert "[function stage p.f," in drawn
    assert "[model stage p.shared," in drawn
