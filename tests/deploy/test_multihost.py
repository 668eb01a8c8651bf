"""Several hosts on one machine, and the dashboard's metric names.

The multi-host test builds six network namespaces: ``redis``, ``gw``, ``w1``, ``w2`` and
``client`` ("hosts", one address each in 10.200.0.0/24) and ``switch`` (a bridge joining
them by veth pairs). That network exists only inside the namespaces the test creates: the
root namespace gets no interface, address or route, and nothing is sent anywhere else.
Redis, the gateway and two worker processes per worker host run as separate processes
and reach each other over TCP across the bridge, as on separate machines. A client on its
own host drives a bounded closed loop through the gateway; mid-load every process of
``w1`` is SIGKILLed, as when a machine loses power. The test counts what came back.

The test skips, saying why, where namespaces cannot be made (it needs root, and ``ip``
from Debian's ``iproute2``); it probes by making one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import redis.asyncio as aioredis

from conveyor.embedded import find_redis_server
from pipelines.envelope import decode_replies, decode_request
from pipelines.keys import GROUP, Keys
from runtime.redisio import text
from runtime.stats import read_stats
from tests.helpers import REPO, Doubler, Harness, number_stage

DASHBOARD = REPO / "deploy" / "grafana" / "conveyor-dashboard.json"

SUBNET = "10.200.0."  # lives only inside the namespaces this test creates
HOSTS = {"redis": 2, "gw": 3, "w1": 11, "w2": 12, "client": 20}
WORKER_HOSTS = ("w1", "w2")
WORKERS_PER_HOST = 2
DOOMED = "w1"
REQUESTS, CONCURRENCY, REQUEST_TIMEOUT_S = 200, 16, 60.0
NAMESPACE = "multihost"
WORKER_ENV = {
    "CONVEYOR_TEST_DELAY_S": "0.25",  # model time per batch
    "CONVEYOR_MAX_BATCH_SIZE": "4",  # small batches spread the load over all four workers
    # Long enough that no survivor reclaims the dead host's entries before the client host
    # has read what it held: that read comes after the test host has found, killed and
    # reaped the host's processes, which a loaded machine makes slow. Short enough for the
    # load to finish soon after.
    "CONVEYOR_MIN_IDLE_MS": "3000",
    "CONVEYOR_RECLAIM_INTERVAL_MS": "100",
    "CONVEYOR_BLOCK_MS": "100",
}
DOOMED_ENV = {"CONVEYOR_TEST_DELAY_S": "2"}
"""The doomed host's batches run long, so that it holds work when the kill lands: with
the survivors' 0.25 s, a batch asked about when the kill was asked for was often answered
and acked before the kill (the test host finds the namespace's processes first), and the
next not read yet: nothing was left to strand on a loaded machine."""


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raise with its message when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def netns_unavailable() -> str | None:
    """Why namespace hosts cannot be built here, or None when they can.

    Probed by doing it: a namespace holding a bridge and a veth pair, then deleted.
    """
    if shutil.which("ip") is None:
        return "`ip` is not installed (Debian/Ubuntu: apt-get install iproute2)"
    name = f"cvprobe-{secrets.token_hex(3)}"
    try:
        ip("netns", "add", name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create network namespaces (needs root: CAP_SYS_ADMIN, CAP_NET_ADMIN): {exc}"
    try:
        ip("-n", name, "link", "add", "br0", "type", "bridge")
        ip("-n", name, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    except RuntimeError as exc:
        return f"no bridge or veth support in a network namespace: {exc}"
    finally:
        ip("netns", "del", name)
    return None


class Lab:
    """Namespace hosts on one bridge, the processes started in them, and their logs.

    Args:
        workdir: where logs and Redis's files go.
    """

    def __init__(self, workdir: Path) -> None:
        self.tag = f"cv{secrets.token_hex(3)}"  # concurrent runs never share a name
        self.workdir = workdir
        self.switch = f"{self.tag}-switch"
        self.made: list[str] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._readers: list[Lines] = []

    def ns(self, host: str) -> str:
        """The namespace of ``host``."""
        return f"{self.tag}-{host}"

    @staticmethod
    def addr(host: str) -> str:
        """The address of ``host`` on the bridge."""
        return f"{SUBNET}{HOSTS[host]}"

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)

    def build(self) -> None:
        """Create the switch and every host, each host wired to the bridge by a veth pair
        created straight into the two namespaces (never in the root namespace)."""
        self._add_ns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in HOSTS:
            ns, port = self.ns(host), f"to-{host}"
            self._add_ns(ns)
            veth_pair = ("type", "veth", "peer", "name", "eth0", "netns", ns)  # far end: ns's eth0
            ip("-n", self.switch, "link", "add", port, *veth_pair)
            ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def start(
        self, host: str, name: str, argv: list[str], env: dict[str, str], **popen: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host``'s namespace; its output goes to ``name``.log."""
        log = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(log)
        popen.setdefault("stdout", log)
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv], env=env, cwd=REPO, stderr=log, **popen
        )
        self.procs[name] = proc
        return proc

    def lines(self, proc: subprocess.Popen[bytes]) -> Lines:
        """Read ``proc``'s stdout (a pipe) line by line."""
        assert proc.stdout is not None
        reader = Lines(proc.stdout)
        self._readers.append(reader)
        return reader

    def pids(self, host: str) -> list[int]:
        """Every process living in ``host``'s namespace."""
        command = ["ip", "netns", "pids", self.ns(host)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
        return [int(p) for p in done.stdout.split()]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host``, as a machine losing power; their pids."""
        killed = self.pids(host)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs.values():  # reap our children among them
            if proc.pid in killed:
                proc.wait(timeout=10)
        give_up = time.monotonic() + 10
        while self.pids(host):
            assert time.monotonic() < give_up, f"processes of {host} outlived SIGKILL"
            time.sleep(0.05)  # waiting on the kernel to finish the kill
        return killed

    def wait_for_log(self, name: str, needle: str, limit_s: float = 20) -> None:
        """Wait until ``name``.log says ``needle`` (its process must stay up meanwhile)."""
        give_up = time.monotonic() + limit_s
        path = self.workdir / f"{name}.log"
        while needle not in path.read_text(errors="replace"):
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.tails()}"
            assert time.monotonic() < give_up, f"{name}: no {needle!r} in {limit_s} s"
            time.sleep(0.05)  # another process's start-up

    def tails(self, lines: int = 15) -> str:
        """The last lines of every log, for failure messages."""
        out = []
        for name in self.procs:
            body = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
            out.append(f"--- {name}.log\n" + "\n".join(body[-lines:]))
        return "\n".join(out)

    def close(self) -> None:
        """Kill every process, then delete the namespaces (their veths and the bridge go
        with them)."""
        for ns in self.made:
            done = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10
            )
            for pid in done.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdin is not None:
                proc.stdin.close()
        for reader in self._readers:
            reader.join()
        for log in self._logs:
            log.close()
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


class Lines:
    """A child's stdout line by line, each wait bounded."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[bytes]) -> None:
        with stream:  # closed here, by its only reader
            for line in stream:
                self._queue.put(line.decode().rstrip("\n"))
        self._queue.put("")  # end of output

    def join(self) -> None:
        """Wait for the output to end (its process has exited)."""
        self._thread.join(timeout=10)

    def next(self, limit_s: float) -> str:
        """The next line ('' at the end of output); fails after ``limit_s``."""
        try:
            return self._queue.get(timeout=max(0.1, limit_s))
        except queue.Empty:
            pytest.fail(f"no output from the client host within {limit_s:.0f} s")


def base_env() -> dict[str, str]:
    """This process's environment without its CONVEYOR_* settings, plus the test app."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    return env | {
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "CONVEYOR_APP": "tests.support.faultapp:pipelines",
        "CONVEYOR_NAMESPACE": NAMESPACE,
    }


@pytest.mark.timeout(90)
def test_a_worker_host_dies_under_load_and_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    redis_server = find_redis_server()
    started = time.monotonic()
    lab = Lab(tmp_path)
    password = secrets.token_hex(16)
    redis_url = f"redis://:{password}@{lab.addr('redis')}:6379/0"
    gateway_url = f"http://{lab.addr('gw')}:8000"
    env = base_env() | {"CONVEYOR_REDIS_URL": redis_url}
    try:
        lab.build()
        redis_argv = [redis_server, "--bind", lab.addr("redis"), "--port", "6379"]
        redis_argv += ["--requirepass", password, "--dir", str(tmp_path)]
        redis_argv += ["--save", "", "--appendonly", "no"]
        lab.start("redis", "redis", redis_argv, env)
        lab.wait_for_log("redis", "Ready to accept connections")
        gateway_env = {
            "CONVEYOR_HOST": lab.addr("gw"),
            "CONVEYOR_PORT": "8000",
            "CONVEYOR_PIPELINES": "slow",
            "CONVEYOR_REPLY_BLOCK_MS": "100",
        }
        lab.start("gw", "gateway", [sys.executable, "-m", "gateway"], env | gateway_env)
        consumers = []
        for host in WORKER_HOSTS:
            for i in range(WORKERS_PER_HOST):
                name = f"{host}-{i}"  # the consumer name too: which host held what
                worker_env = env | WORKER_ENV | {"CONVEYOR_CONSUMER_NAME": name}
                worker_env |= DOOMED_ENV if host == DOOMED else {}
                lab.start(host, name, [sys.executable, "-m", "workers", "slow"], worker_env)
                consumers.append(name)
        doomed_workers = {lab.procs[n].pid for n in consumers if n.startswith(DOOMED)}
        config = {
            "gateway": gateway_url,
            "redis_url": redis_url,
            "namespace": NAMESPACE,
            "consumers": consumers,
            "doomed": DOOMED,
        }
        code = "from tests.deploy.test_multihost import main; main()"
        driver_argv = [sys.executable, "-c", code, json.dumps(config)]
        driver = lab.start(
            "client", "client", driver_argv, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert driver.stdin is not None
        lines = lab.lines(driver)
        budget = started + 80  # the whole scenario, start-up to the last answer

        line = lines.next(budget - time.monotonic())
        assert line == "kill", f"client host said {line!r}\n{lab.tails()}"
        killed = lab.kill_host(DOOMED)
        driver.stdin.write(b"killed\n")
        driver.stdin.flush()
        line = lines.next(budget - time.monotonic())
        assert line.startswith("result "), f"client host said {line!r}\n{lab.tails()}"
        result = json.loads(line.removeprefix("result "))
    finally:
        lab.close()
    elapsed = time.monotonic() - started
    print(f"multihost: {summary(result, killed)}; {elapsed:.1f} s in all")

    assert doomed_workers <= set(killed)  # every worker of the host died with it
    assert result["stranded"], (
        f"the dead host held no work when it died (held {result['held_at_kill']} when the "
        "kill was asked for)"
    )
    answers = result["answers"]
    assert sorted(a[0] for a in answers) == list(range(REQUESTS))  # each answered, once
    wrong = [a for a in answers if (a[1], a[2]) != (200, {"value": 2 * a[0]})]
    assert wrong == []
    # Each request's reply was published once (its step's done marker, below), carrying the
    # caller's trace id. The gateway trims its reply stream behind its reader: what is
    # left to look at is what it read since its last trim (fewer than 64 entries,
    # each one reply or a batch's, or one trim in flight), and once it is quiet, nothing
    # (the drive waits for that).
    replies = result["replies"]
    assert all(n == 1 for n in Counter(r[0] for r in replies).values())
    traces = {a[3]: f"mh-{a[0]}" for a in answers}
    assert all(traces[r[0]] == r[2] for r in replies), replies
    assert {r[1] for r in replies} <= {"ok"}
    assert result["reply_streams"] == 1
    assert result["done_markers"] == REQUESTS  # one "effects published" marker per step
    stats = result["stats"]
    # A step may run twice (its second publication is skipped), never be answered twice.
    assert stats.get("items:ok", 0) >= REQUESTS
    assert stats.get("items:error", 0) == stats.get("items:expired", 0) == 0
    assert stats.get("dead_letters", 0) == 0
    assert result["dlq_entries"] == 0
    assert result["pending"] == 0  # the dead host's entries were all reclaimed and acked
    assert all(c["pending"] == 0 for c in result["consumers"])
    http = [
        s
        for s in parse_metrics(result["metrics"])
        if s[0] == "conveyor_http_requests_total" and s[1]["route"] == "/v1/slow"
    ]
    assert [(s[1]["status"], s[2]) for s in http] == [("200", REQUESTS)]
    assert elapsed < 90


def summary(result: dict[str, Any], killed: list[int]) -> str:
    """One line of what the multi-host run injected and counted."""
    stats = result["stats"]
    return (
        f"{len(result['answers'])} answered ({sum(a[1] == 200 for a in result['answers'])} "
        f"ok), {len(result['replies'])} replies left untrimmed; killed {DOOMED} "
        f"(pids {killed}) after {result['answered_at_kill']} answers, holding "
        f"{result['held_at_kill']} -> {len(result['stranded'])} stranded; items:ok="
        f"{stats.get('items:ok', 0):g} batches={stats.get('batches', 0):g}; consumers listed "
        f"after: {len(result['consumers'])}; load {result['load_s']:.1f} s, "
        f"{result['after_kill_s']:.1f} s after the kill"
    )


# --- the client host -------------------------------------------------------------------


def main() -> None:
    """The client host's side: ``python -c '...main()' CONFIG_JSON``.

    Prints ``kill`` when the doomed host holds work, waits for ``killed`` on stdin, and
    prints ``result JSON`` once every request has been answered.
    """
    config = json.loads(sys.argv[1])
    result = asyncio.run(drive(**config))
    print("result " + json.dumps(result), flush=True)


async def _until(what: str, check: Any, limit_s: float) -> None:
    give_up = time.monotonic() + limit_s
    while not await check():
        if time.monotonic() > give_up:
            raise TimeoutError(f"{what}: not within {limit_s} s")
        await asyncio.sleep(0.02)


async def drive(
    gateway: str, redis_url: str, namespace: str, consumers: list[str], doomed: str
) -> dict[str, Any]:
    """Drive the closed loop, ask for the kill mid-load, and collect what happened."""
    keys = Keys(namespace)
    stream = keys.stage_stream("slow")
    doomed_names = {c for c in consumers if c.startswith(f"{doomed}-")}
    client = aioredis.from_url(redis_url)
    answers: list[list[Any]] = []
    try:
        async with httpx.AsyncClient(base_url=gateway, timeout=REQUEST_TIMEOUT_S) as http:

            async def all_consumers_joined() -> bool:
                try:
                    scrape = (await http.get("/metrics")).text
                except httpx.TransportError:  # the gateway is still starting
                    return False
                joined = [
                    s[2]
                    for s in parse_metrics(scrape)
                    if s[0] == "conveyor_stage_consumers" and s[1]["stage"] == "slow"
                ]
                return joined == [len(consumers)]

            await _until("every worker joined", all_consumers_joined, 40)
            values = iter(range(REQUESTS))

            async def closed_loop() -> None:  # one client: next request after each answer
                for v in values:
                    try:
                        trace = {"X-Trace-Id": f"mh-{v}"}
                        resp = await http.post("/v1/slow", json={"value": v}, headers=trace)
                        request_id = resp.headers.get("x-request-id")
                        answers.append([v, resp.status_code, resp.json(), request_id])
                    except (httpx.HTTPError, ValueError) as exc:  # no answer, or not JSON
                        answers.append([v, 0, repr(exc), None])

            load_started = time.monotonic()
            loops = [asyncio.create_task(closed_loop()) for _ in range(CONCURRENCY)]
            held: dict[str, int] = {}

            async def doomed_host_busy() -> bool:
                nonlocal held
                rows = await client.xinfo_consumers(stream, GROUP)
                pending = {text(c["name"]): int(c["pending"]) for c in rows}
                held = {name: n for name, n in pending.items() if name in doomed_names}
                return len(answers) >= REQUESTS // 4 and sum(held.values()) > 0

            await _until("the doomed host held work", doomed_host_busy, 30)
            answered_at_kill = len(answers)
            print("kill", flush=True)
            reply = await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), 15)
            assert reply.strip() == "killed", reply
            killed_at = time.monotonic()
            stranded: list[int] = []  # what the dead host held: only another host can finish it
            for name in sorted(doomed_names):
                rows = await client.xpending_range(stream, GROUP, "-", "+", 1000, name)
                for row in rows:
                    eid = row["message_id"]
                    for _, fields in await client.xrange(stream, eid, eid) or []:
                        stranded.append(decode_request(fields or {}).payload["value"])
            await asyncio.wait_for(asyncio.gather(*loops), REQUEST_TIMEOUT_S + 5)
            done_at = time.monotonic()
            metrics = (await http.get("/metrics")).text
        replies: list[list[Any]] = []
        streams = [k async for k in client.scan_iter(match=keys.reply_stream("*"))]
        for key in streams:
            for _, fields in await client.xrange(key) or []:
                for r in decode_replies(fields or {}):
                    replies.append([r.id, r.outcome, r.trace_id])

        async def trimmed() -> bool:  # a read that finds nothing new trims all read ones
            return all([await client.xlen(key) == 0 for key in streams])

        await _until("the quiet gateway trimmed its reply stream", trimmed, 15)
        markers = [k async for k in client.scan_iter(match=keys.done("*", "*"), count=1000)]
        group = await client.xinfo_consumers(stream, GROUP)
        return {
            "answers": sorted(answers, key=lambda a: int(a[0])),
            "answered_at_kill": answered_at_kill,
            "held_at_kill": held,
            "stranded": sorted(stranded),
            "replies": replies,
            "reply_streams": len(streams),
            "done_markers": len(markers),
            "stats": await read_stats(client, keys, "slow"),
            "pending": (await client.xpending(stream, GROUP))["pending"],
            "dlq_entries": await client.xlen(keys.dead_letters("slow")),
            "consumers": [{"name": text(c["name"]), "pending": int(c["pending"])} for c in group],
            "metrics": metrics,
            "load_s": done_at - load_started,
            "after_kill_s": done_at - killed_at,
        }
    finally:
        await client.aclose()


# --- the dashboard ---------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(scrape: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text."""
    out = []
    for line in scrape.splitlines():
        match = _SAMPLE.match(line.strip())
        if match and not line.startswith("#"):
            name, inner, value = match.groups()
            out.append((name, dict(_LABEL.findall(inner or "")), float(value)))
    return out


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those folded inside rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


_METRIC = re.compile(r"\b(conveyor_\w+)\b")
_SELECTOR = re.compile(r"\b(conveyor_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


async def test_dashboard_queries_use_exported_metrics(harness: Harness) -> None:
    stage = number_stage(max_batch_size=8, batch_wait_ms=2)
    worker = harness.worker(stage, Doubler())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    assert (await http.post("/v1/double", json={"value": 1})).json() == {"value": 2}
    exported: dict[str, set[str]] = {}
    for name, labels, _ in parse_metrics((await http.get("/metrics")).text):
        exported.setdefault(name, set()).update(labels)

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36  # Grafana 9.x/10+
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    stage_var = variables["stage"]
    queries = [(stage_var["definition"], "variable stage")]
    all_panels = list(panels(dashboard))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    for panel in all_panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        queries += [(t["expr"], panel["title"]) for t in panel["targets"]]

    problems = []
    for expr, where in queries:
        names = set(_METRIC.findall(expr))
        if not names:
            problems.append(f"{where}: no conveyor metric in {expr!r}")
        for name in names - exported.keys():
            problems.append(f"{where}: {name} is not exported")
        for name, inner in _SELECTOR.findall(expr):
            for label in set(_MATCHER.findall(inner)) - exported.get(name, set()):
                problems.append(f"{where}: {name} has no label {label!r}")
            filtered = 'stage=~"$stage"' in inner.replace(" ", "")
            if name.startswith("conveyor_stage_") and where != "variable stage" and not filtered:
                problems.append(f"{where}: {name} is not filtered by $stage")
        known = set().union(*(exported.get(n, set()) for n in names))
        for group in _GROUPING.findall(expr):
            for label in {g.strip() for g in group.split(",") if g.strip()} - known:
                problems.append(f"{where}: groups by {label!r}, which its metrics lack")
    assert problems == []
    # Every metric the gateway exports has a panel.
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for e, _ in queries for n in _METRIC.findall(e)}
    assert families - shown == set()
