"""A stage's runner, resolved from its import path."""

from __future__ import annotations

import pytest

from pipelines.errors import ConfigError
from pipelines.stages import BUILTIN, Stage, TextIn


def test_every_builtin_runner_resolves_under_both_profiles() -> None:
    for stage in BUILTIN.values():
        assert callable(stage.factory("offline"))
        assert callable(stage.factory("hub"))


@pytest.mark.parametrize(
    ("old", "new"),
    [("workers.hf:Embedder", "workers.models.hf"), ("workers.runners:Echo", "workers.models.toy")],
)
def test_a_runner_at_its_old_path_is_refused_saying_where_it_went(old: str, new: str) -> None:
    stage = Stage("legacy", TextIn, old)
    with pytest.raises(ConfigError, match=f"cannot import runner '{old}'.*moved to {new}"):
        stage.factory()
