"""``conveyor deploy compose|k8s``: the files it writes for a user's app validate with the
real tools (docker-compose, kubernetes-validate, KEDA's CRD schema), carry the app, its GPUs
and the registry, and the shipped deploy/ is its output for the built-ins (issue 29, item 6).
The image's build itself: tests/deploy/test_image.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conveyor.deploy import shipped_files
from tests.deploy.kedacrd import assert_match_keda_crd
from tests.deploy.test_deploy import _compose_cli, interpolate
from tests.helpers import REPO

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))
REGISTRY = "ghcr.io/me/"
APP = '''"""A user's app with a GPU stage."""

from typing import Any

from pydantic import BaseModel

from pipelines.graph import Pipeline, function, model
from pipelines.stages import Stage


class Text(BaseModel):
    text: str


def tidy(payload: dict[str, Any]) -> dict[str, Any]:
    return payload


big = Stage(
    "big", Text, runner="tests.helpers:Doubler", gpus=0.5, threads=4, memory_mb=4096,
    replicas=2, max_batch_size=16,
)
small = Stage("small", Text, runner="tests.helpers:Doubler")
pipelines = [
    Pipeline("gpuapp", Text, (model("big", big, then="tidy"), function("tidy", tidy))),
    Pipeline("cpuapp", Text, (model("small", small),)),
]
'''


def run_deploy(
    folder: Path,
    *args: str,
    app: str = "gpuapp:pipelines",
    settings: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``conveyor deploy ARGS --app APP --out out`` in ``folder``, with no CONVEYOR_*
    variable but ``settings`` (and ``extra`` variables, e.g. ``PYTHONHASHSEED``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= (settings or {}) | (extra or {})
    env["PYTHONPATH"] = str(REPO)
    cmd = [CONVEYOR, "deploy", *args, "--app", app, "--out", "out"]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def deploy(
    folder: Path,
    *args: str,
    app: str = "gpuapp:pipelines",
    settings: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> Path:
    """:func:`run_deploy`, which must succeed; the folder it wrote."""
    done = run_deploy(folder, *args, app=app, settings=settings, extra=extra)
    assert done.returncode == 0, done.stderr
    return folder / "out"


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "gpuapp.py").write_text(APP)
    (tmp_path / "requirements.txt").write_text("numpy\n")
    return tmp_path


def test_shipped_deploy_is_the_generators_output() -> None:
    drift = [rel for rel, text in shipped_files(REPO).items() if (REPO / rel).read_text() != text]
    assert drift == [], f"regenerate with `python -m conveyor.deploy`: {drift}"


def test_compose_for_an_app_validates_and_carries_app_gpus_and_registry(app: Path) -> None:
    out = deploy(app, "compose", "--registry", REGISTRY)
    assert {p.name for p in (out / "redis").iterdir()} == {
        "redis.conf",
        "users.acl",
        "render-acl.sh",
    }
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker-compose to validate with (apt: docker-compose)")
    (out / ".env").write_text("REDIS_GATEWAY_PASSWORD=gw\nREDIS_WORKER_PASSWORD=wk\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "CONVEYOR_"))}
    checked = subprocess.run(
        [*cli, "-f", str(out / "compose.yaml"), "config"],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert checked.returncode == 0, checked.stderr
    services = yaml.safe_load(checked.stdout)["services"]
    assert set(services) == {"redis", "gateway", "worker-big", "worker-small", "worker-gpuapp"}
    conf = yaml.safe_load((out / "compose.yaml").read_text())
    raw = interpolate(conf, {"REDIS_GATEWAY_PASSWORD": "gw", "REDIS_WORKER_PASSWORD": "wk"})
    for name, service in raw["services"].items():
        if name == "redis":
            continue
        assert service["image"].startswith(REGISTRY), name
        (arg,) = service["build"]["args"]  # the base: an image of Docker Hub's, not ours
        assert arg == ("CUDA_IMAGE" if name == "worker-big" else "PYTHON_IMAGE"), name
        assert service["environment"]["CONVEYOR_APP"] == "gpuapp:pipelines", name
    big = raw["services"]["worker-big"]
    assert big["image"] == f"{REGISTRY}gpuapp:cuda"
    (device,) = big["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 1
    assert device["driver"] == "nvidia"
    assert big["deploy"]["resources"]["limits"]["cpus"] == "4"
    assert big["environment"]["CONVEYOR_THREADS"] == "4"
    assert "devices" not in raw["services"]["worker-small"]["deploy"]["resources"]["reservations"]
    assert raw["services"]["worker-gpuapp"]["command"] == ["conveyor", "worker", "gpuapp.tidy"]
    dockerfile = (out / "Dockerfile").read_text()
    assert "FROM ${PYTHON_IMAGE} AS base" in dockerfile  # tests/deploy/test_image.py
    assert "-r /tmp/requirements.txt" in dockerfile
    assert "CONVEYOR_APP=gpuapp:pipelines" in dockerfile
    assert big["build"]["context"] == ".."
    assert (app / big["build"]["dockerfile"]).resolve() == out / "Dockerfile.cuda"
    small = raw["services"]["worker-small"]["build"]
    assert (app / small["dockerfile"]).resolve() == out / "Dockerfile"


def _documents(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    return [
        (str(p.relative_to(folder)), d)
        for p in sorted(folder.rglob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


def test_k8s_for_an_app_validates_and_asks_its_gpus(app: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate.utils")
    out = deploy(app, "k8s", "--registry", REGISTRY) / "k8s"
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["resources"][0] == "namespace.yaml"
    assert all((out / r).is_file() for r in kustomization["resources"])
    first = next(yaml.safe_load_all((out / "secret.example.yaml").read_text()))
    assert first["kind"] == "Namespace"  # applies alone, before the folder
    docs = _documents(out)
    for where, doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's CRDs: test_k8s_keda_objects_for_an_app_match_kedas_crd
        try:
            kv.validate(doc, kv.latest_version(), strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{where}: {exc}")
    deployments = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"gateway", "worker-big", "worker-small", "worker-gpuapp"}
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"].startswith(REGISTRY), name
        if name != "gateway":
            assert container["startupProbe"], name
            assert container["livenessProbe"], name
    big = deployments["worker-big"]["spec"]["template"]["spec"]["containers"][0]
    assert big["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert big["image"] == f"{REGISTRY}gpuapp:cuda"
    assert (
        "nvidia.com/gpu"
        not in deployments["worker-small"]["spec"]["template"]["spec"]["containers"][0][
            "resources"
        ]["limits"]
    )
    config = next(d for _, d in docs if d["metadata"]["name"] == "conveyor-common")
    assert config["data"]["CONVEYOR_APP"] == "gpuapp:pipelines"
    scaled = {
        d["spec"]["scaleTargetRef"]["name"]: d for _, d in docs if d["kind"] == "ScaledObject"
    }
    assert set(scaled) == {"worker-big", "worker-small", "worker-gpuapp"}
    assert scaled["worker-big"]["spec"]["minReplicaCount"] == 2  # the stage's replicas
    streams = {t["metadata"]["stream"] for t in scaled["worker-big"]["spec"]["triggers"]}
    assert streams == {"{conveyor}:stage:big", "{conveyor}:stage:big:bulk"}
    counts = {t["metadata"].get("lagCount") for t in scaled["worker-big"]["spec"]["triggers"]}
    assert counts == {"32", None}  # max_batch_size 16 x 2 batches in flight


def test_k8s_with_an_external_redis_writes_no_redis(app: Path) -> None:
    out = deploy(app, "k8s", "--redis-url", "redis://cache.example.com:6380/0") / "k8s"
    assert not (out / "redis.yaml").exists()
    assert "redis.yaml" not in yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
    docs = _documents(out)
    addresses = {
        t["metadata"]["address"]
        for _, d in docs
        if d["kind"] == "ScaledObject"
        for t in d["spec"]["triggers"]
    }
    assert addresses == {"cache.example.com:6380"}
    secret = next(d for _, d in docs if d["kind"] == "Secret")
    assert "@cache.example.com:6380/0" in secret["stringData"]["worker-redis-url"]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"CONVEYOR_PARTITIONS": "3"},
        {"CONVEYOR_PARTITIONS": "2", "CONVEYOR_REDIS_URL": "redis+cluster://redis-0:6379"},
    ],
    ids=["one-partition", "partitions", "cluster"],
)
def test_k8s_keda_objects_for_an_app_match_kedas_crd(app: Path, settings: dict[str, str]) -> None:
    out = deploy(app, "k8s", settings=settings) / "k8s"
    docs = [(w, d) for w, d in _documents(out) if d["apiVersion"].startswith("keda.sh/")]
    kinds = [d["kind"] for _, d in docs]
    assert sorted(kinds) == ["ScaledObject"] * 3 + ["TriggerAuthentication"]
    partitions = int(settings.get("CONVEYOR_PARTITIONS", "1"))
    big = next(d for _, d in docs if d["metadata"]["name"] == "worker-big")
    assert len(big["spec"]["triggers"]) == 4 * partitions  # lag and pending, two lanes each
    assert_match_keda_crd(docs)
