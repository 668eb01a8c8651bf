"""A runner is offered a device it can use: ``auto`` is resolved before a user's class
sees it (torch knows no ``auto``: ``.to("auto")`` raises)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch
from pydantic import BaseModel

from pipelines.model import Item, Result
from pipelines.stages import Stage
from workers.build import build_model
from workers.settings import WorkerSettings
from workers.threads import runner_device


class Text(BaseModel):
    """Input of the stage."""

    text: str


class MovesATensor:
    """A user's model that does what a torch tutorial does with its device."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.bias = torch.zeros(1).to(device)

    def predict(self, items: list[Item]) -> list[Result]:
        """The device, for each item."""
        return [{"device": str(self.bias.device)} for _ in items]


def test_a_user_class_moving_a_tensor_loads_with_device_auto() -> None:
    stage = Stage("moves", Text, MovesATensor)
    model: Any = build_model(stage, WorkerSettings(device="auto"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.device == expected
    assert model.predict([{"text": "x"}]) == [{"device": str(model.bias.device)}]


def test_a_named_device_is_given_as_named() -> None:
    stage = Stage("moves", Text, MovesATensor)
    model: Any = build_model(stage, WorkerSettings(device="cpu"))
    assert model.device == "cpu"


def test_a_runner_taking_only_options_is_told_auto_only_once_torch_is_loaded() -> None:
    # torch is loaded in this process: a toy taking **options hears where it runs too.
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert runner_device("auto", load_torch=False) == expected
    assert runner_device("cuda:1", load_torch=False) == "cuda:1"


def test_a_framework_free_runner_does_not_load_torch() -> None:
    # A fresh process: the toy runner (it takes **options) is built without torch.
    code = "; ".join(
        [
            "import sys",
            "from pipelines.builtin import ADDER",
            "from workers.build import build_model",
            "from workers.settings import WorkerSettings",
            "build_model(ADDER, WorkerSettings(device='auto'))",
            "print('torch' in sys.modules)",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
