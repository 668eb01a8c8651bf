"""Commands packed by hiredis (runtime/packing.py): the same bytes as redis-py's own
packer for every type a command takes (large values, memoryviews and other types left to
redis-py's), refusals as redis-py's, every client ``connect`` makes (plain, TLS, Unix
socket, cluster) packing so, and values that reach a real Redis whole."""

from __future__ import annotations

import asyncio
import enum
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from conveyor.embedded import cluster
from pipelines.settings import CommonSettings
from pipelines.stages import Stage, TextIn
from runtime.packing import LARGE, packing
from runtime.redisio import connect
from tests.helpers import Harness
from workers.models.toy import Echo

ODD = [
    "plain",
    "é and 漢字 and an emoji 🙂",
    b"\x00\xff\r\n$*binary",
    bytearray(b"a bytearray"),
    memoryview(b"a memoryview"),
    0,
    -7,
    2**70,
    0.1 + 0.2,
    -0.0,
    1e300,
    float("inf"),
    "",
    b"",
    "x" * 10_000,  # past redis-py's chunking cutoff
    b"y" * (LARGE + 1),  # past LARGE: redis-py's packer
]


def packed_both(*args: Any) -> tuple[bytes, bytes]:
    ours = packing(Connection)()
    theirs = Connection()
    return b"".join(ours.pack_command(*args)), b"".join(
        bytes(chunk) for chunk in theirs.pack_command(*args)
    )


@pytest.mark.parametrize("value", ODD, ids=lambda v: type(v).__name__)
def test_every_value_type_packs_to_redis_pys_bytes(value: object) -> None:
    ours, theirs = packed_both("SET", "key", value)
    assert ours == theirs


def test_a_command_name_with_spaces_is_split_as_redis_py_splits_it() -> None:
    for head in ("CONFIG GET", b"CONFIG GET", "OBJECT ENCODING"):
        ours, theirs = packed_both(head, "maxmemory")
        assert ours == theirs
        assert ours.startswith(b"*3\r\n")


@pytest.mark.parametrize("bad", [None, True, object(), ["a list"]], ids=repr)
def test_what_redis_py_refuses_is_refused_with_its_error(bad: Any) -> None:
    with pytest.raises(DataError):
        packing(Connection)().pack_command("SET", "key", bad)
    with pytest.raises(DataError):
        Connection().pack_command("SET", "key", bad)


def test_a_large_command_is_left_to_redis_py_which_does_not_copy_its_values() -> None:
    value = b"z" * (LARGE + 1)
    chunks = packing(Connection)().pack_command("XADD", "s", "*", "e", value)
    assert any(chunk is value for chunk in chunks)  # passed on, not copied
    small = packing(Connection)().pack_command("XADD", "s", "*", "e", b"z" * 100)
    assert len(small) == 1


def test_a_memoryview_is_left_to_redis_py() -> None:
    view = memoryview(b"abcdef")[::2]  # not contiguous: hiredis would send "abc"
    ours = packing(Connection)().pack_command("SET", "key", view)
    assert any(chunk is view for chunk in ours)
    assert [bytes(c) for c in ours] == [
        bytes(c) for c in Connection().pack_command("SET", "key", view)
    ]


def test_an_int_subclass_packs_as_redis_py_packs_it() -> None:
    class Level(enum.IntEnum):
        HIGH = 3

    ours, theirs = packed_both("SET", "key", Level.HIGH)
    assert ours == theirs


def test_another_encoding_packs_as_redis_py_does() -> None:
    conn = packing(Connection)(encoding="latin-1")
    assert (
        b"".join(conn.pack_command("SET", "k", "é"))
        == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n\xe9\r\n"
    )


def test_each_connection_class_keeps_its_own_kind() -> None:
    unix = packing(UnixDomainSocketConnection)
    assert issubclass(unix, UnixDomainSocketConnection)
    assert packing(unix) is unix
    assert packing(Connection) is packing(Connection)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://127.0.0.1:1/0", Connection),
        ("rediss://127.0.0.1:1/0", SSLConnection),
        ("unix:///tmp/nowhere.sock", UnixDomainSocketConnection),
    ],
)
def test_every_plain_client_connect_makes_packs_with_hiredis(
    url: str, kind: type[Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_REDIS_URL", url)
    client = connect(CommonSettings())  # its pool connects lazily: no server needed
    made = client.connection_pool.connection_class
    assert made is packing(kind)
    assert made.__mro__[2] is kind  # the URL's kind of connection, packing with hiredis
    connection = made(**client.connection_pool.connection_kwargs)  # made, not connected
    assert connection.pack_command("GET", "k") == [b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"]


async def test_values_of_every_type_reach_redis_whole(env: None) -> None:
    client = connect(CommonSettings())
    assert client.connection_pool.connection_class is packing(Connection)
    key = f"t{uuid.uuid4().hex}"
    try:
        for value in ODD:
            await client.set(key, value)  # type: ignore[arg-type]
            got = await client.get(key)
            want = value if isinstance(value, bytes) else None
            if isinstance(value, str):
                want = value.encode()
            elif isinstance(value, bytearray | memoryview):
                want = bytes(value)
            elif isinstance(value, int | float):
                want = repr(value).encode()
            assert got == want
        async with client.pipeline(transaction=True) as pipe:
            pipe.xadd(key + ":s", {"f": "é", "g": b"\x00"})
            pipe.xlen(key + ":s")
            _, length = await pipe.execute()
        assert length == 1
        with pytest.raises(DataError):
            await client.set(key, None)  # type: ignore[arg-type]
        assert await client.ping()  # the refused command left the connection usable
    finally:
        await client.delete(key, key + ":s")
        await client.aclose()


async def test_a_cluster_clients_nodes_pack_with_hiredis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cluster(tmp_path) as nodes:
        monkeypatch.setenv("CONVEYOR_REDIS_URL", nodes.url.replace("redis://", "redis+cluster://"))
        client = connect(CommonSettings())
        try:
            for i in range(20):  # keys over every node
                await client.set(f"k{i}", "é" * i)
            for i in range(20):
                assert await client.get(f"k{i}") == ("é" * i).encode()
            nodes_seen = client.get_nodes()  # type: ignore[attr-defined]
            assert len(nodes_seen) == 3
            for node in nodes_seen:
                assert node.connection_class is packing(node.connection_class)
                assert node.connection_class.__name__ == "PackedConnection"
        finally:
            await client.aclose()


async def test_a_batch_mixing_small_and_large_bodies_comes_back_whole_through_http(
    harness: Harness,
) -> None:
    """An attack on the two packing paths at once: concurrent calls whose texts are small
    (hiredis packs their XADDs and their batch's publish), past ``LARGE`` (redis-py's) or
    full of what encoders trip on (quotes, CR/LF, RESP's own ``$``/``*``, astral
    characters), batched together by a real worker behind a real gateway. Every answer
    is its own text, byte for byte."""
    stage = Stage("echo", TextIn, Echo, batch_wait_ms=20, max_batch_size=16)
    worker = harness.worker(stage, Echo())
    await worker.start()
    harness.run(worker)
    http = await harness.gateway([stage])
    odd = 'a "quote", \\ back, \r\n$5\r\n*2\r\n, é, 漢字, 🙂, \x00'
    texts = [
        *(f"small {i} {odd}" for i in range(12)),
        *(f"large {i} " + odd * (LARGE // len(odd) + 1) for i in range(3)),  # > LARGE each
    ]

    async def call(text: str) -> str:
        answer = await http.post("/v1/echo", json={"text": text}, timeout=60)
        assert answer.status_code == 200, answer.text[:300]
        result: str = answer.json()["text"]
        return result

    assert await asyncio.gather(*(call(t) for t in texts)) == texts
