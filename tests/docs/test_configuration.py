"""The configuration page and the settings classes say the same thing.

Every field of every pydantic-settings class of conveyor (found in the source, so a class
added tomorrow is checked too) is a row of docs/configuration.md, and every ``CONVEYOR_*``
name that README.md, deploy/README.md or a page of docs/ mentions is one a settings class
reads (or one of the few names in ``NOT_SETTINGS``, each with its reason). A failure prints
the missing rows generated from the class: its variable, default and docstring, ready to
paste.

``python -m tests.docs.test_configuration`` prints the whole table that way.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from pipelines.settings import env_name
from tests.helpers import REPO

PACKAGES = ("conveyor", "gateway", "workers", "runtime", "pipelines")
PAGE = REPO / "docs" / "configuration.md"
PAGES = (REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").rglob("*.md")))
NAME = re.compile(r"\bCONVEYOR_[A-Z0-9_]*[A-Z0-9](_\*)?")

NOT_SETTINGS: dict[str, str] = {}
"""``CONVEYOR_*`` names the docs may use that no settings class reads, and why."""


def settings_classes() -> list[type[BaseSettings]]:
    """Every pydantic-settings class defined in conveyor's packages: each class whose
    bases end in ``Settings`` in the source, imported and checked."""
    found: dict[str, type[BaseSettings]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [
                node.name
                for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef)
                and any(ast.unparse(base).endswith("Settings") for base in node.bases)
            ]
            if not names:
                continue
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            loaded = importlib.import_module(module)
            for name in names:
                cls = getattr(loaded, name)
                if inspect.isclass(cls) and issubclass(cls, BaseSettings):
                    found[f"{module}.{name}"] = cls
    return [found[key] for key in sorted(found)]


def variables() -> dict[str, tuple[type[BaseSettings], str]]:
    """Each variable a settings class reads: the class that declares its field, and the
    field."""
    read: dict[str, tuple[type[BaseSettings], str]] = {}
    for cls in settings_classes():
        for field in cls.model_fields:
            owner = next(
                k
                for k in reversed(cls.__mro__)
                if field in getattr(k, "__annotations__", {}) and issubclass(k, BaseSettings)
            )
            for name in env_name(cls, field).split(" or "):
                read.setdefault(name, (owner, field))
    return read


def described(cls: type[BaseSettings], field: str) -> str:
    """The field's entry under ``Attributes:`` in the docstring of ``cls`` or a base."""
    for klass in cls.__mro__:
        doc = inspect.cleandoc(klass.__doc__ or "")
        entry = re.search(
            rf"^\s+{re.escape(field)}(?: \([^)]*\))?:(.*?)(?=^\s+\w+(?: \([^)]*\))?:|\Z|^\S)",
            doc.partition("Attributes:")[2],
            re.S | re.M,
        )
        if entry:
            return " ".join(entry[1].split())
    return ""


def row(name: str, cls: type[BaseSettings], field: str) -> str:
    """The table row of one variable, generated from its class."""
    info = cls.model_fields[field]
    if info.default_factory is not None:
        default = repr(info.default_factory())  # type: ignore[call-arg]
    elif info.default is PydanticUndefined or info.default is None:
        default = "unset"
    else:
        default = str(info.default)
    return f"| `{name}` | `{default}` | `{cls.__name__}` | {described(cls, field)} |"


def mentioned(pages: tuple[Path, ...] = PAGES, root: Path = REPO) -> dict[str, str]:
    """Each ``CONVEYOR_*`` name the pages mention (``CONVEYOR_X_*``: a family), and where
    first."""
    seen: dict[str, str] = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for hit in NAME.finditer(text):
            line = text.count("\n", 0, hit.start()) + 1
            seen.setdefault(hit[0], f"{page.relative_to(root)}:{line}")
    return seen


def test_every_setting_is_a_row_of_the_configuration_page() -> None:
    page = PAGE.read_text(encoding="utf-8")
    read = variables()
    assert len(read) > 50  # the walk found the classes
    missing = [
        row(name, *read[name])
        for name in sorted(read)
        if not re.search(rf"`{re.escape(name)}`", page)
    ]
    assert not missing, "docs/configuration.md lacks these settings:\n" + "\n".join(missing)


def test_every_conveyor_variable_the_docs_name_is_read_by_a_setting() -> None:
    read = variables()
    unknown = []
    for name, where in mentioned().items():
        if name.endswith("_*"):  # a family: CONVEYOR_AUTOSCALE_*
            if not any(known.startswith(name[:-1]) for known in read):
                unknown.append(f"{where}: {name} (no setting starts so)")
        elif name not in read and name not in NOT_SETTINGS:
            unknown.append(f"{where}: {name}")
    assert not unknown, "the docs name variables nothing reads:\n" + "\n".join(unknown)


def test_the_checks_catch_what_they_promise(tmp_path: Path) -> None:
    # The scan itself: a broken one would pass every page.
    page = tmp_path / "page.md"
    page.write_text("Set `CONVEYOR_NO_SUCH_THING=1` or the `CONVEYOR_AUTOSCALE_*` ones.\n")
    found = mentioned((page,), tmp_path)
    assert found == {"CONVEYOR_NO_SUCH_THING": "page.md:1", "CONVEYOR_AUTOSCALE_*": "page.md:1"}
    read = variables()
    assert "CONVEYOR_NO_SUCH_THING" not in read
    assert "CONVEYOR_REDIS_URL" in read
    assert "CONVEYOR_LOG_LEVEL" in read
    name, (cls, field) = "CONVEYOR_DATA_DIR", read["CONVEYOR_DATA_DIR"]
    assert row(name, cls, field).startswith("| `CONVEYOR_DATA_DIR` | `.conveyor` | `DataSettings`")
    assert "data folder" in described(cls, field)


if __name__ == "__main__":
    for var, (klass, name) in sorted(variables().items()):
        print(row(var, klass, name))
