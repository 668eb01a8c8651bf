"""``conveyor up`` keeps what it accepted (its embedded Redis's append-only file in the
data folder): stopped or killed, then started again on the same folder, it finishes every
accepted job, each once; a second ``up`` on the folder is refused; and ``dlq replay`` of
a letter that kills its worker dead-letters it again while everything else goes on."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import cast

import httpx
import redis.asyncio as aioredis

from bench.rss import children
from conveyor.embedded import free_port
from pipelines.envelope import decode_request
from pipelines.keys import Keys
from pipelines.records import DeadLetter
from pipelines.settings import CommonSettings
from tests.conveyor.test_cli import CONVEYOR
from tests.conveyor.test_supervisor import _command, stop
from tests.helpers import conveyor, until, up_env, wait_for_line

APP = "tests.support.faultapp:kept"


def start(folder: Path, log: Path, port: int, *args: str, **env: str) -> subprocess.Popen[bytes]:
    """``conveyor up --app tests.support.faultapp:kept`` run in ``folder`` (its default data folder
    ``folder/.conveyor`` unless ``env`` names one), its output appended to ``log``."""
    full = up_env(**env)
    if "CONVEYOR_DATA_DIR" not in env:
        del full["CONVEYOR_DATA_DIR"]  # the default: .conveyor/ where up runs
    with log.open("ab") as out:
        return subprocess.Popen(
            [CONVEYOR, "up", "--port", str(port), "--app", APP, *args],
            env=full,
            cwd=folder,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def ready(folder: Path, log: Path, *args: str, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """:func:`start` on a free port, once it says it is ready: the process, its base URL."""
    port = free_port()
    up = start(folder, log, port, *args, **env)
    try:
        wait_for_line(log, "conveyor: ready:", up, limit_s=90)
    except BaseException:
        stop(up)
        raise
    return up, f"http://127.0.0.1:{port}"


def submit(base: str, values: range, pipeline: str = "recorded") -> dict[int, str]:
    """Async jobs of ``pipeline``, one per value, each accepted (202): their ids."""
    ids = {}
    with httpx.Client(base_url=base, timeout=30) as client:
        for value in values:
            resp = client.post(f"/v1/jobs/{pipeline}", json={"value": value})
            assert resp.status_code == 202, resp.text
            ids[value] = resp.json()["id"]
    return ids


async def all_done(base: str, ids: dict[int, str]) -> bool:
    """Whether every job is done, each with its doubled value (one failed: the test fails)."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for value, job in ids.items():
            view = (await client.get(f"/v1/jobs/{job}")).json()
            assert view["status"] in ("queued", "done"), view
            if view["status"] != "done":
                return False
            assert view["result"] == {"value": 2 * value}, view
    return True


def recorded(record: Path) -> list[int]:
    """Every value the model ran, in order (one line each)."""
    return [int(v) for v in record.read_text().split()] if record.exists() else []


def test_up_stopped_with_work_queued_says_so_and_the_next_up_finishes_it(tmp_path: Path) -> None:
    # BREAK (issue 29, 3): Ctrl-C with jobs queued dropped them without a word: the
    # embedded Redis lived in a temp folder and kept nothing.
    record, log, log2 = tmp_path / "record", tmp_path / "up.log", tmp_path / "up2.log"
    env = {"CONVEYOR_TEST_RECORD": str(record), "CONVEYOR_TEST_DELAY_S": "0.5"}
    env |= {"CONVEYOR_DRAIN_S": "1"}
    up, base = ready(tmp_path, log, **env)
    data = tmp_path / ".conveyor"
    try:
        assert f"its data in {data} (append-only file" in log.read_text()
        ids = submit(base, range(40))  # 10 batches of 4, half a second each
        asyncio.run(until(lambda: _has(record), limit_s=60))  # the worker is at it
        # A second up on the same folder is refused with one line, before it starts
        # anything (its own Redis on the same files would corrupt them).
        second = subprocess.run(
            [CONVEYOR, "up", "--port", str(free_port()), "--app", APP],
            env={k: v for k, v in up_env(**env).items() if k != "CONVEYOR_DATA_DIR"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2, second.stdout + second.stderr
        line = f"conveyor: {data} is in use by another `conveyor up` (pid {up.pid})"
        assert second.stderr.startswith(line), second.stderr
        assert "embedded redis" not in second.stdout, second.stdout
    finally:
        code = stop(up)
    text = log.read_text()
    assert code == 0, text
    assert f"work left when it stopped, kept in {data}" in text, text
    left = re.search(r"recorded: (\d+) waiting, (\d+) pending, 0 dead letter\(s\)", text)
    assert left, text
    assert int(left.group(1)) + int(left.group(2)) > 0, text
    assert len(recorded(record)) < 40
    up, base = ready(tmp_path, log2, **env)  # the same folder: it finishes the rest
    try:
        asyncio.run(until(lambda: all_done(base, ids), limit_s=120))
    finally:
        code = stop(up)
    assert code == 0, log2.read_text()
    assert sorted(recorded(record)) == list(range(40))  # each ran once, none lost


async def letter(client: aioredis.Redis, dlq: str) -> tuple[bytes, dict[bytes, bytes]]:
    """The one dead letter in ``dlq``: its id and fields."""
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(dlq))
    assert len(entries) == 1, entries
    return entries[0]


async def _has(record: Path) -> bool:
    return bool(recorded(record))


def test_up_killed_then_started_again_finishes_every_accepted_job_once(tmp_path: Path) -> None:
    # up killed (SIGKILL: no stop runs; its children, Redis among them, die with it).
    # The model holds its first batch at a gate, so the kill lands with one batch on the
    # model and the rest queued; started again with the gate open, every job is done.
    record, log, gate = tmp_path / "record", tmp_path / "up.log", tmp_path / "gate"
    data, log2 = tmp_path / "data", tmp_path / "up2.log"
    env = {"CONVEYOR_TEST_RECORD": str(record), "CONVEYOR_TEST_GATE": str(gate)}
    env |= {"CONVEYOR_DATA_DIR": str(data)}
    up, base = ready(tmp_path, log, **env)
    try:
        ids = submit(base, range(20))
    finally:
        # appendfsync everysec: each write reaches the file before Redis answers it; a
        # killed process loses nothing (a machine that crashes could lose a second).
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=30)
    assert "stopped" not in log.read_text()
    gate.touch()
    up, base = ready(tmp_path, log2, **env)
    try:
        asyncio.run(until(lambda: all_done(base, ids), limit_s=120))
    finally:
        code = stop(up)
    assert code == 0, log2.read_text()
    assert sorted(recorded(record)) == list(range(20))


async def test_a_replayed_letter_that_kills_its_worker_is_dead_lettered_again(
    tmp_path: Path,
) -> None:
    # BREAK (issue 29, 3): `dlq replay` of a letter whose model kills the process: crash
    # after crash, up gave up on the whole stack, and the letter and every queued job were
    # gone. Now it is dead-lettered again, its attempt counted, while the other stage
    # serves and its jobs are all done.
    record, log = tmp_path / "record", tmp_path / "up.log"
    env = {"CONVEYOR_TEST_RECORD": str(record), "CONVEYOR_RESTART_BACKOFF_S": "0.2"}
    up, base = await asyncio.to_thread(ready, tmp_path, log, **env)
    found = re.search(r"CONVEYOR_REDIS_URL=(redis://\S+) conveyor status", log.read_text())
    url = found.group(1) if found else ""
    client = aioredis.Redis.from_url(url or "redis://127.0.0.1:1/0")
    dlq = Keys(CommonSettings.model_fields["namespace"].default).dead_letters("crashy")

    async def letters(count: int) -> bool:
        return await client.xlen(dlq) == count

    try:
        assert found, log.read_text()
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            poison = (await http.post("/v1/jobs/crashy", json={"value": -1})).json()["id"]
            await until(lambda: letters(1), limit_s=180)
            first_id, first = await letter(client, dlq)
            before = (decode_request(first).attempt, DeadLetter.parse(first).deliveries)
            ids = await asyncio.to_thread(submit, base, range(30))  # the other stage's
            env_cli = {"CONVEYOR_REDIS_URL": url, "CONVEYOR_APP": APP}
            done = await asyncio.to_thread(conveyor, "dlq", "replay", "crashy", **env_cli)
            assert done.returncode == 0, done.stderr
            assert "replayed 1 dead letter(s)" in done.stdout, done.stdout
            # Good inputs of the crashing stage, read in batches beside the letter: each
            # is charged a crash once at most, runs alone, and is answered.
            good = await asyncio.to_thread(submit, base, range(100, 108), "crashy")
            await until(lambda: letters(1), limit_s=180)  # replayed, and back
            again_id, again = await letter(client, dlq)
            assert again_id != first_id
            after = (decode_request(again).attempt, DeadLetter.parse(again).deliveries)
            # Its attempt counted; its deliveries are this entry's: one (run in a child
            # within CONVEYOR_QUARANTINE_S of the first crash, it never ends a worker)
            # up to the first letter's.
            assert after[0] == before[0] + 1, (before, after)
            assert after[1] is not None, (before, after)
            assert before[1] is not None, (before, after)
            assert 1 <= after[1] <= before[1], (before, after)
            # The listing says it was replayed once (its deliveries are this entry's).
            listed = await asyncio.to_thread(conveyor, "dlq", "list", "crashy", **env_cli)
            assert listed.returncode == 0, listed.stderr
            assert f"attempt={after[0]}  deliveries={after[1]}" in listed.stdout, listed.stdout
            await until(lambda: all_done(base, ids | good), limit_s=120)
            view = (await http.get(f"/v1/jobs/{poison}")).json()
            assert view["status"] == "failed", view

            # The crashing stage serves again once its worker is back.
            async def crashy_answers() -> bool:
                resp = await http.post("/v1/crashy", json={"value": 4})
                return resp.status_code == 200 and resp.json() == {"value": 8}

            await until(crashy_answers, limit_s=120)
        assert up.poll() is None, log.read_text()
        assert sorted(recorded(record)) == list(range(30))
    finally:
        await client.aclose()
        code = await asyncio.to_thread(stop, up)
    assert code == 0, log.read_text()


def test_the_embedded_redis_restarted_by_up_reloads_what_it_held(tmp_path: Path) -> None:
    # BREAK (issue 29, 3): up started its Redis again after it died, empty ("what it held
    # is lost"): every queued job with it. Now it reloads its append-only file.
    record, log, gate = tmp_path / "record", tmp_path / "up.log", tmp_path / "gate"
    env = {"CONVEYOR_TEST_RECORD": str(record), "CONVEYOR_TEST_GATE": str(gate)}
    env |= {"CONVEYOR_RESTART_BACKOFF_S": "0.2"}
    up, base = ready(tmp_path, log, **env)
    try:
        ids = submit(base, range(12))
        (pid,) = [p for p in children(up.pid) if _command(p) == "redis-server"]
        os.kill(pid, signal.SIGKILL)
        wait_for_line(log, "starting it again (it reloads what it held from", up, limit_s=60)
        gate.touch()
        asyncio.run(until(lambda: all_done(base, ids), limit_s=120))
        assert up.poll() is None, log.read_text()
    finally:
        code = stop(up)
    assert code == 0, log.read_text()
    assert sorted(recorded(record)) == list(range(12))
