"""bench.hotpath's watched interval: ``MONITOR`` lines read, each client connection given to
its process through /proc, and a connection's commands grouped into round trips."""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import NamedTuple

from bench.capacity import CONTAINERS, open_monitor, scripted_shares
from bench.systems import HOST

LUA = "lua"
"""The client ``MONITOR`` names for a command a script ran."""
PACKAGES = ("conveyor", "gateway", "workers", "runtime", "pipelines")
"""The product's code (whose uncommitted changes the report names)."""
PROCESSES = ("gateway", "worker", "other")
"""Who sends commands: conveyor's two processes, and any connection neither holds."""

_LINE = re.compile(rb'^\+(\d+\.\d+) \[\d+ ([^\]]+)\] "([^"]*)"(?: "((?:[^"\\]|\\.)*)")?')
_ENTRY_ID = re.compile(rb'\\"id\\":\\"([0-9A-Za-z_-]+)\\"')  # in an envelope's JSON
_DONE_KEY = re.compile(rb":done:([0-9A-Za-z_-]+):")  # a publish's marker, one per request
_CANCEL_KEY = re.compile(rb":cancelled:([0-9A-Za-z_-]+)")  # asked before the model runs


class Event(NamedTuple):
    """One ``MONITOR`` line: when Redis ran it (server clock, s), the client (``ip:port``
    or ``lua``), the command as commandstats names it, its first argument, and the
    request ids it names (an XADD's envelope, an EVALSHA's "done" markers, the keys any
    other command reads to ask whether a request was cancelled)."""

    at: float
    client: str
    command: str
    key: str
    ids: tuple[str, ...] = ()


def parse_line(line: bytes) -> Event | None:
    """The :class:`Event` of one ``MONITOR`` line; None for one that is no command."""
    found = _LINE.match(line)
    if found is None:
        return None
    at, client, name, first = found.groups()
    command = name.decode().lower()
    key = (first or b"").decode(errors="replace")
    if command in CONTAINERS and first is not None:
        command = f"{command}|{key.lower()}"
    ids: list[bytes] = []
    if command == "xadd":
        ids = _ENTRY_ID.findall(line)[:1]
    elif command in ("evalsha", "eval"):
        ids = _DONE_KEY.findall(line)
    else:
        ids = _CANCEL_KEY.findall(line)
    return Event(float(at), client.decode(), command, key, tuple(i.decode() for i in ids))


def round_trips(events: Iterable[Event], gap_s: float) -> list[tuple[str, list[str]]]:
    """``events`` (in ``MONITOR`` order) as round trips, (client, commands): a connection's
    command joins its last round trip if it came within ``gap_s`` and no other connection's
    came between (a script's commands belong to its call). Redis runs a pipeline's or a
    MULTI/EXEC's commands back to back; a second round trip waits for the client to read
    the reply and write again, which takes longer, or lets other clients' commands run."""
    trips: list[tuple[str, list[str]]] = []
    last_at = 0.0
    for e in events:
        if e.client == LUA:
            continue
        if trips and trips[-1][0] == e.client and e.at - last_at <= gap_s:
            trips[-1][1].append(e.command)
        else:
            trips.append((e.client, [e.command]))
        last_at = e.at
    return trips


def shape(commands: Sequence[str]) -> str:
    """A round trip as the tables name it, whatever its size: ``n SET + n GET`` (a run of
    several), ``XADD`` (one), ``MULTI/EXEC: XLEN, HMGET``."""
    runs = [("n " if len(list(run)) > 1 else "") + name.upper() for name, run in groupby(commands)]
    if len(runs) > 2 and commands[0] == "multi" and commands[-1] == "exec":
        return "MULTI/EXEC: " + ", ".join(runs[1:-1])
    return " + ".join(runs)


def socket_ports(tcp: str) -> dict[int, int]:
    """Local port by socket inode, from the text of ``/proc/net/tcp``."""
    out = {}
    for line in tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9:
            out[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return out


def client_roles(roles: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """``ip:port`` of every TCP socket the processes of each role hold, to its role."""
    ports = socket_ports(Path("/proc/net/tcp").read_text())
    out = {}
    for role, pids in roles.items():
        for pid in pids:
            try:
                links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            except OSError:
                continue  # gone
            for link in links:
                if link.startswith("socket:[") and (inode := int(link[8:-1])) in ports:
                    out[f"{HOST}:{ports[inode]}"] = role
    return out


@dataclass
class Watched:
    """One load under ``MONITOR``, by process (role): commands, round trips by
    :func:`shape` and the commands in them, connections; and the requests (entries the
    gateway wrote to a stage), the batches (script calls that publish requests), and per command
    the share of its calls scripts ran (``scripted``), and that scripts or a MULTI/EXEC ran
    (``nested``: their µs are inside the script's or the ``EXEC``'s too)."""

    requests: int
    batches: int
    commands: Counter[tuple[str, str]] = field(default_factory=Counter)
    trips: Counter[tuple[str, str]] = field(default_factory=Counter)
    trip_commands: Counter[tuple[str, str]] = field(default_factory=Counter)
    connections: Counter[str] = field(default_factory=Counter)
    scripted: dict[str, float] = field(default_factory=dict)
    nested: dict[str, float] = field(default_factory=dict)

    def per_request(self, role: str) -> float:
        """Round trips per request of one process (``all``: every process)."""
        chosen = PROCESSES if role == "all" else (role,)
        return sum(n for (r, _), n in self.trips.items() if r in chosen) / max(1, self.requests)


def tally(events: Sequence[Event], roles: Mapping[str, str], gap_s: float) -> Watched:
    """What :class:`Watched` holds, from the events of one interval and each client's role
    (a client without one is ``other``; a script's commands are ``in scripts``)."""
    role = {e.client: roles.get(e.client, "other") for e in events}
    role[LUA] = "in scripts"
    entries = (e for e in events if e.command == "xadd" and role[e.client] != role[LUA])
    out = Watched(
        requests=sum(1 for e in entries if ":stage:" in e.key),
        batches=sum(1 for e in events if e.command == "evalsha" and e.ids),
    )
    for e in events:
        out.commands[role[e.client], e.command] += 1
    for client, commands in round_trips(events, gap_s):
        out.trips[role[client], shape(commands)] += 1
        out.trip_commands[role[client], shape(commands)] += len(commands)
    out.connections.update(role[c] for c in {e.client for e in events} if c != LUA)
    out.scripted = scripted_shares(Counter((e.command, e.client == LUA) for e in events))
    out.nested = scripted_shares(Counter((e.command, inside) for e, inside in _nesting(events)))
    return out


def _nesting(events: Sequence[Event]) -> Iterator[tuple[Event, bool]]:
    """Each event, and whether it ran inside another command whose µs count it too: a
    script's (``lua``), or a MULTI/EXEC's (``EXEC``'s µs include the commands it runs;
    ``MONITOR`` shows them between the client's ``MULTI`` and ``EXEC``)."""
    open_multi: set[str] = set()
    for e in events:
        if e.command == "multi":
            open_multi.add(e.client)
        elif e.command in ("exec", "discard"):
            open_multi.discard(e.client)
        yield e, e.client == LUA or (e.client in open_multi and e.command != "multi")


class Monitor:
    """``MONITOR`` on a Redis, its output kept raw (a thread reads it) until stopped."""

    def __init__(self, port: int) -> None:
        self._sock, rest = open_monitor(HOST, port)
        self._chunks = [rest]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                chunk = self._sock.recv(1 << 20)
            except TimeoutError:
                continue  # nothing ran: look at the flag again
            if not chunk:
                return
            self._chunks.append(chunk)

    def stop(self) -> list[Event]:
        """Stop watching; every command seen, in order."""
        time.sleep(0.05)  # the last lines are on their way
        self._done.set()
        self._thread.join()
        self._sock.close()
        lines = b"".join(self._chunks).split(b"\r\n")
        return [e for line in lines if (e := parse_line(line)) is not None]
