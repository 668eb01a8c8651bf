"""The processes of :mod:`bench.floor`: the floor's HTTP server (``serve``) and its worker
(``work``), run as ``python -m bench.floor serve|work``.

Each role talks to Redis either on a bare asyncio protocol with hiredis (:class:`Link`,
the floor itself) or through conveyor's own Redis client (``--client redis-py``:
:func:`runtime.redisio.connect`, redis-py with conveyor's pool and packing). The server
speaks HTTP either on a bare protocol (:class:`Http`) or as an ASGI app under uvicorn with
httptools and uvloop (``--http uvicorn``), as conveyor's gateway runs. Those two steps
put the libraries conveyor stands on back on the floor, one at a time; what is left of
conveyor's cost above them is its own code.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import hiredis

HOST = "127.0.0.1"
STAGE = b"floor:stage"
GROUP = b"floor"
REPLIES = b"floor:replies"
DONE = "floor:done:"
MAX_BATCH = 32
BLOCK_MS = 1000
REPLY_CAP = 100_000

SCRIPT = """
local n = #KEYS - 2
local fields, ids = {}, {}
for i = 1, n do
  local at = 2 + (i - 1) * 3
  ids[i] = ARGV[at]
  if redis.call('SET', KEYS[i], '1', 'NX', 'EX', 3600) then
    fields[#fields + 1] = ARGV[at + 1]
    fields[#fields + 1] = ARGV[at + 2]
  end
end
if #fields > 0 then
  redis.call('XADD', KEYS[n + 1], 'MAXLEN', '~', ARGV[#ARGV], '*', unpack(fields))
end
redis.call('XACK', KEYS[n + 2], ARGV[1], unpack(ids))
return #fields / 2
"""
"""One batch's publish: KEYS are the batch's done markers, the reply stream and the stage
stream; ARGV the group, then an entry id, a request id and a reply per request, then the
reply stream's cap. A request whose marker exists (published before) is not answered
again."""

Call = Callable[..., Awaitable[Any]]
"""Sends one Redis command (its arguments); awaiting the result gives its answer."""


class Link(asyncio.Protocol):
    """One Redis connection: each command written as it is called, the answers matched to
    the calls in order."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (answer := self._reader.gets()) is not False:
            waiter = self._waiting.popleft()
            if waiter.done():
                continue
            if isinstance(answer, hiredis.ReplyError):
                waiter.set_exception(answer)
            else:
                waiter.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"Redis connection lost ({exc})"))

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Send one command; the future has its answer."""
        assert self._transport is not None
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._transport.write(hiredis.pack_command(args))
        return waiter


async def connection(redis_port: int, client: str) -> Call:
    """One way to send commands: a :class:`Link` (``raw``) or conveyor's client
    (``redis-py``), whose socket timeout allows the roles' blocking reads."""
    if client == "raw":
        _, link = await asyncio.get_running_loop().create_connection(Link, HOST, redis_port)
        return link.call
    from pipelines.settings import CommonSettings
    from runtime.redisio import connect

    settings = CommonSettings(redis_url=f"redis://{HOST}:{redis_port}/0")
    redis = connect(settings, block_ms=BLOCK_MS)

    async def call(*args: Any) -> Any:
        return await redis.execute_command(*args)  # type: ignore[no-untyped-call]

    return call


def _pairs(fields: Any) -> Iterable[tuple[bytes, bytes]]:
    """An entry's fields as redis-py parses them (a dict) or as hiredis reads them (flat)."""
    if isinstance(fields, dict):
        return cast(Iterable[tuple[bytes, bytes]], fields.items())
    return zip(fields[::2], fields[1::2], strict=True)


class Http(asyncio.Protocol):
    """One client connection of the bare server: keep-alive requests with a
    ``Content-Length``, each answered when its reply comes (in order only for a client
    that sends one at a time, as the bench's do). Anything else closes the connection."""

    def __init__(self, take: Callable[[bytes, Callable[[bytes], None]], None]) -> None:
        self._take = take
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = b"\r\n" + self._buffer[:end].lower() + b"\r\n"
            at = head.find(b"\r\ncontent-length:")
            length = -1
            if at >= 0:
                value = head[at + 17 : head.find(b"\r\n", at + 2)].strip()
                length = int(value) if value.isdigit() else -1
            if length < 0:  # not a request this server reads: the connection is done
                self._transport.close()
                return
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            self._take(body, self._answer)

    def _answer(self, reply: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(reply), reply)
            )


class Server:
    """The server's part that is the same however it speaks HTTP: each body to the stage
    stream under a fresh request id, and each reply read back to its request's answer."""

    def __init__(self, writes: Call, reads: Call) -> None:
        self._writes = writes
        self._reads = reads
        self._waiting: dict[bytes, Callable[[bytes], None]] = {}
        self._sending: set[asyncio.Future[Any]] = set()  # redis-py's calls, held till done

    def take(self, body: bytes, answer: Callable[[bytes], None]) -> None:
        """Enqueue ``body``; ``answer`` gets its reply."""
        rid = os.urandom(16).hex().encode()
        self._waiting[rid] = answer
        sent = asyncio.ensure_future(self._writes("XADD", STAGE, "*", "id", rid, "e", body))
        self._sending.add(sent)
        sent.add_done_callback(self._sent)

    def _sent(self, sent: asyncio.Future[Any]) -> None:
        self._sending.discard(sent)
        if not sent.cancelled() and sent.exception() is not None:
            raise SystemExit(f"floor: XADD failed: {sent.exception()!r}")  # ends the loop

    async def read_replies(self) -> None:
        """Forever: the reply stream's new entries, each reply to its request's answer."""
        last = b"$"
        while True:
            got = await self._reads("XREAD", "BLOCK", BLOCK_MS, "STREAMS", REPLIES, last)
            for _, entries in got or ():
                for entry_id, fields in entries:
                    last = entry_id  # the next read starts after it
                    for rid, reply in _pairs(fields):
                        answer = self._waiting.pop(rid, None)
                        if answer is not None:
                            answer(reply)


def _asgi(server: Server) -> Callable[..., Awaitable[None]]:
    """The server as an ASGI app: each HTTP request's body in, its reply out."""

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        replied: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        def answer(reply: bytes) -> None:
            if not replied.done():  # not given up on (a client gone)
                replied.set_result(reply)

        server.take(body, answer)
        reply = await replied
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(reply))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    return app


async def serve(redis_port: int, port: int, client: str, http: str) -> None:
    """The floor's server, speaking HTTP bare or under uvicorn (``http``)."""
    server = Server(await connection(redis_port, client), await connection(redis_port, client))
    replies = asyncio.ensure_future(server.read_replies())
    if http == "raw":
        loop = asyncio.get_running_loop()
        listening = await loop.create_server(lambda: Http(server.take), HOST, port)
        async with listening:
            await replies
        return
    import uvicorn

    config = uvicorn.Config(
        _asgi(server),
        host=HOST,
        port=port,
        loop="none",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )
    running = uvicorn.Server(config)
    # A reader that fails (Redis gone) ends the server, as it ends the bare one: requests
    # would otherwise wait for replies nobody reads.
    replies.add_done_callback(lambda _: setattr(running, "should_exit", True))
    await running.serve()
    if replies.done():
        replies.result()  # its error, if it had one
    replies.cancel()


def _model(model: str) -> Callable[[list[bytes]], list[bytes]]:
    """The floor's model, from a body each to a reply each: ``minilm`` runs MiniLM (as
    the bench's other systems build it, :func:`bench.workloads.load_model`) on the
    bodies' texts; a number sleeps that many ms per batch (the process idles, to the
    millisecond, as a loop timer is not) and echoes the bodies; ``0`` only echoes."""
    if model == "minilm":
        import orjson

        from bench.workloads import load_model

        embedder = load_model("embed", "cpu")

        def embed(bodies: list[bytes]) -> list[bytes]:
            results = embedder.predict([orjson.loads(body) for body in bodies])
            return [orjson.dumps(result) for result in results]

        return embed
    delay_s = float(model) / 1000

    def echo(bodies: list[bytes]) -> list[bytes]:
        if delay_s:
            time.sleep(delay_s)
        return bodies

    return echo


async def work(redis_port: int, client: str, model: str = "0") -> None:
    """The floor's worker: batches of the stage stream, each run through ``model``
    (:func:`_model`, on the loop itself: nothing else runs here meanwhile) and published
    by one script call."""
    run = _model(model)
    call = await connection(redis_port, client)
    try:
        await call("XGROUP", "CREATE", STAGE, GROUP, "0", "MKSTREAM")
    except Exception as exc:  # hiredis's or redis-py's error: a group made before is fine
        if "BUSYGROUP" not in str(exc):
            raise
    sha = await call("SCRIPT", "LOAD", SCRIPT)
    while True:
        got = await call(
            "XREADGROUP", "GROUP", GROUP, "w", "COUNT", MAX_BATCH, "BLOCK", BLOCK_MS,
            "STREAMS", STAGE, ">",
        )  # fmt: skip
        if not got:
            continue
        keys: list[bytes | str] = []
        args: list[Any] = [GROUP]
        entries = [(entry_id, dict(_pairs(fields))) for entry_id, fields in got[0][1]]
        replies = run([values[b"e"] for _, values in entries])
        for (entry_id, values), reply in zip(entries, replies, strict=True):
            rid = values[b"id"]
            keys.append(DONE + rid.decode())
            args += [entry_id, rid, reply]
        await call("EVALSHA", sha, len(keys) + 2, *keys, REPLIES, STAGE, *args, REPLY_CAP)
