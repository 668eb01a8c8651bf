"""deploy/ checked offline: images, compose, the Redis config and ACL, k8s + KEDA, and the
compose services run natively.

The static checks tie every file to the code it deploys: each CONVEYOR_* variable must be a
field of the settings class of the process that reads it, the workers must serve exactly the
stages of the pipelines the gateway routes, each ScaledObject must watch the streams and
group that ``pipelines.keys`` names. The live checks start a real redis-server with the
shipped redis.conf and ACL rules, prove what each user may and may not do, then run the
compose gateway and embed worker as real processes (their own command and environment)
against it, answer real HTTP requests and stop them with SIGTERM; no command they send may
be denied.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import yaml
from pydantic_settings import BaseSettings
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.retry import Retry

from conveyor.embedded import find_redis_server, free_port
from gateway.settings import GatewaySettings
from pipelines.keys import GROUP, LANES, Keys
from pipelines.registry import load_registry
from pipelines.settings import CommonSettings
from tests.deploy.kedacrd import assert_match_keda_crd, crd_problems
from tests.helpers import REPO, conveyor, wait_ready
from workers.settings import WorkerSettings

ROOT = REPO
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
REDIS_DIR = DEPLOY / "redis"
K8S = DEPLOY / "k8s"

# What deploy/.env would hold; the test Redis gets these users' password hashes.
DUMMY_ENV = {"REDIS_GATEWAY_PASSWORD": "gateway-test-pw", "REDIS_WORKER_PASSWORD": "worker-test-pw"}
KEDA_PASSWORD = "keda-test-pw"
ADMIN = ("test-admin", "test-admin-pw")  # added to the rendered ACL file by the tests only

# Each process's settings class; CONVEYOR_* variables a service sets must be its fields.
SETTINGS: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings,
    "worker": WorkerSettings,
    "redis": CommonSettings,
}


def words(*lines: str) -> set[str]:
    """The space-separated words of ``lines``, as a set."""
    return {word for line in lines for word in line.split()}


# Commands the code sends (read from gateway/, workers/, pipelines/, the script in
# workers/publish.py included); the live test below proves the rules suffice by running the
# real processes, a join pipeline included.
NEEDS = {
    "gateway": words(
        "ping time multi exec xadd hset expire xread xtrim del hgetall xlen xrange xinfo|groups",
        "xinfo|consumers smembers set get hsetnx cluster|slots command",
    ),
    "worker": words(
        "ping time xgroup|create xreadgroup multi exec xadd expire hset hexists hgetall eval",
        "evalsha exists xack hincrby hincrbyfloat sadd set get del mget cluster|slots command",
    ),
    "keda": words("info xinfo|groups xpending xlen cluster|slots cluster|shards command"),
}
READ_ONLY_CLUSTER = words("cluster|slots cluster|shards")
"""What a cluster client reads first (the slot map): the only CLUSTER subcommands granted."""
# Nobody gets these (whole command or any subcommand but READ_ONLY_CLUSTER's).
FORBIDDEN = words(
    "config flushall flushdb keys scan debug shutdown module acl monitor replicaof slaveof",
    "save bgsave bgrewriteaof swapdb migrate restore cluster failover sync psync function",
    "script client|kill client|list client|pause object dump select move lastsave",
)

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))
DRAIN_S = 30.0
"""The least time a worker is given to finish its in-flight batches after SIGTERM."""


# --- helpers -------------------------------------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation (``$$``, ``${X}``, ``${X:-d}``, ``${X:?err}``)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg, have = m.group("op"), m.group("arg") or "", env.get(name)
        unset = have is None or (have == "" and op is not None and op.startswith(":"))
        if op in (":-", "-") and unset:
            return arg
        if op in (":?", "?") and unset:
            raise AssertionError(f"${{{name}}} is required: {arg}")
        return have or ""

    return _VAR.sub(one, value)


def load_compose(env: Mapping[str, str] = DUMMY_ENV) -> dict[str, Any]:
    """The compose services (anchors and merge keys resolved, variables interpolated)."""
    doc = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, Any] = interpolate(doc["services"], env)
    return services


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A compose service's environment as strings (both the mapping and list forms)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {k: "" if v is None else str(v) for k, v in raw.items()}


def role(service_name: str) -> str:
    """gateway, worker or redis: which settings class a service's process reads."""
    return "worker" if service_name.startswith("worker-") else service_name


def worker_stages(command: list[str]) -> list[str]:
    """The stages a worker command serves: ``conveyor worker S[,S...]`` or
    ``python -m workers S[,S...]``."""
    if command[:2] == ["conveyor", "worker"] and len(command) == 3:
        spec = command[2]
    elif command[:3] in (["python", "-m", "workers"], ["python3", "-m", "workers"]):
        spec = command[3]
    else:
        raise AssertionError(f"not a worker command: {command}")
    return [s.strip() for s in spec.split(",") if s.strip()]


def worker_name_fits(name: str, stages: list[str]) -> bool:
    """``worker-<stage>`` (dots as dashes) for one stage, ``worker-<pipeline>`` for the
    function stages of one pipeline; either may carry a variant suffix (``-gpu``)."""
    if len(stages) == 1:
        base = "worker-" + stages[0].replace(".", "-")
    else:
        pipelines = {s.partition(".")[0] for s in stages}
        if len(pipelines) != 1 or not all("." in s for s in stages):
            return False
        base = "worker-" + pipelines.pop()
    return name == base or name.startswith(base + "-")


def served_stages(env: Mapping[str, str]) -> set[str]:
    """The stages of the pipelines a process with ``env`` serves."""
    return set(load_registry(env.get("CONVEYOR_APP"), env.get("CONVEYOR_PIPELINES")).stages)


def native(command: list[str]) -> list[str]:
    """A compose command as this virtualenv runs it."""
    if command[0] == "conveyor":
        return [CONVEYOR, *command[1:]]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    raise AssertionError(f"cannot run {command[0]!r} natively")


def seconds(duration: str | int) -> float:
    """A compose duration (``30s``, ``1m30s``, ``1500ms``) in seconds."""
    if isinstance(duration, int):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def conveyor_fields(env: Mapping[str, str]) -> set[str]:
    """Settings field names that CONVEYOR_* variables in ``env`` set."""
    return {k.removeprefix("CONVEYOR_").lower() for k in env if k.startswith("CONVEYOR_")}


def redis_conf() -> dict[str, str]:
    """deploy/redis/redis.conf as directive -> value (the last one wins, as in Redis)."""
    out: dict[str, str] = {}
    for line in (REDIS_DIR / "redis.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            out[name.lower()] = value.strip()
    return out


def render_acl(out: Path) -> str:
    """Render the shipped ACL template with the shipped script and the dummy passwords."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        **DUMMY_ENV,
        "REDIS_KEDA_PASSWORD": KEDA_PASSWORD,
    }
    subprocess.run(
        ["sh", str(REDIS_DIR / "render-acl.sh"), str(REDIS_DIR / "users.acl"), str(out)],
        env=env,
        check=True,
        timeout=30,
    )
    return out.read_text()


@dataclass
class AclUser:
    """One user's rules, evaluated the way Redis applies them (explicit commands only)."""

    name: str
    enabled: bool = False
    hashes: list[str] = field(default_factory=list)
    plain_passwords: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    channels: list[str] = field(default_factory=list)
    commands: set[str] = field(default_factory=set)

    def can(self, command: str) -> bool:
        """Whether ``command`` (``name`` or ``name|sub``) is allowed."""
        return command in self.commands or command.split("|")[0] in self.commands


def covered(patterns: list[str], key: str) -> bool:
    """Whether an ACL key pattern (Redis's glob: ``*``, ``?``, ``[...]``) matches ``key``."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def parse_acl(text: str) -> dict[str, AclUser]:
    """A rendered ACL file, refusing rules this check cannot reason about (categories,
    ``allkeys``, ``nopass``, ...): least privilege is spelled out command by command."""
    users: dict[str, AclUser] = {}
    for line in text.splitlines():
        word, name, *rules = line.split()
        assert word == "user", line
        user = users.setdefault(name, AclUser(name))
        for rule in rules:
            if rule in ("on", "off"):
                user.enabled = rule == "on"
            elif rule == "resetpass":
                user.hashes, user.plain_passwords = [], []
            elif rule == "resetkeys":
                user.keys = []
            elif rule == "resetchannels":
                user.channels = []
            elif rule in ("-@all", "nocommands"):
                user.commands = set()
            elif rule.startswith("#"):
                user.hashes.append(rule[1:])
            elif rule.startswith(">"):
                user.plain_passwords.append(rule[1:])
            elif rule.startswith("~"):
                user.keys.append(rule[1:])
            elif rule.startswith("&"):
                user.channels.append(rule[1:])
            elif re.fullmatch(r"[+-][a-z]+(\|[a-z-]+)?", rule):
                (user.commands.add if rule[0] == "+" else user.commands.discard)(rule[1:])
            else:
                raise AssertionError(f"user {name}: rule {rule!r} is not an explicit grant")
    return users


@pytest.fixture(scope="module")
def rendered_acl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped ACL template rendered by the shipped script."""
    path = tmp_path_factory.mktemp("acl") / "users.acl"
    render_acl(path)
    return path


@dataclass
class AclRedis:
    """A redis-server running the shipped redis.conf and ACL rules."""

    port: int
    version: tuple[int, ...]

    def client(self, user: str | None, password: str | None) -> redis.Redis:
        """A client logged in as ``user`` (None: no AUTH at all)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=user,
            password=password,
            socket_timeout=5,
            retry=Retry(NoBackoff(), 0),  # a refused login is the answer, not a glitch
        )

    def admin(self) -> redis.Redis:
        """A client as the test-only admin user."""
        return self.client(*ADMIN)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory, rendered_acl: Path) -> Iterator[AclRedis]:
    """redis-server with deploy/redis/redis.conf and the rendered ACL (plus a test admin),
    in a temp working directory, on a free loopback port."""
    workdir = tmp_path_factory.mktemp("acl-redis")
    acl = workdir / "users.acl"
    acl.write_text(rendered_acl.read_text() + f"user {ADMIN[0]} on >{ADMIN[1]} ~* &* +@all\n")
    port = free_port()
    args = [find_redis_server(), str(REDIS_DIR / "redis.conf")]  # the shipped config, then:
    args += ["--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(acl), "--daemonize", "no"]
    with (workdir / "redis.log").open("wb") as log:
        proc = subprocess.Popen(args, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    server = AclRedis(port, ())
    admin = server.admin()
    try:
        give_up = time.monotonic() + 20
        while True:
            assert proc.poll() is None, (workdir / "redis.log").read_text()
            try:
                info = admin.info("server")
                break
            except redis.ConnectionError:
                assert time.monotonic() < give_up, "redis-server did not start in 20 s"
                time.sleep(0.05)  # another process is starting; nothing to await
        server.version = tuple(int(p) for p in str(info["redis_version"]).split("."))
        yield server
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=10)


# --- images --------------------------------------------------------------------------------


def test_every_package_of_the_source_tree_is_installed() -> None:
    # The images install with `pip install .` (not editable): a subpackage left out of
    # pyproject's list would be missing there only.
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tools["packages"])
    top = {p.split(".")[0] for p in listed}
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for name in top
        for init in (ROOT / name).rglob("__init__.py")
    }
    assert found <= listed, found - listed
    # The rest are folders of data only (the deploy generator's), shipped as package data.
    for data in listed - found:
        assert data in tools["package-data"], data
        assert any((ROOT / data.replace(".", "/")).iterdir()), data


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_images_install_every_package_with_pinned_torch_as_non_root(dockerfile: str) -> None:
    text = (DEPLOY / dockerfile).read_text()
    lines = text.replace("\\\n", " ").splitlines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    top_level = [p for p in project["tool"]["setuptools"]["packages"] if "." not in p]
    assert "bench" not in top_level, "bench is installed into users' site-packages"
    for package in top_level:
        assert f"COPY {package} ./{package}" in text, f"{dockerfile} leaves out {package}/"
        assert package not in ignored, f".dockerignore drops {package}/"
    assert project["project"]["readme"] not in ignored
    assert {".venv", ".git", "tests"} <= set(ignored)
    # torch named in the same pip command as the project, so pip cannot pick another build.
    commands = [part.strip() for line in lines for part in line.split("&&")]
    # The project with its `serve` extra: without it, an image would hold the client only.
    (install,) = [c for c in commands if "pip install" in c and c.endswith(' ".[serve]"')]
    assert "torch==" in install or "TORCH_SPEC" in install, install
    assert "download.pytorch.org/whl/" in text
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users, f"{dockerfile} runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert "ARG HF_HUB_OFFLINE" in text
    assert "HF_HUB_OFFLINE=${HF_HUB_OFFLINE}" in text
    cache = service_env(load_compose()["worker-embed"])["CONVEYOR_CACHE_DIR"]
    assert f'VOLUME ["{cache}"]' in text
    assert f"CONVEYOR_CACHE_DIR={cache}" in text
    if dockerfile == "Dockerfile":
        assert "ARG TORCH_SPEC=torch==2.13.0+cpu" in text
        assert "FROM ${PYTHON_IMAGE}" in text
        assert "ARG PYTHON_IMAGE=python:3.12-slim" in text  # the CUDA image's minor


# --- compose -------------------------------------------------------------------------------


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_file_validates_with_compose(tmp_path: Path, profile: str | None) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker-compose / docker compose to validate with (apt: docker-compose)")
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in DUMMY_ENV.items()))
    args = [*cli, "--env-file", str(env_file), "-f", str(COMPOSE)]
    args += ["--profile", profile] if profile else []
    clean_env = {k: v for k, v in os.environ.items() if k not in DUMMY_ENV}
    result = subprocess.run(
        [*args, "config", "-q"], capture_output=True, text=True, timeout=60, env=clean_env
    )
    assert result.returncode == 0, result.stderr


def test_compose_requires_the_redis_passwords() -> None:
    with pytest.raises(AssertionError, match="REDIS_WORKER_PASSWORD"):
        load_compose({"REDIS_GATEWAY_PASSWORD": "x"})


def test_compose_conveyor_variables_are_settings_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    services = load_compose()
    namespaces = set()
    for name, service in services.items():
        env = service_env(service)
        cls = SETTINGS[role(name)]
        unknown = conveyor_fields(env) - set(cls.model_fields)
        assert not unknown, f"{name}: {sorted(unknown)} are not fields of {cls.__name__}"
        # The values must parse too: build the settings from exactly this environment.
        for var in [k for k in os.environ if k.startswith("CONVEYOR_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            if var.startswith("CONVEYOR_"):
                monkeypatch.setenv(var, value)
        settings: Any = cls()
        namespaces.add(settings.namespace)
    assert namespaces == {"conveyor"}, "every service must use the same namespace"


def test_compose_workers_serve_exactly_the_pipelines_stages() -> None:
    services = load_compose()
    gateway_env = service_env(services["gateway"])
    wanted = served_stages(gateway_env)
    shared = ("CONVEYOR_NAMESPACE", "CONVEYOR_PIPELINES", "CONVEYOR_APP")
    served: set[str] = set()
    for name, service in services.items():
        if role(name) != "worker":
            continue
        stages = worker_stages(service["command"])
        env = service_env(service)
        assert all(env.get(k) == gateway_env.get(k) for k in shared), f"{name} disagrees"
        unknown = set(stages) - served_stages(env)
        assert not unknown, f"{name} serves {sorted(unknown)}, not stages of its pipelines"
        assert worker_name_fits(name, stages), f"{name} does not name what it serves"
        # Scalable with --scale: no fixed container name, no host port.
        assert "container_name" not in service, name
        assert "ports" not in service, name
        assert seconds(service["stop_grace_period"]) >= DRAIN_S, f"{name}: too short a drain"
        assert service.get("stop_signal", "SIGTERM") == "SIGTERM", name
        assert urlsplit(env["CONVEYOR_REDIS_URL"]).username == "worker", name
        assert f"models:{env['CONVEYOR_CACHE_DIR']}" in service["volumes"], name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        if not service.get("profiles"):
            assert not served & set(stages), f"{name}: a stage served by two services"
            served |= set(stages)
    assert served == wanted, f"stages without a worker: {sorted(wanted - served)}"

    gpu = services["worker-generate-gpu"]
    assert gpu["profiles"] == ["gpu"], "the GPU worker must not start by default"
    assert service_env(gpu)["CONVEYOR_DEVICE"] == "cuda"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]


def test_compose_gateway_is_loopback_only_and_checks_readyz() -> None:
    gateway = load_compose()["gateway"]
    assert gateway["ports"] == ["127.0.0.1:8000:8000"]
    assert "/readyz" in " ".join(gateway["healthcheck"]["test"])
    env = service_env(gateway)
    assert env["CONVEYOR_HOST"] == "0.0.0.0"  # inside its container; published on loopback
    assert urlsplit(env["CONVEYOR_REDIS_URL"]).username == "gateway"


def test_compose_redis_is_durable_private_and_authenticated() -> None:
    services = load_compose()
    red = services["redis"]
    assert "ports" not in red, "Redis must not be published on the host"
    assert int(red["image"].split(":")[1].split(".")[0]) >= 7, "XINFO lag needs Redis 7"
    mounted = {v.split(":")[1] for v in red["volumes"] if v.startswith("./redis/")}
    command = " ".join(red["command"])
    assert {f"/usr/local/etc/redis/{f}" for f in ("redis.conf", "users.acl", "render-acl.sh")} == (
        mounted
    )
    assert "render-acl.sh" in command
    assert "redis-server /usr/local/etc/redis/redis.conf" in command
    assert any(v.endswith(":/data") for v in red["volumes"]), "the AOF needs a volume"
    conf = redis_conf()
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "always"
    assert conf["maxmemory-policy"] == "noeviction"
    assert conf["aclfile"].startswith("/run/redis/")
    assert "/run/redis" in red["tmpfs"]
    assert "requirepass" not in conf, "users come from the ACL file"
    assert "REDISCLI_AUTH" in " ".join(red["healthcheck"]["test"])


# --- the ACL rules -------------------------------------------------------------------------


def test_acl_rules_grant_what_each_process_needs_and_nothing_else(rendered_acl: Path) -> None:
    text = rendered_acl.read_text()
    users = parse_acl(text)
    assert set(users) == {"default", "gateway", "worker", "keda"}
    default = users["default"]
    assert not default.enabled
    assert not default.commands
    assert not default.keys
    prefix = Keys("conveyor").prefix
    for name in ("gateway", "worker", "keda"):
        user = users[name]
        assert user.enabled, name
        assert len(user.hashes) == 1, name
        assert not user.plain_passwords, name
        missing = {c for c in NEEDS[name] if not user.can(c)}
        assert not missing, f"{name} cannot run {sorted(missing)}"
        granted = {c for c in FORBIDDEN if user.can(c)}
        granted |= {
            c for c in user.commands if c.split("|")[0] in FORBIDDEN and c not in READ_ONLY_CLUSTER
        }
        assert not granted, f"{name} may run {sorted(granted)}"
        assert not user.channels, f"{name} needs no pub/sub"
    del prefix
    for partitions in (1, 3, 16):  # every partition's keys, and no other namespace's
        for part in Keys("conveyor", partitions).each():
            for key in (part.stage_stream("embed"), part.job("j"), part.reply_stream("g")):
                assert covered(users["gateway"].keys, key), key
                assert covered(users["worker"].keys, key), key
            assert covered(users["keda"].keys, part.stage_stream("embed", "bulk"))
            assert not covered(users["keda"].keys, part.job("j")), "KEDA reads only streams"
    for other in (Keys("conveyor.prod"), Keys("conveyor2"), Keys("other", 3).at(1)):
        assert not covered(users["worker"].keys, other.stage_stream("embed")), other.prefix
    assert not users["gateway"].can("xreadgroup"), "the gateway reads no stage stream"
    assert not users["gateway"].can("xack")
    assert not users["keda"].can("xadd"), "KEDA only reads"
    for password in [*DUMMY_ENV.values(), KEDA_PASSWORD]:
        assert password not in text, "only password hashes may be written"


def test_acl_render_honours_the_namespace(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **DUMMY_ENV}
    script, template = str(REDIS_DIR / "render-acl.sh"), str(REDIS_DIR / "users.acl")
    out = tmp_path / "users.acl"
    subprocess.run(
        ["sh", script, template, str(out)],
        env=env | {"CONVEYOR_NAMESPACE": "shard-2"},
        check=True,
        timeout=30,
    )
    patterns = parse_acl(out.read_text())["worker"].keys
    assert all(covered(patterns, k.job("j")) for k in Keys("shard-2", 4).each())
    assert not covered(patterns, Keys("conveyor").job("j"))
    bad = subprocess.run(
        ["sh", script, template, str(out)],
        env=env | {"CONVEYOR_NAMESPACE": "a*b"},
        capture_output=True,
        timeout=30,
    )
    assert bad.returncode != 0, "a glob in the namespace would widen the key patterns"
    missing = subprocess.run(
        ["sh", script, template, str(out)],
        env={"PATH": env["PATH"], "REDIS_WORKER_PASSWORD": "x"},
        capture_output=True,
        timeout=30,
    )
    assert missing.returncode != 0
    assert b"REDIS_GATEWAY_PASSWORD" in missing.stderr


def test_live_acl_worker_may_queue_but_not_administer(acl_redis: AclRedis) -> None:
    stream = Keys("conveyor").stage_stream("x")
    worker = acl_redis.client("worker", DUMMY_ENV["REDIS_WORKER_PASSWORD"])
    try:
        worker.xgroup_create(stream, GROUP, id="0", mkstream=True)
        entry = worker.xadd(stream, {"e": "{}"})
        got: Any = worker.xreadgroup(GROUP, "c1", {stream: ">"}, count=10)
        assert [eid for eid, _ in got[0][1]] == [entry]
        assert worker.xack(stream, GROUP, entry) == 1
        with pytest.raises(NoPermissionError):
            worker.config_get("*")
        with pytest.raises(NoPermissionError):
            worker.flushall()
        with pytest.raises(NoPermissionError):
            worker.keys("*")
        with pytest.raises(NoPermissionError):
            worker.xadd("elsewhere", {"e": "{}"})  # outside the namespace
    finally:
        worker.close()


@pytest.mark.parametrize("user", ["gateway", "worker"])
def test_live_acl_conveyor_status_runs_as_gateway_or_worker(acl_redis: AclRedis, user: str) -> None:
    # The operator's `conveyor status` (docs/deploy.md runs it in the gateway container)
    # reads the queue state only, which either process's user may read.
    password = DUMMY_ENV[f"REDIS_{user.upper()}_PASSWORD"]
    url = f"redis://{user}:{password}@127.0.0.1:{acl_redis.port}/0"
    done = conveyor("status", CONVEYOR_REDIS_URL=url, CONVEYOR_PIPELINES="chain")
    assert done.returncode == 0, done.stderr[-500:]
    assert "adder" in done.stdout, done.stdout
    assert "multiplier" in done.stdout, done.stdout


def test_live_acl_gateway_and_keda_are_limited(acl_redis: AclRedis) -> None:
    stream = Keys("conveyor").stage_stream("y")
    gateway = acl_redis.client("gateway", DUMMY_ENV["REDIS_GATEWAY_PASSWORD"])
    keda = acl_redis.client("keda", KEDA_PASSWORD)
    try:
        gateway.xadd(stream, {"e": "{}"})
        with pytest.raises(NoPermissionError):
            gateway.xreadgroup(GROUP, "c", {stream: ">"})
        with pytest.raises(NoPermissionError):
            gateway.flushdb()
        assert keda.xlen(stream) == 1
        assert "redis_version" in keda.info("server")
        with pytest.raises(NoPermissionError):
            keda.xadd(stream, {"e": "{}"})
    finally:
        gateway.close()
        keda.close()


def test_live_acl_default_user_and_wrong_passwords_are_refused(acl_redis: AclRedis) -> None:
    anonymous = acl_redis.client(None, None)
    wrong = acl_redis.client("worker", "not-the-password")
    default = acl_redis.client("default", "any-password")
    try:
        with pytest.raises(AuthenticationError):
            anonymous.ping()
        with pytest.raises(AuthenticationError):
            wrong.ping()
        with pytest.raises(AuthenticationError):
            default.ping()
    finally:
        for client in (anonymous, wrong, default):
            client.close()


def test_live_acl_dry_run_of_admin_commands(acl_redis: AclRedis) -> None:
    if acl_redis.version < (7,):
        pytest.skip("ACL DRYRUN needs Redis 7")
    attempts = [
        ["CONFIG", "GET", "*"],
        ["CONFIG", "SET", "appendonly", "no"],
        ["FLUSHALL"],
        ["FLUSHDB"],
        ["KEYS", "*"],
        ["SCAN", "0"],
        ["DEBUG", "SLEEP", "0"],
        ["SHUTDOWN"],
        ["MODULE", "LIST"],
        ["ACL", "LIST"],
        ["MONITOR"],
        ["REPLICAOF", "NO", "ONE"],
        ["SAVE"],
        ["BGREWRITEAOF"],
        ["SWAPDB", "0", "1"],
        ["SCRIPT", "FLUSH"],
        ["FUNCTION", "LIST"],
        ["CLIENT", "LIST"],
        ["CLIENT", "KILL", "ID", "1"],
    ]
    admin = acl_redis.admin()
    try:
        stream = Keys("conveyor").stage_stream("z")
        assert admin.acl_dryrun("worker", "XADD", stream, "*", "e", "{}") in (b"OK", "OK")
        for user in ("gateway", "worker", "keda"):
            for cmd in attempts:
                answer = admin.acl_dryrun(user, *cmd)
                assert answer not in (b"OK", "OK"), f"{user} may run {' '.join(cmd)}"
    finally:
        admin.close()


# --- Kubernetes ----------------------------------------------------------------------------


@functools.cache
def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    """Every manifest under deploy/k8s (not the kustomization), with its file (read once)."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str, path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Manifests of ``kind`` by name (optionally only those in ``path``)."""
    return {
        d["metadata"]["name"]: d
        for p, d in k8s_documents()
        if d["kind"] == kind and (path is None or p == path)
    }


def kustomized_files() -> list[Path]:
    """The files kustomization.yaml applies."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [K8S / r for r in kustomization["resources"]]


def container_env(deployment: Mapping[str, Any]) -> dict[str, str]:
    """The variables a Deployment's first container gets, ConfigMaps resolved; values of
    secrets read as ``<secret:name/key>``."""
    maps = by_kind("ConfigMap")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= maps[source["configMapRef"]["name"]]["data"]
    for var in container.get("env", []):
        ref = var.get("valueFrom", {})
        if "secretKeyRef" in ref:
            env[var["name"]] = (
                f"<secret:{ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}>"
            )
        elif "configMapKeyRef" in ref:
            env[var["name"]] = maps[ref["configMapKeyRef"]["name"]]["data"][
                ref["configMapKeyRef"]["key"]
            ]
        else:
            env[var["name"]] = var["value"]
    return env


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a matchLabels selector selects pods labelled ``labels``."""
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_k8s_manifests_match_the_kubernetes_schemas() -> None:
    kv = pytest.importorskip(
        "kubernetes_validate.utils", reason="pip install kubernetes-validate (dev dependency)"
    )
    versions = ["1.28.0", kv.latest_version()]
    checked = 0
    for path, doc in k8s_documents():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's CRDs: test_keda_objects_match_kedas_crd_schema
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {where}: {exc}")
        checked += 1
    assert checked >= 15


def keda_documents() -> list[tuple[str, dict[str, Any]]]:
    """The KEDA objects under deploy/k8s, each with its file's name."""
    return [(p.name, d) for p, d in k8s_documents() if d["apiVersion"].startswith("keda.sh/")]


def test_keda_objects_match_kedas_crd_schema() -> None:
    docs = keda_documents()
    kinds = [d["kind"] for _, d in docs]
    assert kinds.count("TriggerAuthentication") == 1
    assert kinds.count("ScaledObject") == len(by_kind("Deployment")) - 1  # not the gateway
    assert_match_keda_crd(docs)


_DROP = object()


def _edit(path: str, value: Any = _DROP) -> Callable[[dict[str, Any]], None]:
    """A change to a manifest: set the field at dotted ``path`` (list items by index) to
    ``value``, or drop it when no value is given."""

    def change(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DROP:
            del node[last]
        else:
            node[last] = value

    return change


@pytest.mark.parametrize(
    ("kind", "change", "rejected"),
    [
        ("ScaledObject", _edit("spec.triggers.0.type"), "0: must have required property type"),
        (
            "ScaledObject",
            _edit("spec.triggers.0.metadata"),
            "0: must have required property metadata",
        ),
        (
            "ScaledObject",
            _edit("spec.triggers.0.metadata.lagCount", 64),
            "lagCount: must be string",
        ),
        (
            "ScaledObject",
            _edit("spec.scaleTargetRef.name"),
            "Ref: must have required property name",
        ),
        ("ScaledObject", _edit("spec.fallback.replicas", "1"), "replicas: must be integer"),
        ("ScaledObject", _edit("kind", "ScaledObjects"), "no KEDA CRD defines"),
        ("TriggerAuthentication", _edit("spec.secretTargetRef.0.key"), "required property key"),
    ],
    ids=["no-type", "no-metadata", "int-metadata", "no-target", "str-replicas", "kind", "no-key"],
)
def test_keda_crd_schema_rejects_a_broken_object(
    kind: str, change: Callable[[dict[str, Any]], None], rejected: str
) -> None:
    """The CRD check is not a formality: each break of a shipped object is named."""
    shipped = next(d for _, d in keda_documents() if d["kind"] == kind)
    broken = json.loads(json.dumps(shipped))
    change(broken)
    fine, problems = crd_problems([shipped, broken])
    assert fine == []
    assert any(rejected in p for p in problems), problems


def test_keda_objects_are_well_formed() -> None:
    redis_streams_keys = words(
        "address host port addressFromEnv hostFromEnv portFromEnv stream consumerGroup",
        "pendingEntriesCount streamLength lagCount activationLagCount enableTLS unsafeSsl",
        "databaseIndex",
    )
    spec_keys = words(
        "scaleTargetRef pollingInterval cooldownPeriod initialCooldownPeriod idleReplicaCount",
        "minReplicaCount maxReplicaCount fallback advanced triggers",
    )
    auths = by_kind("TriggerAuthentication")
    secret = by_kind("Secret")["conveyor-redis"]["stringData"]
    for auth in auths.values():
        assert auth["apiVersion"] == "keda.sh/v1alpha1"
        refs = auth["spec"]["secretTargetRef"]
        assert {r["parameter"] for r in refs} == {"username", "password"}
        assert all(r["name"] == "conveyor-redis" and r["key"] in secret for r in refs)
    assert secret["keda-username"] == "keda"
    scaled = by_kind("ScaledObject")
    assert scaled
    for name, obj in scaled.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1", name
        spec = obj["spec"]
        assert set(spec) <= spec_keys, f"{name}: unknown {set(spec) - spec_keys}"
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], name
        assert all(isinstance(spec[k], int) for k in ("pollingInterval", "cooldownPeriod"))
        assert spec["fallback"]["replicas"] >= 1
        for trigger in spec["triggers"]:
            assert trigger["type"] == "redis-streams", name
            meta = trigger["metadata"]
            assert set(meta) <= redis_streams_keys, (
                f"{name}: unknown {set(meta) - redis_streams_keys}"
            )
            assert all(isinstance(v, str) for v in meta.values()), f"{name}: values are strings"
            assert trigger["authenticationRef"]["name"] in auths, name
            counts = [meta[k] for k in ("lagCount", "pendingEntriesCount") if k in meta]
            assert len(counts) == 1, f"{name}: one target per trigger"
            assert int(counts[0]) >= 1, name
        kinds = {k for t in spec["triggers"] for k in t["metadata"] if k.endswith("Count")}
        assert {"lagCount", "activationLagCount", "pendingEntriesCount"} <= kinds, name


def lane_streams(keys: Keys, stage: str) -> list[str]:
    """``stage``'s stream of each priority lane."""
    return [keys.stage_stream(stage, lane) for lane in LANES]


def test_k8s_workers_match_compose_streams_and_drain() -> None:
    common = by_kind("ConfigMap")["conveyor-common"]["data"]
    keys = Keys(common["CONVEYOR_NAMESPACE"])
    compose = load_compose()
    compose_env = service_env(compose["gateway"])
    for var in ("CONVEYOR_NAMESPACE", "CONVEYOR_PIPELINES"):
        assert common[var] == compose_env[var], f"k8s and compose disagree on {var}"
    applied = kustomized_files()
    served: set[str] = set()
    deployed = set()
    for path in sorted((K8S / "stages").glob("*.yaml")) + sorted((K8S / "optional").glob("*.yaml")):
        deployments = by_kind("Deployment", path)
        assert len(deployments) == 1, path
        ((name, deployment),) = deployments.items()
        pod = deployment["spec"]["template"]
        stages = worker_stages(pod["spec"]["containers"][0]["command"])
        unknown = set(stages) - served_stages(container_env(deployment))
        assert not unknown, f"{name} serves {sorted(unknown)}, not stages of its pipelines"
        assert worker_name_fits(name, stages), f"{name} does not name what it serves"
        assert "replicas" not in deployment["spec"], f"{name}: the HPA owns replicas"
        # The drain: at least what compose gives the same service.
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        counterpart = compose.get(name, compose.get(name.removesuffix("-gpu"), {}))
        assert grace >= seconds(counterpart.get("stop_grace_period", f"{DRAIN_S:g}s")), name
        # KEDA watches every stream this Deployment reads, each lane's: its lag and its
        # pending entries, with the same target on every lane.
        (scaled,) = by_kind("ScaledObject", path).values()
        assert scaled["spec"]["scaleTargetRef"]["name"] == name
        watched: dict[str, set[str]] = {}
        targets: dict[tuple[str, str], set[str]] = {}
        for trigger in scaled["spec"]["triggers"]:
            meta = trigger["metadata"]
            assert meta["consumerGroup"] == GROUP, name
            kind, count = (
                ("lag", "lagCount") if "lagCount" in meta else ("pending", "pendingEntriesCount")
            )
            watched.setdefault(meta["stream"], set()).add(kind)
            stage = next(s for s in stages if meta["stream"] in lane_streams(keys, s))
            targets.setdefault((stage, kind), set()).add(meta[count])
        expected = {
            stream: {"lag", "pending"} for stage in stages for stream in lane_streams(keys, stage)
        }
        assert watched == expected, f"{name}: triggers {watched}, want {expected}"
        assert all(len(t) == 1 for t in targets.values()), f"{name}: lanes differ {targets}"
        (budget,) = by_kind("PodDisruptionBudget", path).values()
        assert selects(budget["spec"]["selector"], pod["metadata"]["labels"]), name
        assert selects(deployment["spec"]["selector"], pod["metadata"]["labels"]), name
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["requests"]["cpu"], name
        assert resources["requests"]["memory"], name
        if path in applied:
            assert not served & set(stages), f"{name}: a stage served twice"
            served |= set(stages)
            deployed.add(name)
    assert served == served_stages(common), "every stage of the pipelines needs workers"
    compose_workers = {
        n for n, s in compose.items() if role(n) == "worker" and not s.get("profiles")
    }
    assert deployed == compose_workers, "compose and k8s must deploy the same workers"

    (gpu,) = by_kind("Deployment", K8S / "optional" / "generate-gpu.yaml").values()
    limits = gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    assert container_env(gpu)["CONVEYOR_DEVICE"] == "cuda"


def test_k8s_conveyor_variables_are_settings_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = by_kind("Secret")["conveyor-redis"]["stringData"]
    for name, deployment in by_kind("Deployment").items():
        env = container_env(deployment)
        cls = SETTINGS[role(name)]
        unknown = conveyor_fields(env) - set(cls.model_fields)
        assert not unknown, f"{name}: {sorted(unknown)} are not fields of {cls.__name__}"
        for var in [k for k in os.environ if k.startswith("CONVEYOR_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            if value.startswith("<secret:"):
                key = value.removeprefix("<secret:conveyor-redis/").removesuffix(">")
                value = secret[key]
            if var.startswith("CONVEYOR_"):
                monkeypatch.setenv(var, value)
        settings: Any = cls()
        user = urlsplit(settings.redis_url).username
        assert user == role(name), f"{name} logs in to Redis as {user}"
    # Every key of the Secret that anything refers to exists in the example.
    for path, doc in k8s_documents():
        for ref in _secret_refs(doc):
            assert ref in secret, f"{path.name}: no key {ref} in the Secret"


def _secret_refs(node: Any) -> Iterator[str]:
    """Keys of the conveyor-redis Secret referred to anywhere under ``node``."""
    if isinstance(node, dict):
        if node.get("name") == "conveyor-redis" and "key" in node:
            yield node["key"]
        for value in node.values():
            yield from _secret_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _secret_refs(value)


def test_k8s_gateway_probes_and_service() -> None:
    gateway = by_kind("Deployment")["gateway"]
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["command"] == ["conveyor", "gateway"]
    assert container["resources"]["requests"]["cpu"]
    (budget,) = by_kind("PodDisruptionBudget", K8S / "gateway.yaml").values()
    assert selects(budget["spec"]["selector"], gateway["spec"]["template"]["metadata"]["labels"])
    for service in by_kind("Service").values():
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", "nothing is exposed"


def test_k8s_redis_matches_the_shipped_config() -> None:
    data = by_kind("ConfigMap")["redis-config"]["data"]
    for name in ("redis.conf", "users.acl", "render-acl.sh"):
        assert data[name] == (REDIS_DIR / name).read_text(), f"redis.yaml's {name} drifted"
    statefulset = by_kind("StatefulSet")["redis"]
    assert statefulset["spec"]["volumeClaimTemplates"], "the AOF needs a PersistentVolume"
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert int(container["image"].split(":")[1].split(".")[0]) >= 7
    env = {e["name"] for e in container["env"]}
    assert {*DUMMY_ENV, "REDIS_KEDA_PASSWORD"} <= env
    assert by_kind("Service")["redis"]["spec"]["clusterIP"] == "None"
    policy = by_kind("NetworkPolicy")["redis"]
    assert selects(
        policy["spec"]["podSelector"], statefulset["spec"]["template"]["metadata"]["labels"]
    )


def test_kustomization_applies_every_manifest() -> None:
    applied = kustomized_files()
    assert all(p.exists() for p in applied)
    examples = {K8S / "secret.example.yaml", *(K8S / "optional").glob("*.yaml")}
    manifests = {p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests - examples == set(applied)
    kubectl = shutil.which("kubectl")
    if kubectl:  # its built-in kustomize, offline
        out = subprocess.run(
            [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert "image: conveyor:cpu" in out.stdout


# --- the compose services, run natively ----------------------------------------------------


def _denials(admin: redis.Redis) -> list[str]:
    """What the ACL refused since the log was reset, but CLIENT SETINFO: the client
    library's optional name tag, refused by design on Redis >= 7.2 and ignored by redis-py."""
    return [
        f"{e['username']}: {e['reason']} {e['object']}"
        for e in admin.acl_log()
        if e["object"] != "client|setinfo"
    ]


@pytest.mark.parametrize("partitions", [1, 3])
def test_compose_gateway_and_worker_run_natively_under_the_acl(
    tmp_path: Path, cache_dir: Path, acl_redis: AclRedis, partitions: int
) -> None:
    # With three partitions, every key is under a partition's tag: the rules cover those.
    services = load_compose()
    admin = acl_redis.admin()
    try:
        admin.acl_log_reset()
        _run_compose_services(services, acl_redis.port, admin, tmp_path, cache_dir, partitions)
        denied = _denials(admin)
    finally:
        admin.close()
    assert not denied, f"ACL denials: {denied}"


def _run_compose_services(
    services: Mapping[str, Any],
    redis_port: int,
    admin: redis.Redis,
    logs: Path,
    cache_dir: Path,
    partitions: int = 1,
) -> None:
    """Start the compose gateway and embed worker (and a broadcast worker) as processes,
    serve real requests through them, then SIGTERM them and check they exit cleanly."""
    port = free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    # The compose services as they are, plus (test only) a worker for `broadcast`: its
    # fan-out and join run the join script under the worker's rules, as wiki-summary's do.
    runs = {
        "worker-embed": services["worker-embed"],
        "worker-broadcast": services["worker-embed"]
        | {"command": ["conveyor", "worker", "adder,multiplier,broadcast.start,broadcast.collect"]},
        "gateway": services["gateway"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    envs: dict[str, dict[str, str]] = {}
    admin.delete(Keys("conveyor").partition_count())  # each run is a deployment of its own
    try:
        for name, service in runs.items():
            env = base_env | service_env(service)
            # Same user and password as in compose; only where Redis and the gateway live
            # and where models are cached differ.
            url = urlsplit(env["CONVEYOR_REDIS_URL"])
            netloc = f"{url.username}:{url.password}@127.0.0.1:{redis_port}"
            env["CONVEYOR_REDIS_URL"] = urlunsplit(url._replace(netloc=netloc))
            if name == "gateway":
                env |= {"CONVEYOR_HOST": "127.0.0.1", "CONVEYOR_PORT": str(port)}
            else:
                env["CONVEYOR_CACHE_DIR"] = str(cache_dir)
            if name != "worker-embed":
                env["CONVEYOR_PIPELINES"] += ",broadcast"
            env["HF_HUB_OFFLINE"] = "1"
            env["CONVEYOR_PARTITIONS"] = str(partitions)
            envs[name] = env
            with (logs / name).open("wb") as log:
                procs[name] = subprocess.Popen(
                    native(service["command"]), env=env, stdout=log, stderr=log
                )
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, procs, lambda name: (logs / name).read_text())
        deadline = {"X-Conveyor-Timeout": "20"}
        resp = httpx.post(
            f"{base}/v1/embed", json={"text": "a cat sat"}, headers=deadline, timeout=30
        )
        assert resp.status_code == 200, f"{resp.text}; ACL denials: {_denials(admin)}"
        embedding = resp.json()["embedding"]
        assert len(embedding) == 384
        assert all(isinstance(x, float) for x in embedding)
        resp = httpx.post(f"{base}/v1/broadcast", json={"value": 5}, headers=deadline, timeout=30)
        assert resp.status_code == 200, f"{resp.text}; ACL denials: {_denials(admin)}"
        assert resp.json() == {"results": [{"value": 6}, {"value": 10}]}
        # An async job: its record is written with the request, and read back.
        resp = httpx.post(f"{base}/v1/jobs/broadcast", json={"value": 2}, timeout=30)
        assert resp.status_code == 202, f"{resp.text}; ACL denials: {_denials(admin)}"
        job = f"{base}/v1/jobs/{resp.json()['id']}"
        give_up = time.monotonic() + 30
        while (view := httpx.get(job, timeout=10).json())["status"] == "queued":
            assert time.monotonic() < give_up, view
            time.sleep(0.05)  # another process runs it; nothing here to await
        assert view["result"] == {"results": [{"value": 3}, {"value": 4}]}, view
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'conveyor_stage_items_total{stage="embed",outcome="ok"} 1' in metrics
        # The operator's view works with the gateway's credentials.
        status = subprocess.run(
            [CONVEYOR, "status"], env=envs["gateway"], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        row = next(line for line in status.stdout.splitlines() if line.startswith("embed "))
        assert row.split()[2:5] == ["0", "0", "1/1"]  # lag, pending, live/all consumers
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
    for name, code in codes.items():
        output = (logs / name).read_text()
        if name == "gateway":
            # uvicorn shuts down cleanly, then re-raises the signal it caught (exit 143 in a
            # container), as a process stopped by SIGTERM should.
            assert code in (0, -signal.SIGTERM), f"gateway exited {code}:\n{output}"
            assert "Application shutdown complete" in output, output
        else:
            assert code == 0, f"{name} exited {code} on SIGTERM:\n{output}"


# --- resources per stage: the deploy files ask what the stages say -------------------------


def quantity_mib(value: str | int) -> float:
    """A Kubernetes or compose memory quantity (``1Gi``, ``512Mi``, ``2g``, ``1024m``) in MiB."""
    text = str(value)
    units = {"Gi": 1024, "Mi": 1, "g": 1024, "m": 1, "G": 1000**3 / 2**20, "M": 1000**2 / 2**20}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text.removesuffix(suffix)) * scale
    return float(text) / 2**20


def cores(value: str | int | float) -> float:
    """A CPU quantity (``"2"``, ``250m``, ``1.5``) in cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def stage_asks(stages: list[str], env: Mapping[str, str]) -> tuple[int, int | None, int | None]:
    """What a worker serving ``stages`` with ``env`` asks: whole GPUs (its GPU share rounded
    up), torch threads (a stage's own, else ``CONVEYOR_THREADS``) and memory (MiB)."""
    settings = WorkerSettings(resources=json.loads(env.get("CONVEYOR_RESOURCES", "{}")))
    registry = load_registry(env.get("CONVEYOR_APP"), env.get("CONVEYOR_PIPELINES"))
    found = [registry.stage(s).with_resources(settings.resources.get(s)) for s in stages]
    threads = max((s.threads for s in found if s.threads), default=None)
    if threads is None and env.get("CONVEYOR_THREADS"):
        threads = int(env["CONVEYOR_THREADS"])
    memory = max((s.memory_mb for s in found if s.memory_mb), default=None)
    return math.ceil(max(s.gpus for s in found)), threads, memory


def test_deploy_files_request_the_gpus_cpus_and_memory_their_stages_ask() -> None:
    checked = 0
    for name, service in load_compose().items():
        if role(name) != "worker":
            continue
        env = service_env(service)
        gpus, threads, memory = stage_asks(worker_stages(service["command"]), env)
        resources = service["deploy"]["resources"]
        devices = resources["reservations"].get("devices", [])
        assert sum(int(d["count"]) for d in devices) == gpus, f"{name}: GPUs"
        assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        if gpus:
            assert env.get("CONVEYOR_DEVICE", "auto") != "cpu", f"{name}: a GPU for a cpu device"
        assert cores(resources["limits"]["cpus"]) == threads, f"{name}: cores != threads"
        if memory is not None:
            assert quantity_mib(resources["reservations"]["memory"]) == memory, name
        assert quantity_mib(resources["limits"]["memory"]) >= quantity_mib(
            resources["reservations"]["memory"]
        ), name
        checked += 1
    for name, deployment in by_kind("Deployment").items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        if role(name) != "worker":
            continue
        env = container_env(deployment)
        gpus, threads, memory = stage_asks(worker_stages(container["command"]), env)
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert int(limits.get("nvidia.com/gpu", 0)) == gpus, f"{name}: GPUs"
        assert cores(limits["cpu"]) == threads, f"{name}: cpu limit != torch threads"
        if memory is not None:
            assert quantity_mib(requests["memory"]) == memory, f"{name}: memory request"
        assert quantity_mib(limits["memory"]) >= quantity_mib(requests["memory"]), name
        checked += 1
    assert checked >= 12  # every compose worker and every Deployment of a worker
