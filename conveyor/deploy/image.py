"""An app's image, built by ``docker compose build`` from the app's folder with nothing
published by us: conveyor's own wheel (:mod:`conveyor.deploy.wheel`) in the deploy folder,
multi-stage Dockerfiles from a pinned Python (or CUDA) base, an ignore file beside each,
and the model weights its stages name (:mod:`conveyor.deploy.weights`).

The build context is the app's folder; what it must never send (secrets, ``up``'s Redis
data, virtualenvs, caches, the deploy folder but the wheel) is kept out by
``<Dockerfile>.dockerignore`` beside the Dockerfile, which BuildKit (``docker compose``
v2, ``docker build`` since Engine 23) reads instead of the folder's own ``.dockerignore``.
A builder that does not read it would send the lot: the build then fails on its guard step
before anything reaches the image.
"""

# ruff: noqa: E501  (lines of the Dockerfile and script written are as wide as those files)

from __future__ import annotations

import json
from pathlib import Path

from conveyor.deploy import CUDA_IMAGE, PYTHON_IMAGE, Plan
from conveyor.deploy.weights import HUB_DIR
from pipelines.errors import ConfigError

TORCH_VERSION = "2.13.0"
"""The torch both images install, named in the same pip command as conveyor."""

TORCH_CUDA = "cu128"
"""The CUDA build of torch the CUDA image installs (CUDA_IMAGE's major.minor)."""

PLACEHOLDERS = {
    "REDIS_GATEWAY_PASSWORD": "change-me-gateway",
    "REDIS_WORKER_PASSWORD": "change-me-worker",
}
"""What ``.env.example`` holds until the user sets secrets."""

SECRETS = (
    "**/.env",
    "**/.env.*",
    "**/*.env",
    "**/*.pem",
    "**/*.key",
    "**/.netrc",
    "**/.pypirc",
    "**/.git-credentials",
    "**/.aws",
    "**/.ssh",
    "**/.docker",
    "**/.kube",
    "**/.envrc",
    "**/.npmrc",
    "**/*.p12",
    "**/*.pfx",
    "**/id_rsa*",
    "**/id_ed25519*",
    "**/id_ecdsa*",
    "**/credentials*.json",
    "**/secret*.yaml",
)
"""Secrets, wherever they are in the app's folder."""

CACHES = (
    "**/.git",
    "**/.hg",
    "**/.svn",
    "**/.venv",
    "**/venv",
    "**/.virtualenv",
    "**/.tox",
    "**/.nox",
    "**/__pycache__",
    "**/*.py[cod]",
    "**/.mypy_cache",
    "**/.ruff_cache",
    "**/.pytest_cache",
    "**/.ipynb_checkpoints",
    "**/*.egg-info",
    "**/node_modules",
    "**/.DS_Store",
)
"""Version control, virtualenvs and caches: nothing the image runs."""

HEALTHCHECK = """#!/bin/sh
# conveyor's health check, for both images (Docker HEALTHCHECK, Kubernetes exec probes).
#   conveyor-healthcheck [MAX_AGE_S]
# A worker: its loop touches $CONVEYOR_ALIVE_FILE each time it comes round (workers/alive.py);
# healthy while the file is younger than MAX_AGE_S (default 360: above the longest a batch
# may run, CONVEYOR_MAX_TIMEOUT_S 300, so only a loop that stopped coming round fails).
# Anything else (the gateway, or a worker still loading its model): GET /healthz answers.
max_age=${1:-360}
if [ -n "$CONVEYOR_ALIVE_FILE" ] && [ -e "$CONVEYOR_ALIVE_FILE" ]; then
    age=$(( $(date +%s) - $(stat -c %Y "$CONVEYOR_ALIVE_FILE") ))
    [ "$age" -lt "$max_age" ]
else
    exec python3 -c "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CONVEYOR_PORT', '8000'), timeout=4)"
fi
"""
"""``conveyor-healthcheck`` in every image (the shipped deploy/healthcheck.sh is this)."""

_FETCH = (
    "import pathlib, sys; from huggingface_hub import snapshot_download; "
    "token = pathlib.Path('/run/secrets/hf_token'); "
    "[snapshot_download(repo, local_dir=sys.argv[1] + '/' + repo, "
    "token=token.read_text().strip() if token.exists() else None, "
    "ignore_patterns=['*.h5', '*.msgpack', '*.ot', 'tf_model*', 'flax_model*', 'onnx/*', "
    "'*.onnx', 'openvino/*', 'coreml/*']) for repo in sys.argv[2:]]"
)
"""The build step that fetches the hub models (torch weights, config and tokenizer only)."""


def check_env_file(path: Path) -> None:
    """Refuse a deploy folder whose ``.env`` still holds ``.env.example``'s placeholders.

    Raises:
        ConfigError: one line naming the first variable left so.
    """
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        name, eq, value = line.strip().partition("=")
        value = value.strip().strip("'\"")
        if eq and PLACEHOLDERS.get(name.strip().removeprefix("export ").strip()) == value:
            raise ConfigError(
                f"{path}: {name.strip()} is still the .env.example placeholder {value!r}: "
                "set a secret of letters and digits (openssl rand -hex 24)"
            )


def _context_path(plan: Plan, name: str) -> str:
    """``name`` in the deploy folder, as a path in the build context."""
    return f"{plan.out_in_context}/{name}" if plan.out_in_context else name


def ignore_file(plan: Plan) -> str:
    """``<Dockerfile>.dockerignore``: what the build context leaves out (last match wins)."""
    out = plan.out_in_context
    lines = [
        "# What `docker build` leaves out of the app's folder (the build context). BuildKit",
        "# reads this file, beside its Dockerfile, instead of the folder's .dockerignore.",
        "# Written by `conveyor deploy`; the later of two matching lines wins.",
        "",
        "# conveyor up's local Redis data (request payloads and results)",
        ".conveyor",
        "**/.conveyor",
        *([f"{plan.data_dir}"] if plan.data_dir not in ("", ".conveyor") else []),
        "",
        *(
            [
                "# the deploy folder (its .env holds the Redis passwords) but conveyor's wheel",
                "# and the health check the image needs",
                out,
                f"!{out}/wheels",
                f"!{out}/healthcheck.sh",
                "",
            ]
            if out
            else []
        ),
    ]
    if plan.weights.folders:  # before the caches: a model folder's .git stays out
        lines += [
            "# the model folders the stages name: copied with the app",
            *(f"!{folder}" for _, folder in plan.weights.folders),
            "",
        ]
    lines += ["# virtualenvs, version control and caches", *CACHES, ""]
    lines += ["# secrets, wherever they are (last: nothing above lets one back in)", *SECRETS]
    return "\n".join(lines) + "\n"


def _guard(plan: Plan, name: str) -> list[str]:
    """The build step that fails if the context held what the ignore file keeps out."""
    names = [".env", ".envrc", ".conveyor", ".venv", ".git", "*.pem", "*.key", "id_rsa*"]
    tests = " -o ".join(f"-name '{n}'" for n in names)
    lines = [
        "# Nothing secret or local may have come with the context: a builder that skipped",
        "# the ignore file beside this Dockerfile stops here, before the image holds it.",
        f'RUN leaked="$(find /app \\( {tests} \\) -print -quit)"; \\',
        '    if [ -n "$leaked" ]; then \\',
        '        echo "conveyor: $leaked is in the build context: build with BuildKit, which'
        f' reads {_context_path(plan, name)}.dockerignore" >&2; exit 1; \\',
        "    fi",
    ]
    for _, folder in plan.weights.folders:
        lines.append(f'RUN test -d "/app/{folder}"')
    return lines


def dockerfile(plan: Plan, *, cuda: bool = False) -> str:
    """The app's image: multi-stage, from a pinned base, with torch, conveyor's wheel, the
    app's requirements, its folder, and the hub models its stages name.

    Args:
        plan: what is deployed (an app's: ``plan.app`` set).
        cuda: the CUDA image (GPU workers) rather than the CPU one.
    """
    from conveyor.deploy.wheel import wheel_name

    wheel = wheel_name()
    lines = [
        "# syntax=docker/dockerfile:1",
        f"# Your app's {'CUDA' if cuda else 'CPU'} image, written by `conveyor deploy`: conveyor's"
        " own wheel",
        f"# ({_context_path(plan, 'wheels')}), torch, your requirements and your folder in /app,"
        " built from",
        "# the app's folder (compose's build context) with nothing published by conveyor.",
        "# Pin the base by digest: --build-arg "
        + ("CUDA_IMAGE" if cuda else "PYTHON_IMAGE")
        + "=<image>@sha256:<digest>.",
    ]
    if cuda:
        lines += [
            f"ARG CUDA_IMAGE={CUDA_IMAGE}",
            "",
            "FROM ${CUDA_IMAGE} AS base",
            "ENV DEBIAN_FRONTEND=noninteractive",
            "# Ubuntu's python3 follows the base image's release: its digest pins both.",
            "# hadolint ignore=DL3008",
            "RUN apt-get update \\",
            " && apt-get install -y --no-install-recommends python3 python3-venv \\",
            " && rm -rf /var/lib/apt/lists/*",
            "",
            "FROM base AS build",
            f"ARG TORCH_SPEC=torch=={TORCH_VERSION}+{TORCH_CUDA}",
            f"ARG TORCH_INDEX=https://download.pytorch.org/whl/{TORCH_CUDA}",
            "RUN python3 -m venv /opt/venv",
        ]
    else:
        lines += [
            f"ARG PYTHON_IMAGE={PYTHON_IMAGE}",
            "",
            "FROM ${PYTHON_IMAGE} AS base",
            "",
            "FROM base AS build",
            f"ARG TORCH_SPEC=torch=={TORCH_VERSION}+cpu",
            "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu",
            "RUN python -m venv /opt/venv",
        ]
    requirements = " -r /tmp/requirements.txt" if plan.requirements else ""
    lines += [
        "ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1",
        f"COPY {_context_path(plan, 'wheels/' + wheel)} /tmp/wheels/{wheel}",
        *(["COPY requirements.txt /tmp/requirements.txt"] if plan.requirements else []),
        "# torch named in the same pip command as conveyor and your requirements: pip keeps",
        "# this build of it (and never resolves the multi-GB default one).",
        'RUN /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX}" "${TORCH_SPEC}" \\',
        f'        "/tmp/wheels/{wheel}[serve]"{requirements}',
        "COPY . /app",
        *_guard(plan, "Dockerfile.cuda" if cuda else "Dockerfile"),
    ]
    hub = plan.weights.hub_ids
    if hub:
        lines += [
            "",
            "# The hub models your stages name, fetched now. A gated one needs a token, as the",
            "# build secret hf_token: docker build --secret id=hf_token,env=HF_TOKEN ...",
            "FROM build AS models",
            "RUN --mount=type=secret,id=hf_token,required=false \\",
            f'    /opt/venv/bin/python -c "{_FETCH}" \\',
            f"        {HUB_DIR} {' '.join(hub)}",
        ]
    lines += [
        "",
        "FROM base",
        "# 1 (default): load only what the image or the cache volume holds. 0: let",
        "# CONVEYOR_MODEL_PROFILE=hub download models into the cache volume.",
        "ARG HF_HUB_OFFLINE=1",
        "RUN groupadd --system --gid 10001 conveyor \\",
        " && useradd --system --uid 10001 --gid conveyor --home-dir /home/conveyor --create-home \\",
        "        --shell /usr/sbin/nologin conveyor \\",
        " && mkdir -p /var/cache/conveyor \\",
        " && chown conveyor:conveyor /var/cache/conveyor",
        "COPY --from=build /opt/venv /opt/venv",
        "COPY --from=build /app /app",
        *([f"COPY --from=models {HUB_DIR} {HUB_DIR}"] if hub else []),
        f"COPY --chmod=755 {_context_path(plan, 'healthcheck.sh')}"
        " /usr/local/bin/conveyor-healthcheck",
        "# TOKENIZERS_PARALLELISM is a setting of the tokenizers library, not a secret.",
        "# hadolint ignore=DL3064",
        "ENV PATH=/opt/venv/bin:$PATH \\",
        "    PYTHONUNBUFFERED=1 \\",
        "    PYTHONDONTWRITEBYTECODE=1 \\",
        "    TOKENIZERS_PARALLELISM=false \\",
        "    HF_HUB_OFFLINE=${HF_HUB_OFFLINE} \\",
        "    HF_HOME=/var/cache/conveyor/huggingface \\",
        "    XDG_CACHE_HOME=/var/cache/conveyor/xdg \\",
        "    CONVEYOR_CACHE_DIR=/var/cache/conveyor \\",
        "    CONVEYOR_HOST=0.0.0.0 \\",
        "    CONVEYOR_PORT=8000 \\",
        "    CONVEYOR_ALIVE_FILE=/tmp/conveyor-alive \\",
        *(["    CONVEYOR_DEVICE=cuda \\"] if cuda else []),
        f"    CONVEYOR_APP={plan.app} \\",
        f"    CONVEYOR_PIPELINES={plan.pipelines}",
    ]
    if hub:
        models = {stage: f"{HUB_DIR}/{repo}" for stage, repo in plan.weights.hub}
        lines += [
            "# Each stage that names a hub id loads the copy fetched above, whatever the profile.",
            f"ENV CONVEYOR_MODELS='{json.dumps(models, sort_keys=True)}'",
        ]
    lines += [
        'VOLUME ["/var/cache/conveyor"]',
        "USER 10001:10001",
        "WORKDIR /app",
        "EXPOSE 8000",
        "HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \\",
        '    CMD ["conveyor-healthcheck"]',
        "STOPSIGNAL SIGTERM",
        'CMD ["conveyor", "gateway"]',
    ]
    return "\n".join(lines) + "\n"


def files(plan: Plan) -> dict[str, str]:
    """The image's text files, by path relative to the deploy folder (the wheel apart:
    :func:`conveyor.deploy.wheel.build_wheel`)."""
    if plan.app is None:
        return {}
    out = {
        "Dockerfile": dockerfile(plan),
        "Dockerfile.dockerignore": ignore_file(plan),
        "healthcheck.sh": HEALTHCHECK,
    }
    if any(w.gpus > 0 for w in plan.workers):
        out["Dockerfile.cuda"] = dockerfile(plan, cuda=True)
        out["Dockerfile.cuda.dockerignore"] = ignore_file(plan)
    return out
