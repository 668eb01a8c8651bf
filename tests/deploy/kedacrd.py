"""KEDA objects checked against KEDA's own CRD schema (issue 29, item 6).

kubernetes-validate ships the core kinds only. KEDA's schema comes from the npm registry at
install time: ``@kubernetes-models/keda`` is KEDA's release CRDs (their ``openAPIV3Schema``)
compiled into validators, pinned with its dependencies by ``tests/deploy/keda/package-lock.json``
and installed by ``make keda-crd`` (``make test`` runs it where npm is). Nothing of the schema is
kept in this repository. ``tests/deploy/keda/validate.cjs`` runs it under node.

What a CRD schema checks: required fields (a trigger's ``type`` and ``metadata``, the
``scaleTargetRef``'s ``name``, a ``secretTargetRef``'s ``parameter``/``name``/``key``), types
(trigger metadata values are strings, replica counts integers) and the ``apiVersion``/``kind``.
It does not reject a field it does not know (the schema has no ``additionalProperties``: the
API server drops such a field, or refuses it under kubectl's strict field validation), so the
structural test in ``test_deploy`` still names the fields we may write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

KEDA_DIR = Path(__file__).with_name("keda")
PACKAGE = "@kubernetes-models/keda"


def _unavailable() -> str | None:
    """Why KEDA's CRD schema cannot be used here, or None when it can."""
    if shutil.which("node") is None:
        return "node is not installed (apt-get install nodejs npm, then `make keda-crd`)"
    wanted = json.loads((KEDA_DIR / "package.json").read_text())["dependencies"][PACKAGE]
    installed = KEDA_DIR / "node_modules" / PACKAGE / "package.json"
    if not installed.is_file():
        return f"KEDA's CRD schema is not installed: run `make keda-crd` ({PACKAGE} {wanted})"
    have = json.loads(installed.read_text())["version"]
    if have != wanted:
        return f"{PACKAGE} {have} is installed, package.json pins {wanted}: run `make keda-crd`"
    return None


def require_keda_crd() -> None:
    """Skip the calling test where KEDA's CRD schema is not installed; on CI (``CI`` set),
    which installs node and the schema (.ci/run, the Makefile), fail instead of skipping."""
    reason = _unavailable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must check KEDA objects against KEDA's CRD schema: {reason}")
    pytest.skip(reason)


def crd_problems(docs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """For each of ``docs`` (KEDA manifests), what KEDA's CRD schema rejects in it."""
    require_keda_crd()
    done = subprocess.run(
        ["node", "validate.cjs"],
        cwd=KEDA_DIR,
        input=json.dumps(list(docs)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: list[list[str]] = json.loads(done.stdout)
    assert len(result) == len(docs)
    return result


def assert_match_keda_crd(docs: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Fail naming every ``(where, manifest)`` of ``docs`` that KEDA's CRD schema rejects."""
    problems = crd_problems([doc for _, doc in docs])
    bad = [
        f"{where} {doc['kind']}/{doc['metadata']['name']}: {'; '.join(found)}"
        for (where, doc), found in zip(docs, problems, strict=True)
        if found
    ]
    assert bad == [], "\n".join(bad)
