"""The OpenAI-compatible routes' request bodies, and how their fields are read.

``temperature``, ``top_p``, ``seed`` and ``stop`` are the generate stage's own; ``n``
asks for that many requests. Fields OpenAI
defines that do not change what is answered (``user``, penalties) are ignored, so
clients that send them by default still work; those that would change
the answer's shape are refused by :func:`unsupported`, naming them.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from gateway.routes.openai.errors import Refused
from pipelines.stages import OpenAIKind

MAX_INPUTS = 2048
"""The most texts one embeddings (or prompts one completions) request may hold, as OpenAI."""
DEFAULT_MAX_TOKENS = 16
"""A completion's ``max_tokens`` when the request gives none (OpenAI's default)."""
MAX_CHOICES = 8
"""The most choices (``n``) one completion may ask for: each is a request of its own."""


class ModelIn(BaseModel):
    """A request to one of these routes: the ``model`` it asks for."""

    model_config = ConfigDict(extra="ignore")
    kind: ClassVar[OpenAIKind]
    """The marker of the stages whose pipelines serve this request."""

    model: str = Field(min_length=1, max_length=200, description="A pipeline's name.")


_TEXTS = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2048},
        ],
        "description": "A text, or a list of texts (token arrays are refused, 400).",
    }
)
Texts = Annotated[Any, _TEXTS]
"""A text or a list of texts; read by :func:`texts`, which refuses anything else with a
400 that says so (a token array included), rather than pydantic's union errors."""


class EmbeddingsIn(ModelIn):
    """``POST /v1/embeddings``."""

    kind = "embeddings"
    input: Texts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=1_000_000)


class _Decoding(BaseModel):
    """The decoding options a completions and a chat completions request share. Each
    request's model names it as its first base: pydantic lists the fields of the last
    base first, so these follow the request's own input, in OpenAI's order."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class _Prompt(ModelIn):
    kind = "completions"
    prompt: Texts
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)


class CompletionsIn(_Decoding, _Prompt):
    """``POST /v1/completions``."""

    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None


class ChatContent(BaseModel):
    """One part of a message's content (only text parts are taken)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="ignore")
    role: str = Field(min_length=1, max_length=40)
    content: str | list[ChatContent] | None = None


class _Chat(ModelIn):
    kind = "completions"
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)


class ChatIn(_Decoding, _Chat):
    """``POST /v1/chat/completions``."""

    logprobs: bool | None = None
    # Tool calling is not served; these are read only to be refused, by name.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


def texts(value: Any, param: str) -> list[str]:
    """``value`` (a :data:`Texts` field named ``param``) as a list of texts.

    Raises:
        Refused: it is not a string or a non-empty list of strings (an object too: its
            keys are no texts), or holds more than :data:`MAX_INPUTS`.
    """
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise Refused(
            f"{param} must be a string or a non-empty list of strings "
            "(token arrays are not supported)",
            400,
            param,
        )
    if len(items) > MAX_INPUTS:
        raise Refused(f"{param} holds {len(items)} items; at most {MAX_INPUTS}", 400, param)
    return [str(v) for v in items]


def content(message: ChatMessageIn, index: int) -> str:
    """The text of ``message`` (the ``index``-th): its string, or its text parts joined.

    Raises:
        Refused: a part is not text.
    """
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise Refused(f"messages[{index}]: only text content is supported", 400, "messages")
        parts.append(part.text)
    return "".join(parts)


def unsupported(**fields: bool) -> None:
    """Refuse the first of ``fields`` that was given (True): an option not served here.

    Raises:
        Refused: naming it.
    """
    for name, given in fields.items():
        if given:
            raise Refused(f"{name} is not supported by this server", 400, name)


def wants_usage(options: dict[str, Any] | None) -> bool:
    """Whether a stream's ``stream_options`` ask for a last chunk with the usage."""
    return bool(options and options.get("include_usage") is True)
