"""What every Hugging Face runner that calls ``generate`` shares: its base class (the
output bounded by ``max_new_tokens`` alone), the option range check, and the two hooks
``generate`` is handed between decoding steps: the deadline and the per-row streamer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import StoppingCriteria

from pipelines.model import check_deadline
from workers.models.hf_base import HFRunner


def check_range(name: str, value: int, low: int, high: tuple[str, int]) -> None:
    """Refuse option ``name`` outside ``[low, high]``, ``high`` being another option's
    (name, value), before any weights load."""
    if not low <= value <= high[1]:
        raise ValueError(f"{name} must be in [{low}, {high[0]}={high[1]}], got {value}")


class GenerateRunner(HFRunner):
    """A runner that calls ``generate``, its output bounded by ``max_new_tokens`` alone.

    Hub checkpoints often ship ``max_length``/``min_length`` in their generation config
    (distilbart: 142 and 56). ``generate`` gives ``max_new_tokens``/``min_new_tokens``
    precedence anyway, but logs two warnings per batch when both are set, so they are
    dropped at load.
    """

    def __init__(self, max_new_tokens: int, **load: Any) -> None:
        super().__init__(**load)
        self.max_new_tokens = max_new_tokens
        self.model.generation_config.max_length = None
        self.model.generation_config.min_length = None


class InTime(StoppingCriteria):
    """Between decoding steps: stop (raising) once every request of the batch is past its
    deadline (:func:`~pipelines.model.check_deadline`)."""

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        check_deadline()
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return done  # type: ignore[return-value]


class RowStreamer:
    """What ``generate(streamer=...)`` feeds: the prompt first, then each step's new token
    per row. Keeps every row's new ids, cut at its limit and first end-of-sequence."""

    def __init__(
        self, limits: list[int], eos_ids: set[int], on_tokens: Callable[[int, list[int]], None]
    ) -> None:
        self.limits = limits
        self.eos_ids = eos_ids
        self.on_tokens = on_tokens
        self.rows: list[list[int]] = [[] for _ in limits]
        self.done = [False] * len(limits)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        for index, token in enumerate(value.reshape(-1).tolist()):
            if self.done[index]:
                continue
            if token in self.eos_ids:
                self.done[index] = True
                continue
            self.rows[index].append(token)
            self.done[index] = len(self.rows[index]) >= self.limits[index]
            self.on_tokens(index, self.rows[index])

    def end(self) -> None:
        """Generation finished (nothing left to flush: rows are reported as they grow)."""
