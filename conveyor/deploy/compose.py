"""The compose file (and what it reads beside it) for a :class:`~conveyor.deploy.Plan`:
Redis (AOF, ACL users, no published port), the gateway on loopback, one service per worker.

Written as text rather than dumped from a dict: the comments say why each setting is there,
and they are what a reader of the file meets first.
"""

# ruff: noqa: E501  (lines of the YAML written are as wide as the files they make)

from __future__ import annotations

import json

from conveyor.deploy import REDIS_FILES, Image, Plan, Worker, redis_file
from conveyor.deploy.image import files as image_files

COMPOSE_FILE = "compose.yaml"
"""The compose file's name in a user's output folder."""

SHIPPED_COMPOSE_FILE = "docker-compose.yml"
"""Its name in the shipped deploy/."""


def _q(value: str) -> str:
    """A YAML double-quoted scalar."""
    return json.dumps(value)


def _image(image: Image, indent: str) -> list[str]:
    lines = [
        f"{indent}image: ${{{image.variable}:-{image.name}}}",
        f"{indent}build:",
        f"{indent}  context: {image.build.context}",
        f"{indent}  dockerfile: {image.build.dockerfile}",
    ]
    if image.build.args:
        lines.append(f"{indent}  args:")
        lines += [f"{indent}    {k}: {_q(v)}" for k, v in image.build.args]
    return lines


def _worker(plan: Plan, worker: Worker) -> list[str]:
    lines: list[str] = []
    if worker.variant == "gpu":
        lines += [
            f"  # GPU example, started only with --profile gpu: `{worker.spec}` on"
            f" {worker.gpus} NVIDIA GPU(s)",
            "  # (the host needs the NVIDIA Container Toolkit). It joins the same consumer"
            " group as the",
            f"  # CPU {worker.cpu_name}; scale that one to 0 to leave the stage to the GPU.",
        ]
    elif worker.light:
        lines.append("  # A pipeline's function stages are light: one service serves them all.")
    lines += [f"  {worker.name}:", "    <<: *worker"]
    cuda = worker.gpus > 0
    if cuda:
        lines += _image(plan.cuda_image, "    ")
    if worker.variant:
        lines.append(f'    profiles: ["{worker.variant}"]')
    lines.append(f'    command: ["conveyor", "worker", {_q(worker.spec)}]')
    if worker.replicas > 1:
        lines += ["    scale: " + str(worker.replicas)]
    lines += [
        "    environment:",
        "      <<: *worker-env",
        f'      CONVEYOR_THREADS: "{worker.threads}"',
    ]
    if cuda:
        lines.append("      CONVEYOR_DEVICE: cuda")
    if worker.variant:  # the stage asks no GPU itself: this copy does
        shares = {s: {"gpus": worker.gpus} for s in worker.stages}
        lines += [
            "      # The stage's GPU share; the reservation below is it rounded up to whole GPUs.",
            f"      CONVEYOR_RESOURCES: '{json.dumps(shares)}'",
        ]
    limit = 8192 if cuda else 2 * worker.memory_mb
    lines += [
        f"    stop_grace_period: {worker.drain_s}s",
        "    deploy:",
        "      resources:",
        "        limits:",
        f'          cpus: "{worker.threads}"',
        f"          memory: {limit}m",
        "        reservations:",
        f"          memory: {worker.memory_mb}m",
    ]
    if cuda:
        lines += [
            "          devices:",
            "            - driver: nvidia",
            f"              count: {worker.gpus}",
            "              capabilities: [gpu]",
        ]
    return [*lines, ""]


def compose(plan: Plan) -> str:
    """The compose file's text."""
    name = SHIPPED_COMPOSE_FILE if plan.shipped else COMPOSE_FILE
    where = "deploy" if plan.shipped else "DIR"
    app_env = [f"  CONVEYOR_APP: {plan.app}"] if plan.app else []
    head = [
        "# conveyor on one host: Redis (AOF, ACL users, no published port), the gateway on",
        "# 127.0.0.1:8000, and one worker service per model stage (and per pipeline's function",
        "# stages). Written by `conveyor deploy compose` from the pipelines' stages"
        + (" (the built-ins:" if plan.shipped else ";"),
        (
            "# python -m conveyor.deploy regenerates it; tests/deploy/test_generated.py fails on drift)."
            if plan.shipped
            else "# run it again after changing them rather than editing this file."
        ),
        "#",
        f"#   cp {where}/.env.example {where}/.env          # then set the passwords (see that file)",
        f"#   docker compose -f {where}/{name} up -d --build",
        f"#   docker compose -f {where}/{name} up -d --scale {plan.workers[0].name}=3",
    ]
    if any(w.variant == "gpu" for w in plan.workers):
        gpu = next(w for w in plan.workers if w.variant == "gpu")
        head.append(
            f"#   docker compose -f {where}/{name} --profile gpu up -d --scale {gpu.cpu_name}=0"
        )
    text = [
        *head,
        "",
        "x-image: &image",
        *_image(plan.cpu_image, "  "),
        "",
        "# What the gateway and every worker must agree on: the key namespace and the pipelines",
        "# served (a worker looks its stage up among the stages of these pipelines).",
        "x-conveyor-env: &conveyor-env",
        *app_env,
        f"  CONVEYOR_NAMESPACE: ${{CONVEYOR_NAMESPACE:-{plan.namespace}}}",
        f"  CONVEYOR_PIPELINES: {plan.pipelines}",
        "",
        "x-worker-env: &worker-env",
        "  <<: *conveyor-env",
        "  CONVEYOR_REDIS_URL: redis://worker:${REDIS_WORKER_PASSWORD:?set REDIS_WORKER_PASSWORD"
        f" in {where}/.env}}@redis:6379/0",
        "  CONVEYOR_MODEL_PROFILE: ${CONVEYOR_MODEL_PROFILE:-offline}",
        "  CONVEYOR_DEVICE: cpu",
        "  CONVEYOR_CACHE_DIR: /var/cache/conveyor",
        "  # Touched by the worker's loop; the image's HEALTHCHECK checks its age (on the tmpfs).",
        "  CONVEYOR_ALIVE_FILE: /tmp/conveyor-alive",
        "  HF_HUB_OFFLINE: ${HF_HUB_OFFLINE:-1}",
        "",
        "# Each worker service sets its torch threads (CONVEYOR_THREADS) to its cpus limit, and",
        "# reserves the memory its stages ask (memory_mb).",
        "x-worker: &worker",
        "  <<: *image",
        "  restart: unless-stopped",
        "  init: true",
        "  read_only: true",
        "  tmpfs:",
        "    - /tmp",
        "  depends_on:",
        "    redis:",
        "      condition: service_healthy",
        "  volumes:",
        "    # Generated tiny models (and hub downloads) are built once and shared by every worker.",
        "    - models:/var/cache/conveyor",
        "  # On SIGTERM a worker reads nothing new and finishes the batches it holds, then exits;",
        "  # what it never read stays in the stream for the others (stop_grace_period bounds it).",
        "  stop_signal: SIGTERM",
        "",
        "services:",
        *_redis_service(where, name),
        *_gateway_service(where),
        "  # One service per worker; scale each on its own: --scale worker-<name>=N.",
    ]
    for worker in plan.workers:
        text += _worker(plan, worker)
    text += ["volumes:", "  redis-data:", "  models:"]
    return "\n".join(text) + "\n"


def _redis_service(where: str, name: str) -> list[str]:
    return f"""  redis:
    image: redis:7.4-bookworm
    user: redis
    restart: unless-stopped
    # Render the ACL file from the passwords (as hashes, on a tmpfs), then become redis-server.
    command:
      - sh
      - -c
      - >-
        sh /usr/local/etc/redis/render-acl.sh /usr/local/etc/redis/users.acl /run/redis/users.acl
        && exec redis-server /usr/local/etc/redis/redis.conf
    environment:
      REDIS_GATEWAY_PASSWORD: ${{REDIS_GATEWAY_PASSWORD:?set REDIS_GATEWAY_PASSWORD in {where}/.env}}
      REDIS_WORKER_PASSWORD: ${{REDIS_WORKER_PASSWORD:?set REDIS_WORKER_PASSWORD in {where}/.env}}
      CONVEYOR_NAMESPACE: ${{CONVEYOR_NAMESPACE:-conveyor}}
    volumes:
      - ./redis/redis.conf:/usr/local/etc/redis/redis.conf:ro
      - ./redis/users.acl:/usr/local/etc/redis/users.acl:ro
      - ./redis/render-acl.sh:/usr/local/etc/redis/render-acl.sh:ro
      - redis-data:/data
    tmpfs:
      - /run/redis
    # No `ports:` on purpose: only this project's containers reach Redis. To look inside:
    #   docker compose -f {where}/{name} exec redis \\
    #     sh -c 'REDISCLI_AUTH="$REDIS_GATEWAY_PASSWORD" redis-cli --user gateway'
    healthcheck:
      test: ["CMD-SHELL", "REDISCLI_AUTH=\\"$$REDIS_WORKER_PASSWORD\\" redis-cli --no-auth-warning --user worker ping | grep -q PONG"]
      interval: 5s
      timeout: 3s
      retries: 12
    stop_grace_period: 30s
""".splitlines()


def _gateway_service(where: str) -> list[str]:
    return f"""  gateway:
    <<: *image
    command: ["conveyor", "gateway"]
    restart: unless-stopped
    init: true
    read_only: true
    tmpfs:
      - /tmp
    depends_on:
      redis:
        condition: service_healthy
    environment:
      <<: *conveyor-env
      CONVEYOR_REDIS_URL: redis://gateway:${{REDIS_GATEWAY_PASSWORD:?set REDIS_GATEWAY_PASSWORD in {where}/.env}}@redis:6379/0
      CONVEYOR_HOST: 0.0.0.0
      CONVEYOR_PORT: "8000"
      # Gateway processes in this container, sharing its port (SO_REUSEPORT, each with its
      # own reply stream): one process tops out at ~4.9k small requests/s, so raise this on
      # a many-core host. `--scale gateway=N` would not do: N containers cannot all publish
      # the one host port.
      CONVEYOR_GATEWAYS: ${{CONVEYOR_GATEWAYS:-1}}
    # Loopback only: put a TLS-terminating proxy in front to serve other hosts.
    ports:
      - "127.0.0.1:${{CONVEYOR_PUBLISHED_PORT:-8000}}:8000"
    healthcheck:
      test: ["CMD", "python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
      interval: 10s
      timeout: 3s
      retries: 3
      start_period: 15s
    # uvicorn lets in-flight requests finish for up to 10 s after SIGTERM.
    stop_grace_period: 15s

""".splitlines()


def env_example(plan: Plan) -> str:
    """``.env.example``: the passwords compose requires, and the optional variables."""
    where = "deploy" if plan.shipped else "DIR"
    return f"""# Copy to {where}/.env (never commit that file) and give each user its own secret, e.g.
#   cp {where}/.env.example {where}/.env
#   sed -i "s/change-me-gateway/$(openssl rand -hex 24)/" {where}/.env
#   sed -i "s/change-me-worker/$(openssl rand -hex 24)/" {where}/.env
# Passwords go into redis:// URLs: use letters and digits only.
REDIS_GATEWAY_PASSWORD=change-me-gateway
REDIS_WORKER_PASSWORD=change-me-worker

# Optional (defaults shown).
# CONVEYOR_NAMESPACE={plan.namespace}
# CONVEYOR_MODEL_PROFILE=offline
# HF_HUB_OFFLINE=1
# CONVEYOR_PUBLISHED_PORT=8000
# CONVEYOR_GATEWAYS=1
# CONVEYOR_IMAGE={plan.cpu_image.name}
# CONVEYOR_CUDA_IMAGE={plan.cuda_image.name}
""" + _base_pins(plan)


def _base_pins(plan: Plan) -> str:
    """The build args that pin an app's image's bases, as ``.env`` lines to uncomment."""
    cuda = any(w.gpus > 0 for w in plan.workers)
    args = [*plan.cpu_image.build.args, *(plan.cuda_image.build.args if cuda else ())]
    if not args:
        return ""
    lines = [
        "",
        "# Your image's bases: pin each by digest (docker buildx imagetools inspect IMAGE).",
    ]
    for name, value in args:
        default = value.partition(":-")[2].removesuffix("}")
        lines.append(f"# {name}={default}@sha256:<digest>")
    return "\n".join(lines) + "\n"


def files(plan: Plan) -> dict[str, str]:
    """The files ``conveyor deploy compose`` writes, by path relative to its folder."""
    name = SHIPPED_COMPOSE_FILE if plan.shipped else COMPOSE_FILE
    out = {name: compose(plan), ".env.example": env_example(plan)}
    out |= {f"redis/{f}": redis_file(f) for f in REDIS_FILES}
    return out | image_files(plan)
