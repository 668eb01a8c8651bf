"""schemathesis against the live gateway's own OpenAPI document.

A real uvicorn on loopback serves the gateway, with real workers for every stage it
routes (the light built-ins: ``echo``, ``chain``, ``broadcast``, ``hello``). Each operation
gets a bounded number of generated requests, valid and invalid; schemathesis's standard
checks run on every answer (statuses, content types, headers and bodies as documented),
and no answer may be a 5xx other than the documented 503 and 504.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.result import Ok

from pipelines.registry import load_registry
from pipelines.settings import CommonSettings
from runtime.redisio import connect
from tests.helpers import Harness

EXAMPLES = 60
"""Generated requests per operation and mode (valid, invalid): bounded, for a fast suite."""
BUDGET_S = 45.0
"""Generation stops (for every operation left) once the run has taken this long."""


def documented_server_errors(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx but the documented 503 (refused: overload, Redis) and 504 (deadline)."""
    if response.status_code >= 500 and response.status_code not in (503, 504):
        raise Failure(
            operation=case.operation.label,
            title="Server error",
            message=f"{response.status_code}: {response.text[:300]}",
        )
    return None


def fuzz(base: str, headers: dict[str, str] | None = None, budget_s: float = BUDGET_S) -> list[str]:
    """Run every operation's examples; return the failures (all of them, not just the
    first)."""
    schema = schemathesis.openapi.from_url(
        f"{base}/openapi.json", timeout=10, headers=headers or {}
    )
    failures: list[str] = []
    counts: dict[str, int] = {}
    first: dict[str, str] = {}  # each operation's first failure, as raised
    ends: dict[str, float] = {}
    operations = list(schema.get_all_operations())
    for result in operations:
        assert isinstance(result, Ok), result  # the document itself is valid
        operation = result.ok()
        # Each operation its own share of the budget: on a slow machine every one is still
        # exercised, with fewer examples, instead of the last ones not at all.
        ends[operation.label] = time.monotonic() + budget_s / len(operations)
        strategy = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE),
            operation.as_strategy(GenerationMode.NEGATIVE),
        )

        @hypothesis.given(case=strategy)
        @hypothesis.settings(
            max_examples=2 * EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            label = case.operation.label
            if label in counts and time.monotonic() > ends[label]:  # one, even when slow
                return
            counts[label] = counts.get(label, 0) + 1
            try:
                case.call_and_validate(
                    base_url=base,
                    headers=headers,
                    timeout=30,
                    excluded_checks=[not_a_server_error],
                    additional_checks=[documented_server_errors],
                )
            except (Exception, FailureGroup) as exc:
                # Kept: a rerun past the operation's budget returns early, and hypothesis
                # then reports only "flaky", not what failed the first time.
                first.setdefault(label, f"{case.method} {case.path}: {exc!r}"[:2000])
                raise

        try:
            check()
        except (Exception, FailureGroup) as exc:
            seen = first.get(operation.label, "")
            failures.append(f"{operation.label}:\n{exc}\nfirst failure: {seen}")
    print("requests per operation:", counts)
    assert len(counts) == len(operations), counts  # every operation was exercised
    return failures


@pytest.mark.parametrize("keys", [False, True], ids=["keys-off", "keys-on"])
async def test_schemathesis_finds_nothing_on_the_live_gateway(harness: Harness, keys: bool) -> None:
    await fuzz_gateway(harness, keys)


@pytest.mark.usefixtures("on_cluster")
async def test_schemathesis_finds_nothing_on_a_partitioned_gateway_on_a_cluster(
    env: None,
) -> None:
    client = connect(CommonSettings())  # made now: the cluster's settings are set
    harness = Harness(client)
    try:
        await fuzz_gateway(harness, keys=False, budget_s=BUDGET_S / 2)
    finally:
        await harness.close()
        await client.aclose()


async def fuzz_gateway(harness: Harness, keys: bool, budget_s: float = BUDGET_S) -> None:
    """Fuzz a live gateway (uvicorn on loopback) serving echo, chain, broadcast and hello
    with real workers; fails with every failure schemathesis found."""
    registry = load_registry(None, "echo,chain,broadcast,hello")
    await harness.start_workers(registry)
    api_keys = ["fuzz-key"] if keys else []
    base = await harness.http_server(registry, default_timeout_s=10, api_keys=api_keys)
    # With keys on, the document declares them (security schemes, 401s) and the fuzzer
    # presents the key; schemathesis's own auth checks then try requests without it.
    headers = {"X-API-Key": "fuzz-key"} if keys else None
    failures = await asyncio.to_thread(fuzz, base, headers, budget_s / 2 if keys else budget_s)
    assert not failures, "\n\n".join(failures)
