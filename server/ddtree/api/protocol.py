"""The OpenAI wire format: request models (lenient where OpenAI's SDKs send extras, strict where a wrong value
would silently change the reply) and the error envelope every failure a client causes comes back in:
`{"error": {"message", "type", "param", "code"}}` with the right status code.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ddtree.core.sampling import MAX_TOP_LOGPROBS

MAX_LOGPROBS = MAX_TOP_LOGPROBS
MAX_CHOICES = 128  # OpenAI's limit on n




# --------------------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error to return as the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_UNION_TAGS = {"str", "int", "float", "bool", "ContentPart", "ChatMessage"}


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as an OpenAI 400 naming the first offending field."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"Invalid JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members show up as extra path parts (`stop.str`, `prompt.list[int]`): keep the field path.
    loc = [part for part in loc if part not in _UNION_TAGS and "[" not in part]
    param = ".".join(loc) or None
    if param is None and first.get("type") == "model_attributes_type":
        return bad_request("The request body must be a JSON object (sent with Content-Type: application/json).")
    message = first.get("msg", "invalid request")
    return bad_request(f"{param}: {message}" if param else message, param)


# --------------------------------------------------------------------------------------------------------
# Request schemas (unknown fields are tolerated and logged, as OpenAI clients send vendor extras)


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Tolerant):
    include_usage: bool = False


class ContentPart(_Tolerant):
    type: str
    text: str | None = None


class ChatMessage(_Tolerant):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None


class SamplingFields(_Tolerant):
    """Fields shared by chat and completions, OpenAI's plus vLLM's extensions (sent via `extra_body`)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM's, non-streaming
    user: str | None = None
    return_token_ids: bool = False
    return_spec_stats: bool = False
    # Structured outputs: OpenAI's `response_format` (vLLM takes it on completions too), vLLM's newer
    # `structured_outputs` object, or its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Tolerant):
    """vLLM's /tokenize: a completions `prompt` or chat `messages` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as the chat endpoint renders them (tool_choice too)
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(_Tolerant):
    model: str | None = None
    tokens: list[int]


