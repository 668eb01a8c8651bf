"""Gateways replaced without a gap (``conveyor up --reload``, when the app's routes
changed): the new gateway starts beside the old one on the same port (under ``--reload``
every gateway binds it with ``SO_REUSEPORT``, ``CONVEYOR_REUSE_PORT``), and the old one is
asked to stop, draining what it holds, only once the new one listens. Until then the old
one serves, and the kernel spreads new connections over both once both listen.

A new gateway that exits before it listens (the app's new code does not import, say) is
dropped with one line, and the old one goes on serving what it started with: the next
save tries again. Where it cannot be told whether a process listens (no ``/proc``, no
port), the old one is stopped :data:`GRACE_S` after the new one started.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from conveyor.children import ExitReports, Process, say
from conveyor.restarts import exited

GRACE_S = 5.0
"""Where listening cannot be seen: how long the new gateway runs before the old stops."""


@dataclass(eq=False)
class Handover:
    """One gateway being replaced: ``old`` serves until ``new`` listens."""

    old_name: str
    old: Process
    new_name: str
    new: Process
    since: float = field(default_factory=time.monotonic)


class Tended(Protocol):
    """What of ``up``'s supervisor a handover changes."""

    env: dict[str, str]
    children: list[tuple[str, Process]]
    groups: dict[str, Any]
    reports: ExitReports
    handovers: list[Handover]
    recycling: set[str]
    retiring: set[str]


def replaceable(up: Tended, name: str, proc: Process) -> bool:
    """Whether gateway ``name`` (``proc``) is one a reload replaces: still a child, not
    stopping already, and not itself a replacement that does not listen yet (its old
    gateway's handover starts a newer one instead)."""
    if (name, proc) not in up.children or name in up.retiring or name in up.recycling:
        return False
    return not any(h.new is proc for h in up.handovers)


def hand_over(
    up: Tended,
    name: str,
    proc: Process,
    spawn: Callable[[], Process],
    stop: Callable[[str, Process], None],
) -> None:
    """Start the replacement of gateway ``name`` (``proc``) beside it; one started for it
    earlier that does not listen yet (an older save) is stopped (``stop``: for good, and
    reaped as any child is)."""
    for pending in [h for h in up.handovers if h.old is proc]:
        up.handovers.remove(pending)
        stop(pending.new_name, pending.new)
    new = spawn()
    new_name = f"{name.partition('@')[0]}@{new.pid}"
    up.children.append((new_name, new))
    up.groups[new_name] = None
    up.handovers.append(Handover(name, proc, new_name, new))
    say(f"{new_name} starting (pid {new.pid}); {name} serves until it listens")


def settle(up: Tended, stop: Callable[[str, Process], None]) -> None:
    """Each replacement that listens now has its old gateway stopped (``stop``: for
    good, it drains); one that exited first is dropped, its old gateway serving on."""
    port = int(up.env.get("CONVEYOR_PORT", "0") or 0)
    for h in list(up.handovers):
        code = h.new.poll()
        if code is not None:
            up.reports.said(h.new)
            _drop(up, h)
            say(
                f"{h.new_name} {exited(code)} before it listened: {h.old_name} goes on "
                "serving the app as it was; the next change starts a new one"
            )
            continue
        ready = listening(h.new.pid, port) if port else None
        if ready is None:
            ready = time.monotonic() - h.since >= GRACE_S
        if ready or h.old.poll() is not None:
            up.handovers.remove(h)
            stop(h.old_name, h.old)


def _drop(up: Tended, h: Handover) -> None:
    up.handovers.remove(h)
    if (h.new_name, h.new) in up.children:
        up.children.remove((h.new_name, h.new))
    up.groups.pop(h.new_name, None)


def listening(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on TCP ``port``; None where it
    cannot be told (no Linux ``/proc``)."""
    inodes: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            cells = row.split()
            if len(cells) > 9 and cells[3] == "0A" and int(cells[1].rpartition(":")[2], 16) == port:
                inodes.add(f"socket:[{cells[9]}]")
    if not readable:
        return None
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone (its exit is seen at the next look)
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False
