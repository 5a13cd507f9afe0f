"""Request bodies of the OpenAI-compatible endpoints, validated strictly (a string where a
number belongs is a 400, not a guess), and the OpenAI-style error they turn into."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"}


class ApiError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)
    # accepted for compatibility only at their neutral values
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ApiError(400, f"a stop string may have at most {MAX_STOP_LENGTH} characters", "stop")
        return tuple(s for s in stops if s)

    def check_supported(self) -> None:
        self.stop_strings()  # cheap: checked before the prompt is tokenised
        if (self.n or 1) != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Sampling):
    PROMPT_FIELD: ClassVar[str] = "prompt"
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported", name)
        if (self.best_of or 1) != 1:
            raise ApiError(400, "only best_of=1 is supported", "best_of")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"one prompt per request is supported, got {len(p)}", "prompt")
            p = p[0]
        if len(p) == 0:
            raise ApiError(400, "the prompt is empty", "prompt")
        return p


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    PROMPT_FIELD: ClassVar[str] = "messages"
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", "messages")
        if self.logprobs:
            raise ApiError(400, "logprobs is not supported", "logprobs")
        if self.tools:
            raise ApiError(400, "tools are not supported", "tools")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_chars(self) -> int:
        """Characters of all the messages' text: known before tokenising."""
        return sum(len(m.as_dict()["content"]) for m in self.messages)


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """Validate a JSON body, or raise a 400 ApiError naming the first bad field."""
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        raise _as_api_error(e) from None
    req.check_supported()
    return req


def _as_api_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}")
    path = []
    for part in err["loc"]:
        if isinstance(part, str) and (part.split("[")[0] in _TYPE_NAMES or not part.isidentifier()):
            break  # a union member's name, not a field
        path.append(str(part))
    param = ".".join(path) or None
    if err["type"] == "missing":
        return ApiError(400, f"'{param}' is required", param)
    where = f"'{param}': " if param else "the body: "
    return ApiError(400, where + err["msg"], param)
