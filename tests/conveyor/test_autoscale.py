"""``conveyor up --autoscale``: the decision rule alone, then real worker processes following
a burst on a real Redis, then the command itself.

Waiting is on conditions (replies counted, processes exited, consumers in the group), each
bounded; nothing sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from subprocess import Popen
from typing import Any, cast

import httpx
import pytest
import redis.asyncio as aioredis

from conveyor.autoscale import Autoscaler, AutoscaleSettings, Scaler, desired
from conveyor.embedded import free_port
from pipelines.envelope import Reply, decode_replies
from pipelines.errors import ConfigError
from pipelines.keys import Keys
from pipelines.settings import CommonSettings
from runtime.status import StageStatus, stage_status
from tests.helpers import REPO, Harness, replies_in
from tests.support.scaleapp import SYNTHETIC

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))
STAGE = SYNTHETIC.name  # batches of 8, each costing 0.1 s + 0.02 s per item


# --- the rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lag", "pending", "min_n", "max_n", "want"),
    [
        (0, 0, 1, 4, 1),  # idle: the floor
        (0, 0, 0, 4, 0),  # idle with a floor of zero: none
        (1, 0, 0, 4, 1),  # anything waiting wakes a stage at zero
        (16, 0, 1, 4, 2),
        (17, 0, 1, 4, 3),  # rounded up
        (8, 9, 1, 4, 3),  # in-flight entries count too
        (400, 0, 1, 4, 4),  # never above the ceiling
        (0, 0, 2, 4, 2),
    ],
)
def test_desired_is_the_backlog_over_the_target_within_bounds(
    lag: int, pending: int, min_n: int, max_n: int, want: int
) -> None:
    backlog = StageStatus("s", lag=lag, pending=pending).backlog
    assert desired(backlog, target=8, min_n=min_n, max_n=max_n) == want


def test_scales_up_at_once_to_what_the_backlog_needs() -> None:
    s = Scaler(1, 4, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(1, 400, now=100.0) == 4


def test_a_scale_up_waits_out_the_up_cool_down() -> None:
    s = Scaler(1, 8, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(1, 16, now=100.0) == 2
    assert s.decide(2, 64, now=104.9) == 2
    assert s.decide(2, 64, now=105.0) == 8


def test_scales_down_slowly_and_one_worker_at_a_time() -> None:
    s = Scaler(1, 4, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(1, 400, now=0.0) == 4
    assert s.decide(4, 0, now=10.0) == 4  # the backlog is gone: the wait starts
    assert s.decide(4, 0, now=39.9) == 4
    assert s.decide(4, 0, now=40.0) == 3
    assert s.decide(3, 0, now=69.9) == 3  # each step waits a whole cool-down
    assert s.decide(3, 0, now=70.0) == 2
    assert s.decide(2, 0, now=100.0) == 1
    assert s.decide(1, 0, now=1000.0) == 1  # never below the floor


def test_a_backlog_blip_restarts_the_scale_down_wait() -> None:
    s = Scaler(1, 4, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(4, 0, now=0.0) == 4
    blip = StageStatus("s", lag=30, pending=2).backlog
    assert s.decide(4, blip, now=20.0) == 4  # all four needed again
    assert s.decide(4, 0, now=21.0) == 4
    assert s.decide(4, 0, now=50.9) == 4
    assert s.decide(4, 0, now=51.0) == 3


def test_scales_down_only_as_far_as_the_backlog_allows() -> None:
    s = Scaler(1, 4, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(4, 20, now=0.0) == 4  # 20 entries need 3 workers
    assert s.decide(4, 20, now=30.0) == 3
    assert s.decide(3, 20, now=1000.0) == 3


def test_scales_from_zero_and_back_to_zero() -> None:
    s = Scaler(0, 4, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(0, 0, now=0.0) == 0
    assert s.decide(0, 3, now=1.0) == 1
    assert s.decide(1, StageStatus("s", pending=3).backlog, now=2.0) == 1  # in flight
    assert s.decide(1, 0, now=3.0) == 1
    assert s.decide(1, 0, now=33.0) == 0


def test_bounds_hold_at_once_and_the_start_does_not_delay_a_scale_up() -> None:
    s = Scaler(2, 3, 8, up_cooldown_s=5, down_cooldown_s=30)
    assert s.decide(0, 0, now=0.0) == 2  # the start: the floor
    assert s.decide(2, 400, now=0.1) == 3
    assert s.decide(5, 0, now=0.2) == 3  # above the ceiling


def test_settings_come_from_flags_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_AUTOSCALE_MAX_WORKERS", "7")
    monkeypatch.setenv("CONVEYOR_AUTOSCALE_DOWN_COOLDOWN_S", "12.5")
    env = AutoscaleSettings.from_flags(min_workers=None, max_workers=None, target_backlog=None)
    assert (env.min_workers, env.max_workers, env.down_cooldown_s) == (1, 7, 12.5)
    assert env.scaler(SYNTHETIC).target == SYNTHETIC.max_batch_size
    flags = AutoscaleSettings.from_flags(max_workers=3, target_backlog=50)
    assert (flags.max_workers, flags.scaler(SYNTHETIC).target) == (3, 50)
    with pytest.raises(ConfigError, match=r"max_workers: must be at least min_workers \(3\)"):
        AutoscaleSettings.from_flags(min_workers=3, max_workers=2)
    with pytest.raises(ConfigError, match="min_workers: Input should be greater"):
        AutoscaleSettings.from_flags(min_workers=-1)


# --- the process handling, with stand-in processes ---------------------------------------

IGNORES_TERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def test_workers_are_started_drained_and_reaped() -> None:
    procs: list[Popen[bytes]] = []

    def spawn(stage: str) -> Popen[bytes]:
        procs.append(Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return procs[-1]

    a = Autoscaler({"s": Scaler(1, 3, 8, up_cooldown_s=0, down_cooldown_s=1)}, spawn, 5.0)
    try:
        a.apply({"s": StageStatus("s")}, now=0.0)
        assert len(a.running["s"]) == 1
        a.apply({"s": StageStatus("s", lag=100)}, now=1.0)
        assert len(a.running["s"]) == 3
        a.apply({"s": StageStatus("s")}, now=2.0)
        a.apply({"s": StageStatus("s")}, now=3.0)
        assert (len(a.running["s"]), [p for _, p, _ in a.draining]) == (2, [procs[2]])
        assert procs[2] in [p for _, p in a.processes()]  # Ctrl-C stops it too
        assert procs[2].wait(10) == -signal.SIGTERM
        assert a.reap(now=3.1) == []
        assert a.draining == []
        procs[0].kill()
        procs[0].wait(10)
        assert a.reap(now=3.2) == [("s", procs[0])]  # exited unasked
        assert a.running["s"] == [procs[1]]  # the next tick starts another
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_worker_ignoring_sigterm_is_killed_after_the_drain_timeout() -> None:
    procs: list[Popen[bytes]] = []

    def spawn(stage: str) -> Popen[bytes]:
        cmd = [sys.executable, "-c", IGNORES_TERM]
        procs.append(Popen(cmd, stdout=subprocess.PIPE))
        return procs[-1]

    a = Autoscaler({"s": Scaler(0, 1, 8, up_cooldown_s=0, down_cooldown_s=0)}, spawn, 2.0)
    try:
        a.apply({"s": StageStatus("s", lag=1)}, now=0.0)
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline() == b"ready\n"
        a.apply({"s": StageStatus("s")}, now=10.0)
        a.apply({"s": StageStatus("s")}, now=10.0)  # SIGTERM, ignored
        assert a.reap(now=11.9) == []
        assert procs[0].poll() is None
        assert len(a.draining) == 1
        assert a.reap(now=12.1) == []
        assert procs[0].returncode == -signal.SIGKILL
        assert a.draining == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()


# --- real workers on a real Redis --------------------------------------------------------


async def until(
    check: Callable[[], Awaitable[bool]], task: asyncio.Task[str | None], limit_s: float = 40
) -> None:
    """Wait for ``check`` to hold while the autoscaler runs, for at most ``limit_s``."""
    give_up = time.monotonic() + limit_s
    while not await check():
        if task.done():
            pytest.fail(f"the autoscaler stopped: {task.result()}")
        if time.monotonic() > give_up:
            pytest.fail(f"condition not met within {limit_s} s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def autoscaling(
    scaler: Scaler, log: Path, started: list[Popen[bytes]]
) -> AsyncIterator[tuple[Autoscaler, asyncio.Task[str | None]]]:
    """An autoscaler of tests/support/scaleapp.py's stage, running real workers, ticking every
    0.2 s; everything it started is stopped afterwards."""
    env = dict(os.environ) | {
        "CONVEYOR_APP": "tests.support.scaleapp:pipelines",
        "PYTHONPATH": str(REPO),
        "CONVEYOR_BLOCK_MS": "200",
    }

    def spawn(stage: str) -> Popen[bytes]:
        with log.open("ab") as out:
            cmd = [sys.executable, "-m", "workers", stage]
            started.append(Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        return started[-1]

    a = Autoscaler({STAGE: scaler}, spawn, drain_timeout_s=20)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(CommonSettings(), interval_s=0.2, stop=stop))
    try:
        yield a, task
    finally:
        stop.set()
        await task
        for _, proc in a.processes():
            proc.send_signal(signal.SIGTERM)
        for _, proc in a.processes():
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def answers(redis: aioredis.Redis, stream: str) -> list[Reply]:
    """Every reply published to ``stream``."""
    return [one for _, f in await redis.xrange(stream) or [] for one in decode_replies(f or {})]


def decisions(caplog: pytest.LogCaptureFixture) -> list[tuple[float, int, int, int]]:
    """(wall time, from, to, backlog) of each logged scaling decision."""
    found = []
    for r in caplog.records:
        if r.name == "conveyor.autoscale" and "->" in r.msg:
            _, old, new, lag, pending, _ = cast(tuple[Any, ...], r.args)
            found.append((r.created, int(old), int(new), int(lag) + int(pending)))
    return found


async def test_a_burst_scales_the_stage_out_and_back_in(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.autoscale")
    keys: Keys = harness.keys
    replies = keys.reply_stream("test")
    started: list[Popen[bytes]] = []
    samples: list[tuple[float, int, int, int]] = []  # s since the burst, running, draining, backlog
    scaler = Scaler(1, 4, 8, up_cooldown_s=0.5, down_cooldown_s=1.5)
    async with autoscaling(scaler, tmp_path / "workers.log", started) as (a, task):

        async def consumers() -> bool:  # the floor's one worker is reading
            return len((await stage_status(redis, keys, STAGE)).consumers) == 1

        await until(consumers, task)
        t0, wall0 = time.monotonic(), time.time()
        sent = await harness.enqueue(STAGE, [{"value": i} for i in range(400)], deadline_in=120)

        async def sample() -> None:
            st = await stage_status(redis, keys, STAGE)
            row = (len(a.running[STAGE]), len(a.draining), st.backlog)
            if not samples or samples[-1][1:] != row:
                samples.append((round(time.monotonic() - t0, 2), *row))

        async def answered() -> bool:
            await sample()
            return bool(await replies_in(redis, replies) >= 400)

        async def back_to_the_floor() -> bool:
            await sample()
            return len(a.running[STAGE]) == 1 and not a.draining

        await until(answered, task)
        done_s, done_wall = time.monotonic() - t0, time.time()
        await until(back_to_the_floor, task)
        back_s = time.monotonic() - t0
        st = await stage_status(redis, keys, STAGE)
    print(f"\nanswered in {done_s:.2f} s, back to one worker at {back_s:.2f} s")
    print("(s, running, draining, backlog):", samples)
    print(
        "decisions (s, from, to, backlog):",
        [(round(t - wall0, 2), *rest) for t, *rest in decisions(caplog)],
    )

    got = await answers(redis, replies)
    assert len(got) == 400  # none doubled
    assert sorted(r.id for r in got) == sorted(r.id for r in sent)  # none lost
    assert {r.outcome for r in got} == {"ok"}
    assert sorted(r.result["value"] for r in got if r.result) == [2 * i for i in range(400)]
    assert len({r.result["pid"] for r in got if r.result}) > 1  # served by several processes
    assert done_s < 13  # one worker alone needs 50 batches x 0.26 s of model time
    assert max(n for _, n, _, _ in samples) == 4  # out, as far as the ceiling allows
    assert len(started) == 4
    moves = decisions(caplog)
    assert moves[0][1:3] == (0, 1)  # the start: the floor
    ups = [(t, old, new) for t, old, new, _ in moves[1:] if new > old]
    downs = [(t, old, new) for t, old, new, _ in moves[1:] if new < old]
    assert (ups[0][1], ups[-1][2]) == (1, 4)  # straight to 4 unless a tick split the burst
    assert [(old, new) for _, old, new in downs] == [(4, 3), (3, 2), (2, 1)]  # one at a time
    assert downs[0][0] > done_wall  # not while the burst was still being served
    assert all(later[0] - earlier[0] >= 1.4 for earlier, later in itertools.pairwise(downs))
    assert [p.returncode for p in started[1:]] == [0, 0, 0]  # drained, not killed
    assert (st.lag, st.pending, len(st.consumers)) == (0, 0, 1)  # the drained left the group
    assert back_s < 45


async def test_a_stage_at_zero_wakes_for_work_and_returns_to_zero(
    harness: Harness, redis: aioredis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.autoscale")
    replies = harness.keys.reply_stream("test")
    started: list[Popen[bytes]] = []
    scaler = Scaler(0, 2, 8, up_cooldown_s=0.5, down_cooldown_s=1.0)
    async with autoscaling(scaler, tmp_path / "workers.log", started) as (a, task):
        sent = await harness.enqueue(STAGE, [{"value": i} for i in range(24)], deadline_in=120)

        async def answered() -> bool:
            return bool(await replies_in(redis, replies) >= 24)

        async def at_zero() -> bool:
            return not a.running[STAGE] and not a.draining

        await until(answered, task)
        await until(at_zero, task)
    got = await answers(redis, replies)
    assert sorted(r.id for r in got) == sorted(r.id for r in sent)
    moves = [(old, new) for _, old, new, _ in decisions(caplog)]
    assert moves[0][0] == 0  # woken from zero
    assert max(new for _, new in moves) == 2
    assert moves[-2:] == [(2, 1), (1, 0)]  # and back, one at a time
    assert [p.returncode for p in started] == [0] * len(started)  # all drained
    assert len((await stage_status(redis, harness.keys, STAGE)).consumers) == 0


# --- the command -------------------------------------------------------------------------


def _children(pid: int) -> set[int]:
    """Processes whose parent is ``pid``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.add(int(stat.parent.name))
    return found


def _alive(pids: set[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def _start_up(cmd: list[str], env: dict[str, str], log: Path) -> Popen[bytes]:
    with log.open("wb") as out:
        return Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


async def test_up_autoscale_scales_a_model_stage_and_stops_everything_on_ctrl_c(
    tmp_path: Path, redis_url: str, namespace: str, cache_dir: Path
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {
        "CONVEYOR_REDIS_URL": redis_url,
        "CONVEYOR_NAMESPACE": namespace,
        "CONVEYOR_CACHE_DIR": str(cache_dir),
        "PYTHONPATH": str(REPO),
        "CONVEYOR_AUTOSCALE_INTERVAL_S": "0.2",
    }
    log = tmp_path / "up.log"
    app = ["--app", "tests.support.scaleapp:pipelines"]
    cmd = [CONVEYOR, "up", "--port", str(port), *app, "--autoscale", "--max-workers", "2"]
    proc = _start_up(cmd, env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            give_up = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/readyz")).status_code == 200:
                        break
                assert time.monotonic() < give_up, log.read_text()
                await asyncio.sleep(0.1)
            posts = [http.post(f"/v1/{STAGE}", json={"value": i}) for i in range(48)]
            answers = await asyncio.gather(*posts)
        assert [r.status_code for r in answers] == [200] * 48, log.read_text()
        assert [r.json()["value"] for r in answers] == [2 * i for i in range(48)]
        text = log.read_text()
        assert f"stage {STAGE}: 0 -> 1 worker(s)" in text, text
        assert f"stage {STAGE}: 1 -> 2 worker(s)" in text, text
        children = _children(proc.pid)
        assert len(children) >= 3, text  # the gateway and two workers
    finally:
        proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(proc.wait, 30)
    assert code == 0, log.read_text()
    assert _alive(children) == []
