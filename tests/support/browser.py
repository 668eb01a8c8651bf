"""Headless Chromium for the page tests: driven over its DevTools pipe, no port opened."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"
"""Every host name but loopback fails to resolve: the network is unreachable to the page."""


class Chromium:
    """Headless Chromium driven over its DevTools pipe (commands on fd 3, answers on fd 4),
    so no debugging port is opened. Answers and events are NUL-terminated JSON."""

    ARGS = (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-dev-shm-usage",
        "--no-proxy-server",
        "--remote-debugging-pipe",
        "--window-size=1200,900",
        OFFLINE,  # the pages must work on a host without internet
    )

    def __init__(
        self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader, commands: int
    ) -> None:
        self.proc = proc
        self.reader = reader
        self.commands = commands
        self.events: list[dict[str, Any]] = []
        self._id = 0

    @classmethod
    async def start(cls, profile: Path, log: Path) -> Chromium:
        """Launch Chromium with a fresh profile; its stderr goes to ``log``."""
        # Our ends above 10 so bash's "3<&r 4>&w" never clobbers one with the other.
        cmd_r, cmd_w = (_high(fd) for fd in os.pipe())
        out_r, out_w = (_high(fd) for fd in os.pipe())
        # bash, not dash: dash takes single-digit descriptors only.
        shell = f'exec "$0" "$@" 3<&{cmd_r} 4>&{out_w} {cmd_r}<&- {out_w}>&-'
        args = (*cls.ARGS, f"--user-data-dir={profile}", "about:blank")
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                "/bin/bash",
                "-c",
                shell,
                str(CHROMIUM),
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=err,
                pass_fds=(cmd_r, out_w),
            )
        os.close(cmd_r)
        os.close(out_w)
        reader = asyncio.StreamReader(limit=1 << 26)  # screenshots arrive as one message
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(out_r, "rb", buffering=0)
        )
        return cls(proc, reader, cmd_w)

    async def call(self, method: str, session: str | None = None, **params: Any) -> Any:
        """Send one command and return its result (events met on the way are kept)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        async with asyncio.timeout(10):  # a browser that stops answering fails the test
            while True:
                answer = json.loads((await self.reader.readuntil(b"\0"))[:-1])
                if answer.get("id") != self._id:
                    self.events.append(answer)
                elif "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                else:
                    return answer["result"]

    async def close(self) -> None:
        """Ask the browser to quit; kill it if it does not within a few seconds."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call("Browser.close"), 5)
        os.close(self.commands)
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def _high(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


@contextlib.asynccontextmanager
async def chromium(tmp_path: Path) -> AsyncIterator[Chromium]:
    """A Chromium for one test, its profile and log under ``tmp_path``."""
    browser = await asyncio.wait_for(
        Chromium.start(tmp_path / "profile", tmp_path / "chromium.log"), 10
    )
    try:
        yield browser
    finally:
        await browser.close()


async def open_page(browser: Chromium, url: str, width: int = 1440) -> str:
    """A new tab, ``width`` x 900, on ``url``; returns its DevTools session."""
    target = await browser.call("Target.createTarget", url="about:blank")
    attached = await browser.call(
        "Target.attachToTarget", targetId=target["targetId"], flatten=True
    )
    session: str = attached["sessionId"]
    await browser.call("Runtime.enable", session)
    await browser.call(
        "Emulation.setDeviceMetricsOverride",
        session,
        width=width,
        height=900,
        deviceScaleFactor=1,
        mobile=False,
    )
    await browser.call("Page.navigate", session, url=url)
    return session
