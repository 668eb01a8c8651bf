"""The exceptions conveyor raises; the gateway maps them to HTTP statuses in one place."""

from __future__ import annotations


class ConveyorError(Exception):
    """Base of every conveyor error; its message says what to do about it.

    Args:
        message: what happened and what to do.
        request_id: the request it concerns, when there is one.
    """

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class ConfigError(ConveyorError):
    """A setting, stage or model spec is wrong; the message names it."""


class UnknownStage(ConfigError):
    """No stage of that name is defined."""


class EnvelopeError(ConveyorError):
    """A stream entry is not a valid conveyor envelope (bad JSON, version or fields)."""


class BatchContractError(ConveyorError):
    """A model returned a number of results different from the number of items."""


class Overloaded(ConveyorError):
    """A stage's backlog is over its bound; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(ConveyorError):
    """Redis cannot be reached; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(ConveyorError):
    """The request's deadline passed before a result arrived."""


class ItemFailed(ConveyorError):
    """The model failed on this item; the rest of its batch was unaffected."""
