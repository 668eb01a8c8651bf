"""``/metrics`` as Prometheus reads it: every family typed and described, its samples
together, parsed by ``prometheus_client`` and checked by ``promtool`` (where installed)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge import HTTP_FAMILIES
from runtime.metrics import Exposition
from runtime.stage_metrics import STAGE_FAMILIES
from tests.helpers import Doubler, Harness, number_stage

TYPES = {family.name: family.type for family in (*HTTP_FAMILIES, *STAGE_FAMILIES)}


def family_name(name: str, kind: str) -> str:
    """The name prometheus_client gives a family (a counter's without ``_total``)."""
    return name.removesuffix("_total") if kind == "counter" else name


async def served_metrics(harness: Harness) -> str:
    # Two stages, so a renderer writing stage by stage would interleave the families.
    stages = [number_stage("double", batch_wait_ms=2), number_stage("again", batch_wait_ms=2)]
    for stage in stages:
        worker = harness.worker(stage, Doubler())
        await worker.start()
        harness.run(worker)
    url = await harness.http_server(stages)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for i in range(3):
            for name in ("double", "again"):
                resp = await http.post(f"/v1/{name}", json={"value": i})
                assert resp.status_code == 200, resp.text
        assert (await http.post("/v1/double", json={"value": "x"})).status_code == 422
        resp = await http.get("/metrics")
    assert resp.status_code == 200
    return resp.text


async def test_every_family_is_typed_and_described_and_its_samples_are_together(
    harness: Harness,
) -> None:
    text = await served_metrics(harness)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # Issue 25: no HELP lines, and the stage families interleaved stage by stage, so
    # the parser read every stage metric as untyped.
    assert [f.name for f in families.values() if f.type == "unknown"] == []
    for name, kind in TYPES.items():
        family = families[family_name(name, kind)]
        assert family.type == kind, name
        assert family.documentation, name
    items = families["conveyor_stage_items"]
    got = {
        (s.labels["stage"], s.labels["outcome"]): s.value
        for s in items.samples
        if s.name == "conveyor_stage_items_total"
    }
    assert got[("double", "ok")] == 3
    assert got[("again", "ok")] == 3
    assert {outcome for _, outcome in got} == {"ok", "error", "expired", "cancelled"}
    run = families["conveyor_stage_run_seconds"]
    counts = {s.labels["stage"]: s.value for s in run.samples if s.name.endswith("_count")}
    assert counts["double"] >= 1
    assert counts["again"] >= 1
    requests = families["conveyor_http_requests"]
    by_status = {
        (s.labels["route"], s.labels["status"]): s.value
        for s in requests.samples
        if s.name.endswith("_total")
    }
    assert by_status[("/v1/double", "200")] == 3
    assert by_status[("/v1/double", "422")] == 1
    # Each family once: its HELP and TYPE lines, then all its samples.
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(names) == len(set(names)) == len(TYPES)
    for name in names:
        assert f"# HELP {name} " in text


async def test_promtool_accepts_the_exposition(harness: Harness) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    text = await served_metrics(harness)
    check = [promtool, "check", "metrics"]
    done = await asyncio.to_thread(
        subprocess.run, check, input=text, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_large_counts_are_written_exactly() -> None:

    out = Exposition(STAGE_FAMILIES[:1])
    out.sample(STAGE_FAMILIES[0], 1234567.0, stage="s", outcome="ok")
    out.sample(STAGE_FAMILIES[0], 0.25, stage="s", outcome="error")
    text = out.text()
    assert 'outcome="ok"} 1234567\n' in text  # not 1.23457e+06
    assert 'outcome="error"} 0.25\n' in text
