"""Every name ``conveyor deploy`` derives from a stage: compose services, Kubernetes objects
and their labels, manifest files, KEDA trigger names.

Kubernetes takes a worker's name as a DNS-1123 label (at most 63 characters of ``a-z``,
``0-9`` and ``-``, alphanumeric at both ends), and stage names may hold ``_`` and ``.`` and
run to 101 characters. So a name is read from the stage's, each run of other characters made
one ``-``; where that would be too long, or another worker would get the same name
(``a_b``, ``a-b`` and ``a.b`` all read ``a-b``), it becomes a prefix of it and a hash of the
full stage name. A name depends only on the stages deployed, never on their order or the run.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Collection, Mapping

from pipelines.errors import ConfigError

LABEL_MAX = 63
"""Kubernetes's limit on a DNS-1123 label (a Service's or a label value's length)."""

WORKER = "worker-"
"""Every worker's name starts so: compose services and Kubernetes objects alike."""

VARIANT = "-gpu"
"""What a GPU copy of a worker adds to its name."""

BASE_MAX = LABEL_MAX - len(WORKER) - len(VARIANT)
"""The longest name of its own a worker takes: ``worker-<base>-gpu`` still fits a label."""

HASH_CHARS = 8
"""Hex digits of the stage name's SHA-256 a hashed name ends with."""


def functions_key(pipeline: str) -> str:
    """What names the worker of ``pipeline``'s function stages (no stage is called so)."""
    return f"{pipeline}.*"


def readable(name: str) -> str:
    """``name`` in a label's characters: lower case, each run of others one ``-``, no ``-``
    at either end (may be empty, or longer than a label)."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def hashed(key: str, text: str) -> str:
    """A prefix of ``readable(text)`` and the first :data:`HASH_CHARS` hex digits of
    ``key``'s SHA-256, within :data:`BASE_MAX` characters."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:HASH_CHARS]
    prefix = readable(text)[: BASE_MAX - HASH_CHARS - 1].rstrip("-")
    return f"{prefix}-{digest}" if prefix else digest


def _what(key: str) -> str:
    if key.endswith(".*"):
        return f"the function stages of pipeline {key.removesuffix('.*')!r}"
    return f"stage {key!r}"


def assign(
    wanted: Mapping[str, str], variants: Collection[str] = (), *, prefix: str = WORKER
) -> dict[str, str]:
    """A unique name for each key of ``wanted``, read from its text.

    The text read (:func:`readable`) is the name, unless it is empty, longer than
    :data:`BASE_MAX`, or wanted by another key too and not the key's text itself (``a-b``
    keeps ``a-b`` beside ``a_b``): then the name is :func:`hashed`. A key of ``variants``
    also wants its name plus :data:`VARIANT`.

    Args:
        wanted: each key (a stage's full name, or :func:`functions_key`) -> the text its
            name is read from (the key, or a function stage's step name for a trigger).
        variants: keys whose worker has a GPU copy.
        prefix: what the names are used after (in the error).

    Raises:
        ConfigError: two keys would still get one name (a stage called as another's hashed
            name): one line naming both.
    """
    plain = {key: readable(text) for key, text in wanted.items()}
    wants = Counter(plain.values()) + Counter(plain[k] + VARIANT for k in variants)
    names: dict[str, str] = {}
    for key, text in wanted.items():
        mine = plain[key]
        shared = wants[mine] > 1 and mine != text
        shared |= key in variants and wants[mine + VARIANT] > 1
        names[key] = hashed(key, text) if shared or not mine or len(mine) > BASE_MAX else mine
    taken: dict[str, str] = {}
    for name, what in [
        *((names[k], _what(k)) for k in wanted),
        *((names[k] + VARIANT, f"the GPU copy of {_what(k)}") for k in variants),
    ]:
        other = taken.setdefault(name, what)
        if other != what:
            raise ConfigError(f"{other} and {what} would both be named {prefix}{name}: rename one")
    return names
