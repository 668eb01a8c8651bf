"""What ``conveyor up`` hands every child in its environment."""

from __future__ import annotations

import pytest

from conveyor.stack import UpOptions, _child_env
from gateway.settings import GatewaySettings
from pipelines.settings import load_settings


def test_children_get_tokenizers_parallelism_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests' own conftest sets it; a user's shell usually does not.
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    env = _child_env(UpOptions(), load_settings(GatewaySettings))
    assert env["TOKENIZERS_PARALLELISM"] == "false"


def test_the_users_tokenizers_parallelism_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    env = _child_env(UpOptions(), load_settings(GatewaySettings))
    assert env["TOKENIZERS_PARALLELISM"] == "true"
