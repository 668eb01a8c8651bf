"""Key names and partitions (pipelines/keys.py): everything a request touches is in one
Redis Cluster slot, and partitions spread over the slot space."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from pipelines.keys import MAX_PARTITIONS, Keys
from pipelines.settings import CommonSettings

NAMESPACES = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


@given(NAMESPACES, st.integers(1, 64), st.text(min_size=1, max_size=80))
def test_every_key_of_a_request_is_in_its_partitions_slot(
    namespace: str, partitions: int, request_id: str
) -> None:
    keys = Keys(namespace, partitions).of(request_id)
    assert 0 <= keys.partition < partitions
    names = [
        keys.stage_stream("embed"),
        keys.stage_stream("embed", "bulk"),
        keys.stage_stats("embed"),
        keys.reply_stream("gw-1"),
        keys.join(request_id, "collect"),
        keys.job(request_id),
        keys.done(request_id, "embed"),
        keys.cancelled(request_id),
        keys.publish_token("t"),
        keys.dead_letters("embed"),
        keys.dropped("embed", "1-0"),
    ]
    assert {slot(n) for n in names} == {slot(keys.prefix + ":x")}
    # Any process computes the same partition for it.
    assert Keys(namespace, partitions).of(request_id).partition == keys.partition


@given(NAMESPACES, st.integers(2, 64))
def test_partitions_have_distinct_tags_each_in_its_share_of_the_slots(
    namespace: str, partitions: int
) -> None:
    parts = Keys(namespace, partitions).each()
    assert len({p.prefix for p in parts}) == partitions
    for k, part in enumerate(parts):
        low = k * REDIS_CLUSTER_HASH_SLOTS // partitions
        high = (k + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions
        assert low <= slot(part.prefix + ":x") < high
        # No partition's keys can be mistaken for another's (or the namespace's own).
        assert not part.is_reply_target(parts[(k + 1) % partitions].reply_stream("g"))


def test_request_ids_spread_over_partitions() -> None:
    keys = Keys("conveyor", 4)
    # The partitions' keys are built once and shared (their tags take a search).
    assert keys.of("a") is keys.at(keys.of("a").partition)
    assert keys.at(2).at(0) is keys
    counts = [0] * 4
    for n in range(4000):
        counts[keys.of(f"{n:032x}").partition] += 1
    assert min(counts) > 800  # 1000 each if even; a hash of the id, not a round-robin


@pytest.mark.parametrize("bad", ["0", "-1", str(MAX_PARTITIONS + 1), "two", "1.5"])
def test_a_bad_partition_count_is_refused_naming_the_setting(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_PARTITIONS", bad)
    with pytest.raises(ValueError, match="partitions"):
        CommonSettings()
