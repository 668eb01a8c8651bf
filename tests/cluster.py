"""A real Redis Cluster on loopback for the tests: N ``redis-server --cluster-enabled yes``
nodes (masters only) joined with ``redis-cli --cluster create``.

Each node runs with an append-only file in its own directory, so a test can kill one
(SIGKILL) and restart it from its AOF, as the single-server fault tests do.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.embedded import find_redis_server, free_port, start_redis


@dataclass
class Cluster:
    """The nodes of a running cluster.

    Attributes:
        ports: each node's port on 127.0.0.1, in start order.
        workdir: where each node keeps its files (``node-<port>/``).
        procs: each node's process, by port.
    """

    ports: list[int]
    workdir: Path
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """A cluster URL naming one node (the client discovers the others)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, port: int) -> None:
        """Start (or restart, from its AOF and nodes.conf) the node on ``port``."""
        self.procs[port] = start_redis(
            port, self.workdir / f"node-{port}", appendonly=True, cluster=True
        )

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (its files stay for a restart)."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop every node."""
        for port in list(self.procs):
            proc = self.procs.pop(port)
            proc.terminate()
            proc.wait(timeout=10)

    def ok(self) -> bool:
        """Whether every node says the cluster is ``ok`` (all slots served)."""
        for port in self.ports:
            info = subprocess.run(
                ["redis-cli", "-p", str(port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            if "cluster_state:ok" not in info:
                return False
        return True


BUS_OFFSET = 10_000
"""A cluster node also listens on its port + this (the cluster bus), so its port is at
most 65535 - this."""


def node_port() -> int:
    """A free loopback port whose cluster-bus port is free too."""
    while True:
        port = free_port()
        if port + BUS_OFFSET > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port


def redis_cli() -> str:
    """The ``redis-cli`` beside the ``redis-server`` the tests use."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("redis-cli not found (apt-get install -y redis-server)")
    return found


@contextmanager
def cluster(workdir: Path, nodes: int = 3) -> Iterator[Cluster]:
    """A cluster of ``nodes`` masters on free loopback ports, its 16384 slots split
    evenly, ready (``cluster_state:ok`` on every node) when entered."""
    made = Cluster([node_port() for _ in range(nodes)], workdir)
    try:
        for port in made.ports:
            made.start(port)
        addresses = [f"127.0.0.1:{p}" for p in made.ports]
        subprocess.run(
            [redis_cli(), "--cluster", "create", *addresses, "--cluster-replicas", "0"],
            input="yes\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        give_up = time.monotonic() + 30
        while not made.ok():
            if time.monotonic() > give_up:
                raise RuntimeError("the cluster did not reach cluster_state:ok in 30 s")
            time.sleep(0.1)  # the nodes are gossiping; nothing here to await
        yield made
    finally:
        made.stop()
