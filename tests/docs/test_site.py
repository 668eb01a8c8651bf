"""The documentation site builds: ``mkdocs build --strict`` (Material theme, the API
reference generated from the docstrings by mkdocstrings), offline, as CI runs it. A page
missing from the nav or a nav entry missing from docs/, a broken link between pages, or a
``::: module`` that does not resolve fails the build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


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
