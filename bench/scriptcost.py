"""What one batch's publish costs Redis, by how its replies are written.

``python -m bench.scriptcost`` starts a redis-server of its own and, for each reply size
(``echo``: replies of about 275 bytes, echo's own; ``1kb``; ``embed``: 384 floats, about
7.6 KB) and batch size, publishes batches through ``workers/publish.lua`` as a worker
does (:func:`workers.publish.publish`'s plan, every reply to one gateway's stream), then
reads each batch's reply entry as that gateway does (XREAD). Calls alternate between the
two ways the replies may be written, **fields** (``e``, ``e1``, ... a value each) and
**packed** (one field, a reply a line: :data:`pipelines.envelope.PACKED`), with no byte
bound on packing, so both are measured at every size. Redis times each command itself:
``SLOWLOG`` at a threshold of 0 gives every EVALSHA's and XREAD's own µs, without this
client's round trips. It prints, per size, the median µs a reply of each way, and the
packed one against the fields one: where the ratio crosses 1 is where packing stops
paying (:data:`workers.plan.PACKED_BYTES`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

import redis

import workers.plan as plans
from bench.systems import _redis
from pipelines.envelope import Reply, Request, dumps, encode, new_request_id
from pipelines.keys import GROUP, Keys
from pipelines.outcomes import Outcome
from workers.publish import PUBLISH_SCRIPT
from workers.values import Effects, Outbox

OK = Outcome.OK
SIZES: dict[str, Any] = {
    "echo": lambda: {"text": "the quick brown fox jumps over a lazy dog " * 2},
    "1kb": lambda: {"text": "x" * 1000},
    "embed": lambda: {"embedding": [random.random() for _ in range(384)]},
}


def _batch(client: redis.Redis, keys: Keys, size: str, n: int, packed: bool) -> list[Any]:
    """Enqueue and read ``n`` requests as a worker would, and the publish call of their
    replies: the script's keys and arguments."""
    stream, replies = keys.stage_stream("echo"), keys.reply_stream("g")
    requests = [
        Request(
            id=new_request_id(),
            pipeline="echo",
            stage="echo",
            step="echo",
            payload={},
            deadline=time.time() + 60,
            reply_to=replies,
        )
        for _ in range(n)
    ]
    pipe = client.pipeline(transaction=False)
    for request in requests:
        pipe.xadd(stream, encode(request))
    pipe.execute()
    [(_, read)] = cast(list[Any], client.xreadgroup(GROUP, "bench", {stream: ">"}, count=n))
    ids: list[bytes] = [eid for eid, _ in read]
    out = Outbox()
    for request in requests:
        reply = Reply(id=request.id, stage="echo", outcome=OK, result=SIZES[size]())
        out.effects[keys.done(request.id, "echo")] = Effects(
            marker_ttl_s=600,
            replies=[(replies, reply)],
            cancel_marker=keys.cancelled(request.id),
            batched=True,
            packed=packed,
        )
    call = plans.Call(
        out,
        acks={stream: ids},
        stats_key=keys.stage_stats("echo"),
        stats={},
        token_key=keys.publish_token(uuid.uuid4().hex),
        reply_maxlen=100_000,
        reply_ttl_s=300,
        job_prefix=keys.job_prefix,
        unmark={keys.on_model(stream): ids},
        fresh=frozenset([replies]),
    )
    plan = plans.compile_plan(call)
    assert plan is not None
    return [len(plan.keys), *plan.keys, *plan.script_args()]


def measure(
    client: redis.Redis, size: str, n: int, calls: int, namespace: str = ""
) -> dict[str, list[float]]:
    """µs a reply of ``calls`` publishes of each way (and of their XREAD), alternating,
    in ``namespace`` (default: a fresh one)."""
    keys = Keys(namespace or f"sc{uuid.uuid4().hex[:8]}")
    plans.PACKED_BYTES = 1 << 30  # both ways at every size
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 128)
    client.xgroup_create(keys.stage_stream("echo"), GROUP, id="0", mkstream=True)
    sha = client.script_load(PUBLISH_SCRIPT)
    got: dict[str, list[float]] = {"fields": [], "packed": [], "fields read": [], "packed read": []}
    last = "0"
    for i in range(calls):
        way = "packed" if i % 2 else "fields"
        args = _batch(client, keys, size, n, way == "packed")
        client.slowlog_reset()
        client.evalsha(sha, *args)
        client.xread({keys.reply_stream("g"): last}, count=1)
        for entry in client.slowlog_get(16):
            name = entry["command"].split()[0].upper()
            if name == b"EVALSHA":
                got[way].append(entry["duration"] / n)
            elif name == b"XREAD":
                got[f"{way} read"].append(entry["duration"] / n)
        last = client.xinfo_stream(keys.reply_stream("g"))["last-generated-id"]
    return got


def main(argv: list[str] | None = None) -> None:
    """Measure each size and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.scriptcost", description=__doc__)
    parser.add_argument("--sizes", default="echo,1kb,embed", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--batches", default="20,32", help="replies a batch, comma-separated")
    parser.add_argument("--calls", type=int, default=400, help="publishes per size and batch")
    args = parser.parse_args(argv)
    print(
        "| replies | batch | bytes a batch | fields µs/reply | packed µs/reply | packed / "
        "fields | XREAD fields | XREAD packed | both, packed / fields |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as workdir, _redis(Path(workdir)) as (url, _):
        client = redis.Redis.from_url(url)
        for size in args.sizes.split(","):
            sample = len(dumps(Reply(id="x" * 32, stage="echo", outcome=OK, result=SIZES[size]())))
            for n in (int(b) for b in args.batches.split(",")):
                m = {
                    k: statistics.median(v) for k, v in measure(client, size, n, args.calls).items()
                }
                both = (m["packed"] + m["packed read"]) / (m["fields"] + m["fields read"])
                print(
                    f"| {size} | {n} | {sample * n} | {m['fields']:.2f} | {m['packed']:.2f} | "
                    f"{m['packed'] / m['fields']:.2f}x | {m['fields read']:.2f} | "
                    f"{m['packed read']:.2f} | {both:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
