"""The documentation site builds: ``mkdocs build --strict`` (Material theme, the API
reference generated from the docstrings by mkdocstrings), offline, as CI runs it. A page
missing from the nav or a nav entry missing from docs/, a broken link between pages, or a
``::: module`` that does not resolve fails the build."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

SPHINX_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj|py:\w+):(?:`|<code>)")
"""A Sphinx role (``:class:`Stage```) left in a docstring: mkdocstrings renders it as
text, so a docstring names what it links with ``[`Stage`][]`` (resolved from where it
is written, ``scoped_crossrefs``) or ``[`Stage`][pipelines.stages.Stage]``."""


def test_the_docs_site_builds_strict_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    # The API reference is generated from the docstrings, not written by hand.
    reference = (site / "reference" / "authoring" / "index.html").read_text()
    assert "The one-step pipeline that serves" in reference  # pipelines.graph.single
    client = (site / "reference" / "client" / "index.html").read_text()
    assert "AsyncClient" in client
    assert (site / "status.png").exists()
    # Cross-references render as links, never as the raw role text (on any page).
    for page in sorted(site.rglob("*.html")):
        raw = SPHINX_ROLE.findall(page.read_text())
        assert not raw, f"{page.relative_to(site)}: {len(raw)} raw Sphinx role(s), e.g. {raw[0]}"
    assert 'href="#pipelines.stages.Stage"' in reference
    assert 'href="#conveyor.client.Client.submit"' in client
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for cls in ("CommonSettings", "WorkerSettings", "DataSettings", "LogSettings"):
        assert re.search(rf'id="[\w.]+\.{cls}"', settings), cls  # each class rendered
