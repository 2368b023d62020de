"""The OpenAI wire format: request models (lenient where OpenAI's SDKs send extras, strict where OpenAI is:
types without coercion, required fields) and the error envelope every failure a client causes comes back in:
`{"error": {"message", "type", "param", "code"}}` with the right status code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddtree.core.sampling import MAX_TOP_LOGPROBS

M = TypeVar("M", bound=BaseModel)
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


# What a field takes, by pydantic's error type and by the union member a value failed to be.
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
             "int_from_float": "an integer", "float_type": "a number", "float_parsing": "a number",
             "bool_type": "a boolean (true or false)", "bool_parsing": "a boolean (true or false)",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object", "finite_number": "a finite number"}
_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
            "list[str]": "an array of strings", "list[int]": "an array of token ids",
            "list[list[int]]": "an array of arrays of token ids", "list[ContentPart]": "an array of content parts",
            "dict[str,any]": "an object"}


def _described(value: Any) -> str:
    """A value as the message names it: its JSON type, short scalars themselves (never a long text back)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return json.dumps(value) if math.isfinite(value) else str(value).replace("inf", "Infinity").replace(
            "nan", "NaN")
    if isinstance(value, str):
        return json.dumps(value) if len(value) <= 32 else "a string"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def validation_error(errors: Sequence[Any]) -> APIError:
    """pydantic's errors as one OpenAI 400 naming the first offending field (`param`) and what it takes."""
    first = errors[0]
    loc = [str(part) for part in first["loc"] if part != "body"]
    member = next((i for i, part in enumerate(loc) if part in _MEMBERS), None)
    if member is not None:  # a union field: say every shape it takes
        base = loc[:member]
        shapes = dict.fromkeys(_MEMBERS[str(e["loc"][member])] for e in errors
                               if [str(p) for p in e["loc"][:member]] == base and len(e["loc"]) > member
                               and str(e["loc"][member]) in _MEMBERS)
        param = ".".join(base)
        got = f", got {_described(first['input'])}" if len(loc) == member + 1 else ""
        return bad_request(f"{param} must be {' or '.join(shapes)}{got}.", param)
    param = ".".join(loc) or None
    kind = first["type"]
    if param is None:
        return bad_request("The request body must be a JSON object (sent with Content-Type: application/json).")
    if kind == "missing":
        return bad_request(f"{param} is required.", param)
    if kind in _EXPECTED:
        return bad_request(f"{param} must be {_EXPECTED[kind]}, got {_described(first['input'])}.", param)
    return bad_request(f"{param}: {first['msg']}.", param)


def parse_body(model: type[M], raw: bytes) -> M:
    """A request body (JSON bytes) as `model`, or the 400 that says what is wrong with it."""
    return validate_body(model, load_json(raw))


def load_json(raw: bytes) -> Any:
    """The parsed body; a 400 for one that is empty, not JSON, nested too deeply to parse, or holds text that is
    not Unicode."""
    if not raw.strip():
        raise bad_request("The request body is empty: send a JSON object (with Content-Type: application/json).")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise bad_request(f"Invalid JSON body: {exc.msg} (line {exc.lineno}, column {exc.colno}).") from None
    except UnicodeDecodeError:
        raise bad_request("Invalid JSON body: it is not UTF-8 text.") from None
    except RecursionError:  # the parser recurses per level of arrays and objects: nothing a client needs is this deep
        raise bad_request("Invalid JSON body: its arrays and objects are nested too deeply.") from None
    if _SURROGATE_ESCAPE.search(raw):  # JSON's \uXXXX escapes are the only way to send a lone one
        _refuse_lone_surrogates(data, [])
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any, path: list[str]) -> None:
    """A 400 naming the first string (or key) holding half a UTF-16 surrogate pair: no text the tokenizer or
    a reply could carry."""
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path)
            _refuse_lone_surrogates(item, [*path, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_lone_surrogates(item, [*path, str(index)])
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            param = ".".join(path) or None
            raise bad_request(f"{param or 'The body'} holds a lone UTF-16 surrogate ({ascii(value[exc.start])[1:-1]}), "
                              "which is not Unicode text.", param) from None


def validate_body(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False, include_context=False)) from None


# --------------------------------------------------------------------------------------------------------
# Request schemas


class _Tolerant(BaseModel):
    """Unknown fields are tolerated (and logged): OpenAI clients send vendor extras. Known ones are typed as
    strictly as OpenAI types them: `true` is no 1, `"yes"` no boolean, 1.5 no integer, NaN no number."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


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

    model: str
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
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's: only equal salts share cached prefixes
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


