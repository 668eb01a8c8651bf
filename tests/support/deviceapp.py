"""A stage whose model says it runs where its device setting says, without touching the
device (``CONVEYOR_APP=tests.support.deviceapp:pipelines``): a worker on ``cuda`` is simulated on a
host without a GPU, to see the threads it chooses (:mod:`workers.threads`)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from pipelines.graph import Pipeline, single
from pipelines.model import Item, Result
from pipelines.stages import Stage


class Anything(BaseModel):
    """Input of the stage: any fields."""

    model_config = ConfigDict(extra="allow")


class OnDevice:
    """Answers each item with the torch threads of its process and its device; its
    ``device`` is the setting as given (``cuda`` needs no GPU to be named).

    Args:
        device: ``auto`` (as ``cpu`` here), ``cpu``, ``cuda`` or ``cuda:N``.
        options: the other runner arguments, unused.
    """

    def __init__(self, *, device: str = "auto", **options: Any) -> None:
        del options
        self.device = torch.device("cpu" if device == "auto" else device)

    def predict(self, items: list[Item]) -> list[Result]:
        """The threads and device, for each item."""
        return [{"threads": torch.get_num_threads(), "device": str(self.device)} for _ in items]


ON_DEVICE = Stage("ondevice", Anything, "tests.support.deviceapp:OnDevice", max_batch_size=4)

pipelines: list[Pipeline] = [single(ON_DEVICE)]
