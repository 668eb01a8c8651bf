"""The torch threads of a process, by device: one rule (:mod:`workers.threads`) for
``conveyor up``'s placement, a bare ``python -m workers`` and the bench; a worker on cuda
runs few, however many cores the host has (issue 24: 16 spinning threads took a batch of
32 from 20 ms to 98 ms on an H100 host). cuda is simulated: a model that names it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.workloads import in_process_threads
from conveyor.placement import GpuPool, Group, PlacementSettings, Placer, worker_groups
from pipelines.registry import Registry
from pipelines.stages import Resources
from tests.helpers import up_env, wait_for_line, worker_process
from tests.support.deviceapp import ON_DEVICE
from tests.support.deviceapp import pipelines as device_pipelines
from workers.build import build_model
from workers.settings import WorkerSettings
from workers.threads import resolved_device, torch_threads

MANY = 64
"""Cores of the simulated big host."""


def test_on_cuda_few_threads_however_many_cores() -> None:
    assert torch_threads("cuda", cores=MANY) == 1
    assert torch_threads("cuda:3", cores=MANY, processes=1) == 1
    assert torch_threads("cuda", cuda_threads=2, cores=MANY) == 2  # CONVEYOR_CUDA_THREADS
    assert torch_threads("cuda") == 1  # a bare worker, cores unknown


def test_on_cpu_the_cores_are_divided_else_torchs_default() -> None:
    assert torch_threads("cpu", cores=MANY, processes=4) == 16
    assert torch_threads("cpu", cores=2, processes=5) == 1  # at least 1
    assert torch_threads("cpu") is None  # a bare worker keeps torch's default


def test_a_stage_then_conveyor_threads_win_over_the_device() -> None:
    assert torch_threads("cuda", asked=6, setting=4, cores=MANY) == 6
    assert torch_threads("cuda", setting=4, cores=MANY) == 4
    assert torch_threads("cpu", setting=4, cores=MANY, processes=4) == 4


def test_the_cuda_threads_are_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().cuda_threads == 1
    monkeypatch.setenv("CONVEYOR_CUDA_THREADS", "2")
    assert WorkerSettings().cuda_threads == 2
    monkeypatch.setenv("CONVEYOR_CUDA_THREADS", "0")
    with pytest.raises(ValueError, match="cuda_threads"):
        WorkerSettings()


def test_the_device_is_the_models_own_else_the_setting() -> None:
    assert resolved_device("auto", ON_DEVICE.factory()(device="cuda:1")) == "cuda:1"
    assert resolved_device("cuda") == "cuda"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved_device("auto") == expected


# --- the three entry points' paths ---------------------------------------------------------


def test_up_places_a_gpu_worker_with_one_thread_on_a_many_core_host() -> None:
    place = Placer(GpuPool(["0"]), MANY, 2)
    on_gpu = place.one(Group(("embed",)))
    assert (on_gpu.devices, on_gpu.threads) == (("0",), 1)
    assert on_gpu.env() == {"CUDA_VISIBLE_DEVICES": "0", "CONVEYOR_THREADS": "1"}
    assert "1 torch thread(s)" in on_gpu.describe()
    assert place.one(Group(("ner",), cpu=True)).threads == MANY // 2
    # device cuda where up sees no GPU (no nvidia-smi in its container): still few.
    assert Placer(GpuPool([]), MANY, 2).one(Group(("x",), cuda=True)).threads == 1
    assert Placer(GpuPool(["0"]), MANY, 2, cuda_threads=2).one(Group(("x",))).threads == 2
    settings = PlacementSettings(device="cuda:0")
    (group,) = worker_groups(Registry(device_pipelines), None, settings)
    assert group.cuda


@pytest.fixture
def kept_threads() -> Iterator[None]:
    """torch's intra-op threads restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("kept_threads")
def test_a_worker_whose_model_is_on_cuda_runs_one_thread() -> None:
    torch.set_num_threads(2)
    build_model(ON_DEVICE.with_resources(Resources(device="cuda")), WorkerSettings())
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    build_model(ON_DEVICE, WorkerSettings(device="cuda", cuda_threads=2, threads=None))
    assert torch.get_num_threads() == 2
    build_model(ON_DEVICE, WorkerSettings(device="cpu"))  # torch's default: left as it is
    assert torch.get_num_threads() == 2


def test_the_bench_in_process_follows_the_workers_rule() -> None:
    assert in_process_threads("cuda") == 1
    assert in_process_threads("cuda:0", threads=4) == 4
    assert in_process_threads("cpu") is None


@pytest.mark.parametrize(
    ("device", "line"),
    [
        ("cpu", r"stage ondevice: on cpu, \d+ torch thread\(s\) \(torch's default\)"),
        ("cuda", r"stage ondevice: on cuda, 1 torch thread\(s\)\n"),
    ],
)
def test_a_bare_worker_process_chooses_its_threads_by_device(
    tmp_path: Path, redis_url: str, namespace: str, device: str, line: str
) -> None:
    log = tmp_path / "worker.log"
    env = up_env(
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_NAMESPACE=namespace,
        CONVEYOR_APP="tests.support.deviceapp:pipelines",
        CONVEYOR_PIPELINES="ondevice",
        CONVEYOR_DEVICE=device,
    )
    worker = worker_process(log, env, "ondevice")
    try:
        wait_for_line(log, "stage ondevice: on ", worker, limit_s=90)
        text = wait_for_line(log, "torch thread(s)", worker, limit_s=10)
        assert re.search(line, text), text
    finally:
        worker.terminate()
        assert worker.wait(timeout=30) == 0, log.read_text()
