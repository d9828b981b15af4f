"""Request bodies: bytes → typed, frozen request objects, or a 400 naming the field. Pure.

Validation is strict the way the OpenAI API is: a string where an integer belongs, an unknown
field, an empty `messages` array or a negative `max_tokens` is refused before anything else runs,
with the field in the error's `param`. Body size and UTF-8 are checked on the raw bytes first, so a
huge or undecodable body never reaches the JSON parser. Known OpenAI fields Sluice does not serve
(tools, logprobs, ...) are refused by name rather than ignored: a caller relying on them must know.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sluice.services.edge.errors import (
    BODY_NOT_JSON,
    BODY_NOT_UTF8,
    CONFLICTING_ARGUMENTS,
    INVALID_ARGUMENT,
    MISSING_ARGUMENT,
    UNRECOGNIZED_ARGUMENT,
    UNSUPPORTED_ARGUMENT,
    InvalidField,
)
from sluice.services.errors import FIELD_HAS_NUL

SEED_MAX = 2**64 - 1             # SamplingParams.seed is uint64
PositiveInt = Annotated[int, Field(ge=1, le=2**31 - 1)]   # output caps travel as int32
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None

# OpenAI request fields Sluice refuses by name (a caller relying on them must not be ignored).
UNSUPPORTED = {
    "tools": "tool calling is not served", "tool_choice": "tool calling is not served",
    "functions": "tool calling is not served", "function_call": "tool calling is not served",
    "parallel_tool_calls": "tool calling is not served",
    "logprobs": "log probabilities are not returned", "top_logprobs": "log probabilities are not returned",
    "response_format": "structured output is not served", "text": "structured output is not served",
    "logit_bias": "logit bias is not applied", "frequency_penalty": "penalties are not applied",
    "presence_penalty": "penalties are not applied", "best_of": "only one completion is made",
    "echo": "the prompt is not echoed", "suffix": "insertion is not served",
    "audio": "audio is not served", "modalities": "only text is served",
    "reasoning": "reasoning options are not served", "previous_response_id": "conversations are not stored",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --- seed 002: POST /v1/inference -----------------------------------------------------------------


class SamplingBody(_Strict):
    temperature: Temperature = 0.0
    topP: TopP = 0.0
    seed: Seed = 0


class FallbackBody(_Strict):
    """Narrows the fallback the tenant's administrator permits (never widens it), as Submit's
    FallbackRequest: `refuse`, or only these models / conditions (empty: all permitted)."""

    refuse: bool = False
    models: list[str] = []
    conditions: list[Literal["backlog", "deadline"]] = []


class InferenceBody(_Strict):
    model: str
    input: str
    maxOutputTokens: PositiveInt
    requestKey: str | None = None            # or the Idempotency-Key header
    deadline: dt.datetime | None = None      # absolute (RFC 3339), as the seed's run.deadline
    deadlineMs: Annotated[int, Field(ge=1)] | None = None   # or relative, ms from now
    sampling: SamplingBody = SamplingBody()
    conversationId: str | None = None
    priority: Literal["interactive", "batch"] = "interactive"   # batch: the tenant must be permitted it
    fallback: FallbackBody = FallbackBody()


# --- OpenAI: chat completions, completions, responses --------------------------------------------


class TextPart(_Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart]
    name: str | None = None
    type: Literal["message"] | None = None   # Responses input items may say so


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampled(_Strict):
    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatBody(_Sampled):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None


class CompletionBody(_Sampled):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: PositiveInt = 16             # the OpenAI default for completions


class ResponsesBody(_Strict):
    model: str
    input: str | Annotated[list[ChatMessage], Field(min_length=1)]
    instructions: str | None = None
    background: bool = False
    stream: bool = False
    store: bool = True
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


# --- parsing ------------------------------------------------------------------------------------

B = TypeVar("B", bound=_Strict)


def parse_body(raw: bytes, model: type[B]) -> B:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidField(BODY_NOT_UTF8.format(position=error.start), None) from None
    try:
        body = model.model_validate_json(text)
    except ValidationError as error:
        raise _field_error(error.errors(include_url=False)[0]) from None
    if "\\u0000" in text:                  # JSON's only way to carry a NUL; PostgreSQL text holds none
        _refuse_nul(body.model_dump(by_alias=True, exclude_none=True), "")
    return body


def _refuse_nul(value: object, path: str) -> None:
    """Refuse the first string holding a NUL, naming its field as the gRPC door does."""
    if isinstance(value, str):
        if (position := value.find("\x00")) >= 0:
            raise InvalidField(FIELD_HAS_NUL.format(field=path, position=position), path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_nul(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_nul(item, f"{path}[{index}]")


def output_cap(body: ChatBody) -> int | None:
    """`max_tokens` or `max_completion_tokens` (the newer name); both must agree if both are sent."""
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise InvalidField(CONFLICTING_ARGUMENTS.format(first="max_tokens", second="max_completion_tokens"),
                           "max_completion_tokens")
    return body.max_tokens if body.max_tokens is not None else body.max_completion_tokens


def stop_strings(stop: Stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content', 'str') → 'messages[0].content' (union branch tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.lower() not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out


def _field_error(error: Any) -> InvalidField:
    kind, loc = error["type"], tuple(error["loc"])
    param = _param(loc)
    if kind == "json_invalid":
        return InvalidField(BODY_NOT_JSON.format(detail=error["msg"].removeprefix("Invalid JSON: ")), None)
    if kind == "extra_forbidden":
        field = str(loc[-1])
        if len(loc) == 1 and field in UNSUPPORTED:
            return InvalidField(UNSUPPORTED_ARGUMENT.format(param=field, why=UNSUPPORTED[field]), field)
        return InvalidField(UNRECOGNIZED_ARGUMENT.format(param=param), param)
    if kind == "missing":
        return InvalidField(MISSING_ARGUMENT.format(param=param), param)
    if kind == "model_type" and not loc:
        return InvalidField(BODY_NOT_JSON.format(detail="the body is not a JSON object"), None)
    detail = error["msg"][0].lower() + error["msg"][1:]
    return InvalidField(INVALID_ARGUMENT.format(param=param, detail=detail), param or None)
