"""Every ``CONVEYOR_*`` form the docs show, exactly as written there, starts what it configures.

The forms are read out of README.md and every page of docs/ (every ``CONVEYOR_X=value`` in a
code span or block), so a newly documented form is covered without touching this file. A
```` ```text ```` block is output (an error message quoting a refused value, a log line), not
a form to copy, and is not read.
Gateway forms start a real gateway process that must answer ``/readyz``; worker and
``conveyor up`` forms construct the settings class of each process that reads them.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any, get_origin

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from conveyor.autoscale import AutoscaleSettings
from conveyor.data import DataSettings
from conveyor.placement import PlacementSettings
from gateway.settings import GatewaySettings
from pipelines.builtin.wikisummary import WikiSettings
from pipelines.settings import CommonSettings
from runtime.logs import LogSettings
from tests.helpers import REPO as ROOT
from tests.helpers import GatewayProcess
from workers.settings import WorkerSettings

DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
SETTINGS: tuple[type[BaseSettings], ...] = (
    GatewaySettings,
    WorkerSettings,
    AutoscaleSettings,
    PlacementSettings,
    WikiSettings,
    CommonSettings,
    LogSettings,
    DataSettings,
)
CODE = re.compile(r"```([^\n]*)\n(.*?)```|`([^`\n]+)`", re.S)
ASSIGN = re.compile(r"\bCONVEYOR_[A-Z0-9_]+=")


def documented_forms(docs: tuple[Path, ...] = DOCS) -> list[tuple[str, str, str]]:
    """``(variable, value, where)`` for every assignment shown in a code span of the docs,
    the value unquoted the way a shell would."""
    forms: dict[tuple[str, str], str] = {}
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        for code in CODE.finditer(text):
            if code.group(1) is not None and code.group(1).strip() == "text":
                continue  # output, not a form
            snippet = code.group(2) or code.group(3)
            for line in snippet.splitlines():
                for hit in ASSIGN.finditer(line):
                    try:
                        word = shlex.split(line[hit.start() :])[0]
                    except ValueError:  # an unbalanced quote later on the line
                        word = line[hit.start() :].split()[0]
                    name, _, value = word.partition("=")
                    line_no = text.count("\n", 0, code.start()) + 1
                    forms.setdefault((name, value), f"{doc.name}:{line_no}")
    return [(name, value, where) for (name, value), where in sorted(forms.items())]


def readers(name: str) -> list[type[BaseSettings]]:
    """The settings classes that read ``name`` (most specific first)."""
    found = []
    for cls in SETTINGS:
        prefix = str(cls.model_config.get("env_prefix", ""))
        field = name.removeprefix(prefix).lower() if name.startswith(prefix) else None
        if field in cls.model_fields:
            found.append(cls)
    return found


FORMS = documented_forms()


def test_the_docs_show_the_forms_this_test_relies_on() -> None:
    # A broken parser would make every parametrized test below vanish silently.
    shown = {(name, value) for name, value, _ in FORMS}
    assert ("CONVEYOR_API_KEYS", "k1,k2") in shown
    assert ("CONVEYOR_MODELS", '{"generate": "/models/my-gpt2", "sentiment": "org/model"}') in shown


def test_an_output_block_is_not_read_as_forms(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```text\nconveyor: CONVEYOR_APP='mymodule' must look like 'module:attribute'\n```\n"
        "```bash\nCONVEYOR_LOG_LEVEL=debug conveyor up\n```\n`CONVEYOR_GPUS=4`\n",
        encoding="utf-8",
    )
    assert documented_forms((page,)) == [
        ("CONVEYOR_GPUS", "4", "page.md:7"),
        ("CONVEYOR_LOG_LEVEL", "debug", "page.md:4"),
    ]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``CONVEYOR_*`` from the test run leaks into a settings class built here."""
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("name", "value", "where"), FORMS, ids=[f"{n}={v}" for n, v, _ in FORMS])
@pytest.mark.usefixtures("clean_env")
def test_documented_form_is_accepted_by_every_process_that_reads_it(
    name: str, value: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    classes = readers(name)
    assert classes, f"{where}: {name} is documented but no settings class reads it"
    monkeypatch.setenv(name, value)
    for cls in classes:
        cls()  # raises, naming the setting, if the documented form is refused


def _gateway_rounds() -> list[dict[str, str]]:
    """The gateway's documented forms, grouped so no variable appears twice in a group."""
    rounds: list[dict[str, str]] = []
    for name, value, _ in FORMS:
        if GatewaySettings not in readers(name):
            continue
        for env in rounds:
            if name not in env:
                env[name] = value
                break
        else:
            rounds.append({name: value})
    return rounds


@pytest.mark.parametrize("documented", _gateway_rounds())
def test_gateway_process_starts_with_documented_forms(
    documented: dict[str, str], redis_url: str, tmp_path: Path
) -> None:
    with GatewayProcess(
        redis_url, tmp_path / "gateway.log", CONVEYOR_PIPELINES="echo", **documented
    ):
        pass  # ready: it started with these forms and answers /readyz


def _list_fields() -> list[tuple[type[BaseSettings], str]]:
    return [
        (cls, name)
        for cls in SETTINGS
        for name, field in cls.model_fields.items()
        if get_origin(field.annotation) is list
    ]


@pytest.mark.parametrize(
    ("cls", "field"), _list_fields(), ids=[f"{c.__name__}.{f}" for c, f in _list_fields()]
)
@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        ("k1", ["k1"]),
        ("k1,k2", ["k1", "k2"]),
        (" k1 , k2 ,", ["k1", "k2"]),
        ('["k1", "k2"]', ["k1", "k2"]),
    ],
)
@pytest.mark.usefixtures("clean_env")
def test_every_list_setting_takes_the_comma_form_and_json(
    cls: type[BaseSettings],
    field: str,
    raw: str,
    parsed: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = str(cls.model_config.get("env_prefix", ""))
    monkeypatch.setenv(f"{prefix}{field.upper()}", raw)
    settings: Any = cls()
    assert getattr(settings, field) == parsed


@pytest.mark.parametrize("raw", ["", " , ", "[]"])
@pytest.mark.usefixtures("clean_env")
def test_api_keys_set_but_empty_refuse_to_start(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # `CONVEYOR_API_KEYS=${API_KEYS}` with API_KEYS unset once turned authentication off.
    monkeypatch.setenv("CONVEYOR_API_KEYS", raw)
    with pytest.raises(ValidationError, match="holds no key"):
        GatewaySettings()
    monkeypatch.setenv("CONVEYOR_CORS_ORIGINS", raw)  # an empty origin list is just off
    monkeypatch.delenv("CONVEYOR_API_KEYS")
    assert GatewaySettings().cors_origins == []
