"""Placement without a GPU: a simulated device list (``CONVEYOR_GPUS``), packed shares,
spanning models, refusals, each process's ``CUDA_VISIBLE_DEVICES`` and threads, the
stages sharing one model's process, and the autoscaler placing the workers it adds."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import Popen

import pytest
from pydantic import ValidationError

from bench.rss import children
from conveyor.autoscale import AutoscaleSettings
from conveyor.embedded import free_port
from conveyor.placement import (
    GpuPool,
    Group,
    Placed,
    PlacementError,
    PlacementSettings,
    Placer,
    visible_gpus,
    worker_groups,
)
from conveyor.supervisor import Supervisor
from pipelines.builtin import builtin_pipelines
from pipelines.errors import ConfigError
from pipelines.registry import Registry, load_registry
from pipelines.stages import BUILTIN, Resources, Stage, TextIn
from runtime.status import StageStatus
from tests.helpers import REPO, up_env, wait_for_line

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))


def placer(gpus: int, cores: int = 8, processes: int = 4, threads: int | None = None) -> Placer:
    """A placer over ``gpus`` simulated GPUs."""
    return Placer(GpuPool([str(i) for i in range(gpus)]), cores, processes, threads)


def where(placed: list[Placed]) -> list[tuple[str, str]]:
    """(group, CUDA_VISIBLE_DEVICES) of each process."""
    return [(p.group.name, p.env().get("CUDA_VISIBLE_DEVICES", "-")) for p in placed]


# --- packing ------------------------------------------------------------------------------


def test_shares_are_packed_biggest_first_onto_the_first_gpu_with_room() -> None:
    place = placer(3)
    got = place.all([Group(("light",), 3, gpus=0.5), Group(("heavy",), 1, gpus=1)])
    # heavy (1) first: GPU 0; then the halves fill GPU 1 before GPU 2 is touched.
    assert where(got) == [("light", "1"), ("light", "1"), ("light", "2"), ("heavy", "0")]
    assert place.pool.free == [0, 0, 500]


def test_tenths_add_up_exactly_to_one_gpu() -> None:
    place = placer(1)
    assert len(place.all([Group(("t",), 10, gpus=0.1)])) == 10
    with pytest.raises(PlacementError):
        place.one(Group(("t",), gpus=0.1))


def test_a_model_spanning_two_gpus_takes_two_untouched_ones() -> None:
    place = placer(4)
    got = place.all([Group(("small",), 1, gpus=0.25), Group(("big",), 1, gpus=2)])
    assert where(got) == [("small", "2"), ("big", "0,1")]
    # GPU 2 holds a quarter, so a second spanning model has only GPU 3 untouched.
    with pytest.raises(PlacementError, match=r"big: a worker asking 2 GPU does not fit"):
        place.one(Group(("big",), gpus=2))


def test_shares_that_do_not_fit_are_refused_naming_the_stage_and_the_numbers() -> None:
    place = placer(2)
    groups = [Group(("embed",), 3, gpus=0.75), Group(("ner",), 1, gpus=0.5)]
    with pytest.raises(PlacementError) as caught:
        place.all(groups)
    message = str(caught.value)
    assert "stage(s) embed: a worker asking 0.75 GPU does not fit on the 2 visible GPU(s)" in (
        message
    )
    assert "2.75 GPU asked in all (embed 3x0.75, ner 1x0.5)" in message
    assert place.pool.free == [1000, 1000]  # nothing stays reserved after a refusal


def test_a_share_with_no_gpu_visible_is_refused_saying_how_to_simulate_one() -> None:
    with pytest.raises(PlacementError, match=r"no GPU is visible.*CONVEYOR_GPUS=N simulates"):
        placer(0).all([Group(("embed",), 1, gpus=0.5)])


def test_a_cpu_stage_asking_a_gpu_is_refused() -> None:
    with pytest.raises(PlacementError, match="embed: device cpu, but 1 GPU asked"):
        placer(2).all([Group(("embed",), 1, gpus=1, cpu=True)])


def test_workers_reserving_nothing_are_spread_over_the_gpus_not_piled_on_gpu_0() -> None:
    place = placer(4)
    got = place.all(
        [
            Group(("embed",), 4),  # no share: spread, most free first
            Group(("ner",), 1, gpus=1),
            Group(("echo",), 1, cpu=True),  # device cpu: no GPU
            Group(("fn",), 1, light=True),  # the function stages: no GPU
        ]
    )
    assert where(got) == [
        ("embed", "1"),
        ("embed", "2"),
        ("embed", "3"),
        ("embed", "1"),
        ("ner", "0"),
        ("echo", "-"),
        ("fn", "-"),
    ]


def test_a_released_share_can_be_placed_again() -> None:
    place = placer(1)
    first = place.one(Group(("a",), gpus=0.6))
    with pytest.raises(PlacementError):
        place.one(Group(("a",), gpus=0.6))
    place.release(first)
    assert place.one(Group(("a",), gpus=0.6)).devices == ("0",)


# --- which GPUs, which threads --------------------------------------------------------------


def test_the_visible_gpus_are_simulated_else_cuda_visible_devices_else_nvidia_smi() -> None:
    assert visible_gpus(PlacementSettings(gpus=3), {}) == ["0", "1", "2"]
    # up's own CUDA_VISIBLE_DEVICES: its children name the same physical GPUs.
    visible = visible_gpus(PlacementSettings(), {"CUDA_VISIBLE_DEVICES": "2, 3"})
    assert visible == ["2", "3"]
    assert visible_gpus(PlacementSettings(), {"CUDA_VISIBLE_DEVICES": ""}) == []
    place = Placer(GpuPool(visible), 8, 2)
    assert place.one(Group(("a",), gpus=1)).env()["CUDA_VISIBLE_DEVICES"] == "2"


def test_threads_divide_the_cores_among_the_model_processes_unless_a_stage_says() -> None:
    place = placer(0, cores=8, processes=3)
    assert place.one(Group(("embed",))).threads == 2
    assert place.one(Group(("ner",), threads=6)).threads == 6
    assert place.one(Group(("fn",), light=True)).threads is None
    assert placer(0, cores=2, processes=5).one(Group(("x",))).threads == 1  # at least 1
    assert placer(0, cores=8, processes=3, threads=4).one(Group(("x",))).threads == 4
    placed = place.one(Group(("embed",)))
    assert placed.env() == {"CONVEYOR_THREADS": "2"}  # no GPU: CUDA_VISIBLE_DEVICES as it was


# --- groups ---------------------------------------------------------------------------------


def builtin(*names: str) -> Registry:
    """The built-in pipelines ``names``."""
    return Registry(builtin_pipelines()).select(names)


def names(groups: list[Group]) -> list[str]:
    """Each group's stages, comma-separated."""
    return [g.name for g in groups]


def test_the_stages_on_minilm_share_one_process_by_default() -> None:
    registry = load_registry(None, None)
    groups = worker_groups(registry, None, PlacementSettings())
    assert names(groups)[:3] == ["embed,sentiment,summarize", "ner", "generate"]
    # Each stage is still its own stream: the hub profile loads three different models.
    hub = worker_groups(registry, None, PlacementSettings(model_profile="hub"))
    assert names(hub)[:5] == ["embed", "sentiment", "ner", "summarize", "generate"]


def test_a_stage_on_other_weights_or_another_device_leaves_the_shared_process() -> None:
    registry = builtin("embed", "sentiment", "summarize")
    other = PlacementSettings(models={"sentiment": "tiny:sentiment"})
    assert names(worker_groups(registry, None, other)) == ["embed,summarize", "sentiment"]
    moved = PlacementSettings(resources={"summarize": Resources(device="cpu")})
    groups = worker_groups(registry, None, moved)
    assert [(g.name, g.cpu) for g in groups] == [("embed,sentiment", False), ("summarize", True)]
    alone = PlacementSettings(share_models=False)
    assert names(worker_groups(registry, None, alone)) == ["embed", "sentiment", "summarize"]


def test_a_shared_process_takes_the_most_its_stages_ask() -> None:
    registry = builtin("embed", "sentiment", "summarize")
    settings = PlacementSettings(
        resources={"embed": Resources(gpus=0.5, threads=2), "summarize": Resources(threads=3)}
    )
    (group,) = worker_groups(registry, None, settings)
    assert (group.gpus, group.threads, group.replicas) == (0.5, 3, 1)
    (group,) = worker_groups(registry, 2, settings)
    assert group.replicas == 2


def test_resources_for_a_stage_not_served_are_refused() -> None:
    settings = PlacementSettings(resources={"embd": Resources(gpus=1)})
    with pytest.raises(ConfigError, match="CONVEYOR_RESOURCES names 'embd', which no served"):
        worker_groups(builtin("embed"), None, settings)


# --- the settings forms ------------------------------------------------------------------


def test_resources_are_read_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_RESOURCES", '{"embed": {"gpus": 0.5, "threads": 2}}')
    monkeypatch.setenv("CONVEYOR_GPUS", "4")
    settings = PlacementSettings()
    assert settings.resources == {"embed": Resources(gpus=0.5, threads=2)}
    assert settings.gpus == 4
    embed = BUILTIN["embed"].with_resources(settings.resources["embed"])
    assert (embed.gpus, embed.threads, embed.device, embed.max_batch_size) == (0.5, 2, None, 32)
    monkeypatch.setenv("CONVEYOR_RESOURCES", '{"embed": {"gpus": 1.5, "device": "gpu"}}')
    with pytest.raises(ValidationError) as caught:
        PlacementSettings()
    errors = {".".join(map(str, e["loc"])) for e in caught.value.errors()}
    assert errors == {"resources.embed.gpus", "resources.embed.device"}


def test_a_stage_states_its_resources_and_bad_ones_are_refused_naming_it() -> None:
    stage = Stage("big", TextIn, "m:M", gpus=2, threads=4, device="cuda", memory_mb=9000)
    assert (stage.gpus, stage.threads, stage.device, stage.memory_mb) == (2, 4, "cuda", 9000)
    for bad, msg in [
        ({"gpus": 1.5}, "gpus: above 1 must be a whole number"),
        ({"gpus": -1}, "gpus: Input should be greater than or equal to 0"),
        ({"threads": 0}, "threads: Input should be greater than or equal to 1"),
        ({"device": "cuda:x"}, "device: must be auto, cpu, cuda or cuda:N"),
    ]:
        with pytest.raises(ConfigError, match=f"stage 'big': {re.escape(msg)}"):
            Stage("big", TextIn, "m:M", **bad)  # type: ignore[arg-type]


# --- the supervisor and the autoscaler ---------------------------------------------------------


class StandIn(Supervisor):
    """A supervisor whose worker processes are stand-ins (``sleep``); what each was to run,
    and with what environment, is kept in :attr:`asked`."""

    asked: dict[int, tuple[list[str], dict[str, str]]]

    def _spawn(self, module: str, *argv: str, env: dict[str, str] | None = None) -> Popen[bytes]:
        proc = Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.__dict__.setdefault("asked", {})[proc.pid] = ([module, *argv], env or {})
        return proc


def test_the_autoscaler_places_the_workers_it_adds_and_frees_their_share_when_they_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="conveyor.autoscale")
    supervisor = StandIn({}, placer(1))
    group = Group(("embed", "sentiment"), gpus=0.5)
    stages = {n: BUILTIN[n] for n in group.stages}
    scaling = AutoscaleSettings(min_workers=1, max_workers=3, up_cooldown_s=0, down_cooldown_s=0)
    supervisor.start_autoscaler([group], stages, scaling)
    scaler = supervisor.autoscaler
    assert scaler is not None
    name = "embed,sentiment"
    try:
        # The two stages' backlogs add up: 40 + 40 over a target of 32 asks for 3 workers.
        busy = {s: StageStatus(s, lag=40) for s in group.stages}
        scaler.apply(busy, now=0.0)  # from none: min_workers at once
        scaler.apply(busy, now=0.5)
        procs = scaler.running[name]
        assert len(procs) == 2  # a third half does not fit on the one GPU
        placed = {"CUDA_VISIBLE_DEVICES": "0", "CONVEYOR_THREADS": "1"}  # on a GPU: few
        assert [supervisor.asked[p.pid] for p in procs] == [(["workers", name], placed)] * 2
        assert "stage embed,sentiment: stays at 2 worker(s): stage(s) embed,sentiment" in (
            caplog.text
        )
        idle = {s: StageStatus(s) for s in group.stages}
        scaler.apply(idle, now=1.0)
        scaler.apply(idle, now=2.0)  # one goes (SIGTERM), its share once it has exited
        assert len(scaler.running[name]) == 1
        gone = scaler.draining[0][1]
        gone.wait(10)
        scaler.reap(now=3.0)
        assert supervisor.placer is not None
        assert supervisor.placer.pool.free == [500]
        scaler.apply(busy, now=4.0)
        assert len(scaler.running[name]) == 2  # placed again on the freed half
    finally:
        for _, proc in scaler.processes():
            proc.kill()
            proc.wait()


# --- conveyor up, end to end ------------------------------------------------------------------


def environ(pid: int) -> dict[str, str]:
    """A running process's environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().partition("=")[::2] for kv in raw if b"=" in kv)


def test_up_starts_each_worker_with_its_own_gpus_and_threads(tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    resources = '{"adder": {"gpus": 0.5}, "multiplier": {"gpus": 1, "threads": 3}}'
    env = up_env(CONVEYOR_GPUS="2", CONVEYOR_RESOURCES=resources)
    cmd = [CONVEYOR, "up", "--port", str(free_port()), "--pipelines", "chain"]
    with log.open("wb") as out:
        up = Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        text = wait_for_line(log, "conveyor: ready:", up, limit_s=90)
        assert "conveyor: placement: GPU(s) 0,1;" in text
        assert "conveyor: worker adder#0: GPU 1 (0.5 reserved)" in text
        assert "conveyor: worker multiplier#0: GPU 0 (1 reserved), 3 torch thread(s)" in text
        workers = {}
        for pid in children(up.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"workers" in cmdline:
                workers[cmdline[cmdline.index(b"workers") + 1].decode()] = environ(pid)
        assert workers["adder"]["CUDA_VISIBLE_DEVICES"] == "1"
        assert workers["multiplier"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert workers["multiplier"]["CONVEYOR_THREADS"] == "3"
        assert workers["adder"]["CONVEYOR_THREADS"] == "1"  # on a GPU: few, whatever the cores
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, log.read_text()


def test_up_refuses_shares_that_do_not_fit_before_starting_anything() -> None:
    resources = '{"adder": {"gpus": 0.5}, "multiplier": {"gpus": 1}}'
    env = up_env(CONVEYOR_GPUS="1", CONVEYOR_RESOURCES=resources)
    run = subprocess.run(
        [CONVEYOR, "up", "--port", str(free_port()), "--pipelines", "chain"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "stage(s) adder: a worker asking 0.5 GPU does not fit on the 1 visible GPU(s)" in (
        run.stderr
    )
    assert "1.5 GPU asked in all (adder 1x0.5, multiplier 1x1)" in run.stderr
    assert "embedded redis" not in run.stdout  # refused before anything started
