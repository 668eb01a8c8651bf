"""Workers are restarted when hung, both images check their health on one Python, and the
deploy notes say what the code does (issue 25, item 12)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from tests.deploy.test_deploy import DEPLOY, ROOT, by_kind, container_env
from tests.helpers import Doubler, Harness, number_stage

SCRIPT = DEPLOY / "healthcheck.sh"
MAX_TIMEOUT_S = 300  # the gateway's CONVEYOR_MAX_TIMEOUT_S in deploy/k8s/config.yaml


def healthcheck(alive_file: Path | None, *args: str) -> int:
    """deploy/healthcheck.sh's exit status for a worker with ``alive_file`` (no gateway
    listens on the port it falls back to)."""
    env = {"PATH": os.environ["PATH"], "CONVEYOR_PORT": "1"}
    if alive_file is not None:
        env["CONVEYOR_ALIVE_FILE"] = str(alive_file)
    return subprocess.run(["sh", str(SCRIPT), *args], env=env, timeout=30).returncode


def test_every_worker_deployment_has_a_startup_and_a_liveness_probe() -> None:
    workers = {
        name: d
        for name, d in by_kind("Deployment").items()
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    }
    assert len(workers) >= 7  # six stages and the optional GPU one
    for name, deployment in workers.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == ["conveyor-healthcheck"], name
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] <= 120, name  # restarted soon
        start = container["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 300, name  # model load
        # The file is where the worker can write it under a read-only root: a mounted volume.
        alive = Path(container_env(deployment)["CONVEYOR_ALIVE_FILE"])
        mounts = {Path(m["mountPath"]) for m in container["volumeMounts"]}
        assert alive.parent in mounts, name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # the age it tolerates is above the longest batch (a request's deadline at most)
    (config,) = [
        m for m in by_kind("ConfigMap").values() if m["metadata"]["name"] == "conveyor-gateway"
    ]
    assert int(config["data"]["CONVEYOR_MAX_TIMEOUT_S"]) == MAX_TIMEOUT_S
    assert re.search(r"max_age=\$\{1:-(\d+)\}", SCRIPT.read_text())[1] == "360"  # type: ignore[index]


def test_both_images_check_health_with_the_script_on_one_python_minor() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!deploy/healthcheck.sh" in ignored  # in the build context though deploy/ is not
    minors = {}
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (DEPLOY / dockerfile).read_text()
        assert "COPY --chmod=755 deploy/healthcheck.sh /usr/local/bin/conveyor-healthcheck" in text
        assert re.search(r'^HEALTHCHECK .*\\\n\s+CMD \["conveyor-healthcheck"\]', text, re.M)
        assert "CONVEYOR_ALIVE_FILE=/tmp/conveyor-alive" in text
        slim = re.search(r"^ARG PYTHON_IMAGE=python:(3\.\d+)-slim", text, re.M)
        ubuntu = re.search(r"^ARG CUDA_IMAGE=\S+-ubuntu(\d\d\.\d\d)", text, re.M)
        if slim:
            minors[dockerfile] = slim[1]
        else:
            assert ubuntu, dockerfile
            # The python3 each Ubuntu release ships (the CUDA image installs it by apt).
            minors[dockerfile] = {"22.04": "3.10", "24.04": "3.12", "26.04": "3.14"}[ubuntu[1]]
    assert minors["Dockerfile"] == minors["Dockerfile.cuda"], minors
    readme = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    assert f"python:{minors['Dockerfile']}-slim" in readme


def test_the_deploy_notes_say_streams_are_trimmed() -> None:
    readme = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    assert "XTRIM MINID" in readme
    flat = " ".join(readme.split()).lower()
    for claim in ("not trimmed", "never trimmed", "does not trim", "are not trimmed"):
        assert claim not in flat


async def test_a_worker_touches_its_alive_file_and_the_check_fails_once_it_is_stale(
    harness: Harness, tmp_path: Path
) -> None:
    alive = tmp_path / "alive"
    assert healthcheck(alive) != 0  # before the worker reads: not yet (the startup probe)
    stage = number_stage()
    worker = harness.worker(stage, Doubler(), alive_file=str(alive))
    await harness.enqueue("double", [{"value": 1}])
    assert await worker.run(burst=True) == 1
    assert alive.exists()
    assert time.time() - alive.stat().st_mtime < 60
    assert healthcheck(alive) == 0
    stale = time.time() - 400  # a loop that has not come round for 400 s: hung
    os.utime(alive, (stale, stale))
    assert healthcheck(alive) != 0
    assert healthcheck(alive, "600") == 0  # the age it tolerates is its argument
