"""The OpenAI API's shapes, shared by the gateway (`coral.runtime`) and the engines (`coral.runtime.emulated`,
`coral.engine.server`): request models that validate (chat) completions requests, the answer and SSE chunk
bodies, the error body, and the bearer-token rule.

Requests are validated by pydantic models of OpenAI's request schema with the vLLM extensions the engines read
(`min_tokens`, `top_k`, `ignore_eos`, `return_token_ids`, ...): wrong types and out-of-range numbers are refused
with the field named (`InvalidRequest`); fields no model lists pass through untouched, as vLLM accepts them.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

MAX_TOKENS = 1 << 20
"""Largest `max_tokens` accepted (no served model has a longer context)."""
MAX_N = 128
MAX_LOGPROBS = 20
"""vLLM's default `--max-logprobs`."""

Number = StrictInt | StrictFloat


def _one_of(what: str) -> WrapValidator:
    """A union refused with one message naming what it accepts (not one error per union member)."""

    def wrap(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", "must be {what}", {"what": what}) from None

    return WrapValidator(wrap)


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Prompt = Annotated[
    StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)],
    _one_of("a string, an array of strings, an array of token ids or an array of arrays of token ids"),
]
Stop = Annotated[
    StrictStr | Annotated[list[StrictStr], Field(max_length=64)] | None,
    _one_of("a string or an array of at most 64 strings"),
]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextPart(_Shape):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Shape):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Shape):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Shape):
    data: StrictStr
    format: Literal["wav", "mp3"]


class AudioPart(_Shape):
    type: Literal["input_audio"]
    input_audio: InputAudio


class RefusalPart(_Shape):
    type: Literal["refusal"]
    refusal: StrictStr


ContentPart = Annotated[TextPart | ImagePart | AudioPart | RefusalPart, Discriminator("type")]
Content = Annotated[
    StrictStr | list[ContentPart] | None,
    _one_of("a string or an array of content parts (text, image_url, input_audio, refusal)"),
]


class Message(_Shape):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Content = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(_Shape):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Sampling(_Shape):
    """Fields of both endpoints."""

    model: StrictStr = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    min_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_TOKENS)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=None, ge=0, le=1)
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(default=None, gt=0, le=2)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stop: Stop = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=300)
    user: StrictStr | None = Field(default=None, max_length=256)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = None
    return_token_ids: StrictBool | None = None
    kv_transfer_params: None = Field(default=None, description="set by the gateway, never by clients")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "only allowed when 'stream' is true")
        return value


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class InvalidRequest(ValueError):
    """A request OpenAI's schema refuses; `param` names the field (`messages[0].role`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _param(loc: tuple[int | str, ...]) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def parse_request(body: Any, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """`body` (parsed JSON) as a validated request; InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    schema: type[CompletionRequest | ChatCompletionRequest] = ChatCompletionRequest if chat else CompletionRequest
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        param = _param(err["loc"])
        if err["type"] == "missing":
            raise InvalidRequest(f"'{param}' is required", param) from None
        msg = err["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"'{param}': {msg}" if param else msg, param) from None


def max_tokens_of(body: dict[str, Any]) -> int:
    n = body.get("max_completion_tokens", body.get("max_tokens", 16))
    return max(1, int(n if n is not None else 16))


def usage(n_prompt: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def chunk(chat: bool, rid: str, model: str, text: str, finish: str | None, first: bool, index: int = 0,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SSE chunk of a streamed (chat) completion: choice `index`'s new text (`first`: its first chunk)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        obj = "chat.completion.chunk"
    else:
        choice["text"], choice["logprobs"], obj = text, logprobs, "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def choice_body(chat: bool, index: int, text: str, finish: str | None = "length",
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a non-streamed (chat) completion."""
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def full(chat: bool, rid: str, model: str, text: str, n_prompt: int, n_out: int,
         choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole answer of a non-streamed (chat) completion: one choice of `text`, or `choices`."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices if choices is not None else [choice_body(chat, 0, text)],
        "usage": usage(n_prompt, n_out),
    }


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (server_error for 5xx, invalid_request_error for other 4xx)."""
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer TOKEN` header value (the scheme in any case, one space, a token
    without whitespace: RFC 6750's form), else ''."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        return ""
    return token


def bearer_allowed(authorization: str, expected: str | None) -> bool:
    """Whether an `Authorization` header value bears the token `expected` (compared in constant time); any value
    does when `expected` is None (an engine without a token)."""
    if expected is None:
        return True
    return hmac.compare_digest(bearer_token(authorization).encode(), expected.encode())
