"""``conveyor up`` as a user runs it: a subprocess with an embedded Redis, real HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from conveyor.cli import main, status_table
from conveyor.embedded import free_port, start_redis
from conveyor.placement import PlacementSettings
from conveyor.supervisor import worker_groups
from pipelines.builtin import builtin_pipelines
from pipelines.keys import Keys
from pipelines.registry import Registry
from runtime.status import stage_status
from tests.gateway.test_lanes import put
from tests.helpers import (
    REPO,
    GatewayProcess,
    Harness,
    conveyor,
    up_env,
    wait_for_line,
    wait_ready,
    worker_process,
)

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))


def start_up(port: int, env: dict[str, str], log: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """``conveyor up`` serving embed and echo on ``port``, its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [CONVEYOR, "up", "--port", str(port), "--pipelines", "embed,echo"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            **popen,
        )


def test_up_serves_end_to_end_and_stops_on_ctrl_c(tmp_path: Path, cache_dir: Path) -> None:
    port = free_port()
    env = up_env(CONVEYOR_CACHE_DIR=str(cache_dir))
    log = tmp_path / "up.log"
    proc = start_up(port, env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, {"conveyor up": proc}, lambda _: log.read_text())
        resp = httpx.post(f"{base}/v1/embed", json={"text": "a cat sat"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["embedding"]) == 384
        resp = httpx.get(f"{base}/v1/embed", params={"text": "hello"}, timeout=60)
        assert len(resp.json()["embedding"]) == 384
        assert httpx.post(f"{base}/v1/echo", json={"a": [1]}, timeout=60).json() == {"a": [1]}

        found = re.search(r"embedded redis on (127\.0\.0\.1:\d+)", log.read_text())
        assert found, log.read_text()
        status = subprocess.run(
            [CONVEYOR, "status"],
            env=env | {"CONVEYOR_REDIS_URL": f"redis://{found.group(1)}/0"},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        row = next(line for line in status.splitlines() if line.startswith("embed "))
        assert row.split()[1:5] == ["2", "0", "0", "1/1"]  # length, lag, pending, live/all
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    assert code == 0, log.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/healthz", timeout=1)


@pytest.mark.parametrize(("signum", "embedded"), [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_up_says_when_models_are_loaded_and_stops_in_order_without_warnings(
    tmp_path: Path, cache_dir: Path, redis_url: str, signum: int, embedded: bool
) -> None:
    # Embedded: its own Redis, which Ctrl-C used to kill before the workers could leave
    # their groups. Else the test's, so what the workers left there can be read after.
    port = free_port()
    namespace = f"up-{int(signum)}"
    env = up_env(CONVEYOR_CACHE_DIR=str(cache_dir))
    if not embedded:
        env |= {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    log = tmp_path / "up.log"
    # A session of its own, as a terminal's foreground job: Ctrl-C is a SIGINT to the
    # whole process group, which before this fix held redis, gateway and workers too.
    proc = start_up(port, env, log, start_new_session=True)
    try:
        wait_for_line(log, "ready: every stage's workers have loaded their models", proc)
        # Ready means ready: the first request needs no retry and waits for no model.
        started = time.monotonic()
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/embed", json={"text": "hi"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 5
    finally:
        os.killpg(proc.pid, signum)
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == 0, text
    for bad in ("WARNING", "Traceback", "Connection refused", "killed", "ERROR"):
        assert bad not in text, text
    assert text.rindex("stopping:") < text.rindex("stopped")
    # The workers drained and left their groups: nobody is left in them.
    if not embedded:
        assert asyncio.run(consumers_left(redis_url, Keys(namespace), ["embed", "echo"])) == []


async def consumers_left(redis_url: str, keys: Keys, stages: list[str]) -> list[str]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return [c.name for s in stages for c in (await stage_status(client, keys, s)).consumers]
    finally:
        await client.aclose()


def test_unknown_stage_is_a_clear_error() -> None:
    result = subprocess.run(
        [CONVEYOR, "up", "--pipelines", "nope"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "unknown pipeline 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["up", "--port", "99999999"], "--port"),
        (["up", "--port", "-1"], "--port"),
        (["up", "--port", "http"], "--port"),
        (["up", "--replicas", "0"], "--replicas"),
        (["up", "--autoscale", "--min-workers", "-1"], "--min-workers"),
        (["up", "--autoscale", "--max-workers", "0"], "--max-workers"),
        (["up", "--autoscale", "--target-backlog", "0"], "--target-backlog"),
        (["gateway", "--port", "65536"], "--port"),
        (["dlq", "replay", "double", "--timeout", "inf"], "--timeout"),
        (["dlq", "replay", "double", "--timeout", "0"], "--timeout"),
    ],
)
def test_a_bad_number_is_a_usage_error_before_anything_starts(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)  # nothing here could start: a usage error comes first
    assert exited.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_a_command_redis_refuses_is_one_line_not_a_traceback(
    env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:  # the shape of an id, but past 2^64
        main(["dlq", "list", "embed", "--id", "99999999999999999999999-0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: Redis refused the command: ")
    assert "Invalid stream ID" in err
    assert err.count("\n") == 1


def test_up_serves_a_users_app_and_graph_prints_it(tmp_path: Path, cache_dir: Path) -> None:
    repo = REPO
    env = up_env(CONVEYOR_CACHE_DIR=str(cache_dir))  # a data folder of its own, not the repo's
    graph = subprocess.run(
        [CONVEYOR, "graph", "wordcount", "--app", "tests.support.userapp:pipelines"],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "split" in graph
    assert "-> count" in graph
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [CONVEYOR, "up", "--port", str(port), "--app", "tests.support.userapp:pipelines"],
            env=env,
            cwd=repo,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, {"conveyor up": proc}, lambda _: log.read_text())
        resp = httpx.post(f"{base}/v1/wordcount", json={"text": "one two three"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"count": 3}
        assert httpx.get(f"{base}/v1/embed", params={"text": "x"}).status_code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    assert code == 0, log.read_text()


def test_up_groups_the_stages_that_load_nothing_and_the_function_stages() -> None:
    registry = Registry(builtin_pipelines()).select(("chain", "hello"))
    functions = "hello.detect,hello.spanish,hello.french"
    settings = PlacementSettings()

    def groups(replicas: int | None) -> list[tuple[str, int]]:
        return [(g.name, g.replicas) for g in worker_groups(registry, replicas, settings)]

    assert groups(None) == [("adder,multiplier", 1), (functions, 1)]
    assert groups(3) == [("adder,multiplier", 3), (functions, 3)]
    settings = PlacementSettings(share_models=False)
    assert groups(None) == [("adder", 1), ("multiplier", 1), (functions, 1)]


async def test_status_shows_each_lane(harness: Harness, redis: aioredis.Redis) -> None:
    await put(harness, "double", "interactive", 2)
    await put(harness, "double", "bulk", 5)
    table = status_table([await stage_status(redis, harness.keys, "double")])
    header, row = table.splitlines()
    assert header.split() == [
        "stage", "length", "lag", "pending", "live/all", "interactive", "bulk", "workers",
    ]  # fmt: skip
    # totals, then each lane's lag/pending
    assert row.split() == ["double", "7", "7", "0", "0/0", "2/0", "5/0", "-"]


# --- issue 23, break 8: every bad setting and argument is one line and exit status 2 -------

CLI = ["-c", "import sys; from conveyor.cli import main; main(sys.argv[1:])"]
"""``python`` arguments that run the ``conveyor`` command from this checkout's code."""


@pytest.mark.parametrize(
    ("argv", "variable", "value"),
    [
        ([*CLI, "status"], "CONVEYOR_PARTITIONS", "abc"),
        ([*CLI, "gateway"], "CONVEYOR_MAX_BODY_BYTES", "abc"),
        ([*CLI, "gateway"], "CONVEYOR_PORT", "70000"),
        ([*CLI, "worker", "echo"], "CONVEYOR_MAX_BATCH_SIZE", "abc"),
        ([*CLI, "worker", "echo"], "CONVEYOR_RESOURCES", '{"echo": {"gpus": "x"}}'),
        ([*CLI, "up"], "CONVEYOR_RESOURCES", "{bad"),
        ([*CLI, "up"], "CONVEYOR_MAX_TIMEOUT_S", "inf"),  # the gateway's, checked by up
        ([*CLI, "up"], "CONVEYOR_PORT", "http"),
        ([*CLI, "up", "--autoscale"], "CONVEYOR_AUTOSCALE_INTERVAL_S", "soon"),
        ([*CLI, "up"], "CONVEYOR_RESTART_WINDOW_S", "soon"),
        ([*CLI, "up"], "CONVEYOR_DRAIN_S", "-1"),
        ([*CLI, "dlq", "list", "embed"], "CONVEYOR_REDIS_URL", "http://127.0.0.1:1"),
        ([*CLI, "status"], "CONVEYOR_REDIS_URL", "redis://127.0.0.1:99999/0"),
        (["-m", "gateway"], "CONVEYOR_REDIS_URL", "redis://u:s3cret@127.0.0.1:6379/abc"),
        ([*CLI, "keda", "embed"], "CONVEYOR_PARTITIONS", "0"),
        (["-m", "gateway"], "CONVEYOR_API_KEYS", " , "),
        (["-m", "gateway"], "CONVEYOR_CORS_ORIGINS", "[bad"),
        (["-m", "workers", "echo"], "CONVEYOR_SPIN_WAIT", "maybe"),
        (["-m", "workers", "echo"], "CONVEYOR_MODELS", "{bad"),
        (["-m", "workers", "wiki-summary.fetch"], "CONVEYOR_WIKIPEDIA_TIMEOUT_S", "abc"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable_from_every_command(
    argv: list[str], variable: str, value: str, redis_url: str, namespace: str
) -> None:
    # BREAK 8 (issue 23): pydantic's multi-line error naming the field (exit 1), and a
    # 42-line traceback for CONVEYOR_RESOURCES='{bad' even from `up`.
    env = up_env(
        **{
            "CONVEYOR_REDIS_URL": redis_url,  # were a value let through, none waits for Redis
            "CONVEYOR_NAMESPACE": namespace,
            "CONVEYOR_PIPELINES": "echo,wiki-summary",
            variable: value,
        }
    )
    done = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"conveyor: {variable}: "), line
    if variable not in ("CONVEYOR_REDIS_URL", "CONVEYOR_API_KEYS"):  # secrets: never shown
        assert "(got '" in line, line  # what is wrong with it: the value, or its part


def test_a_secret_setting_is_named_but_never_shown() -> None:
    done = conveyor("status", CONVEYOR_REDIS_URL="http://user:s3cret@host:6379")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("conveyor: CONVEYOR_REDIS_URL: must start with redis://")
    assert "s3cret" not in done.stderr


@pytest.mark.parametrize("stages", ["", " , "])
def test_a_worker_given_no_stage_is_a_usage_error(stages: str) -> None:
    # BREAK 8: `conveyor worker ''` served nothing and exited 0.
    done = conveyor("worker", stages)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "argument stages: " in done.stderr
    assert "names no stage" in done.stderr
    assert "Traceback" not in done.stderr


def test_dlq_and_keda_refuse_an_unknown_stage_naming_the_known_ones(
    redis_url: str, namespace: str
) -> None:
    # BREAK 8: a mistyped stage listed, replayed or purged nothing, or printed triggers
    # on streams no worker reads, and exited 0.
    env = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    for argv in (("dlq", "list", "embd"), ("dlq", "purge", "embd"), ("keda", "embd")):
        done = conveyor(*argv, **env)
        assert done.returncode == 2, (argv, done.returncode, done.stderr)
        (line,) = done.stderr.splitlines()
        assert line.startswith("conveyor: unknown stage 'embd'; known: "), line
        assert "embed" in line.split("known: ")[1].split(", ")
        assert not done.stdout


async def test_dlq_knows_a_stage_that_had_a_worker(
    redis: aioredis.Redis, redis_url: str, namespace: str
) -> None:
    # Not among the configured pipelines' stages, but a worker served it: its dead
    # letters are still there to list.
    await redis.sadd(Keys(namespace).stages_set(), "retired")
    env = {"CONVEYOR_REDIS_URL": redis_url, "CONVEYOR_NAMESPACE": namespace}
    done = await asyncio.to_thread(conveyor, "dlq", "list", "retired", **env)
    assert done.returncode == 0, done.stderr
    assert "0 dead letter(s)" in done.stdout


def _worker_on(port: int, namespace: str, log: Path) -> subprocess.Popen[bytes]:
    """``python -m workers echo`` on the Redis at ``port`` (up or not), output in ``log``."""
    env = up_env(
        CONVEYOR_REDIS_URL=f"redis://127.0.0.1:{port}/0",
        CONVEYOR_NAMESPACE=namespace,
        CONVEYOR_PIPELINES="echo",
    )
    return worker_process(log, env, "echo")


def test_a_worker_started_before_redis_waits_for_it_and_serves(
    tmp_path: Path, namespace: str
) -> None:
    # BREAK 8: a worker started while Redis was down exited at once (the gateway waits).
    port = free_port()
    worker = _worker_on(port, namespace, tmp_path / "worker.log")
    redis_proc: subprocess.Popen[bytes] | None = None
    try:
        wait_for_line(tmp_path / "worker.log", "redis unreachable", worker, limit_s=60)
        redis_proc = start_redis(port, tmp_path / "redis")
        url = f"redis://127.0.0.1:{port}/0"
        settings = {"CONVEYOR_NAMESPACE": namespace, "CONVEYOR_PIPELINES": "echo"}
        with GatewayProcess(url, tmp_path / "gateway.log", **settings) as gateway:
            # Queued until the worker joins (its group reads the stream from the start).
            answer = httpx.post(
                f"{gateway.base}/v1/echo",
                json={"x": 1},
                headers={"X-Conveyor-Timeout": "90"},
                timeout=100,
            )
        assert answer.status_code == 200, answer.text
        assert answer.json()["x"] == 1
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)


def test_a_worker_waiting_for_redis_stops_on_sigterm(tmp_path: Path, namespace: str) -> None:
    worker = _worker_on(free_port(), namespace, tmp_path / "worker.log")
    try:
        wait_for_line(tmp_path / "worker.log", "redis unreachable", worker, limit_s=60)
        worker.send_signal(signal.SIGTERM)
        # Its waits are up to 5 s long; the signal cuts the one under way short.
        assert worker.wait(timeout=10) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
