"""Request body -> engine work (ServerState.prepare: a small body on the event loop, a larger one in the worker
pool): the body parsed, cheap bounds first (a prompt that cannot fit the context is refused before it is validated
element by element or tokenized), prompt ids (chat template or completions prompt), sampling parameters merged with the
defaults, stop strings, and the grammar a structured reply or a forced tool call decodes under. Every way a
request can be wrong is a 400 here, before it reaches the engine's worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from ddtree.api.config import NEUTRAL_SAMPLING, merged_sampling
from ddtree.api.parsers.reasoning import CLOSE as REASONING_CLOSE
from ddtree.api.parsers.reasoning import OPEN as REASONING_OPEN
from ddtree.api.parsers.tools import START as TOOL_CALL_START
from ddtree.api.parsers.tools import forced_call_grammar, template_message
from ddtree.api.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    bad_request,
    load_json,
    validate_body,
)
from ddtree.api.rendering import template_kwargs_refusal
from ddtree.api.replies import ReplyFormat, template_mentions
from ddtree.api.state import ServerState
from ddtree.core import grammar
from ddtree.core.sampling import SamplingParams, ThinkBlock
from ddtree.errors import DDTreeError

log = logging.getLogger("ddtree.server")





# --------------------------------------------------------------------------------------------------------
# Bodies: parse, bound, validate, prepare (each runs whole where ServerState.prepare puts it)


def chat_request(state: ServerState, raw: bytes) -> tuple[ChatCompletionRequest, Prepared]:
    data = load_json(raw)
    _bound_messages(state, data)
    body = validate_body(ChatCompletionRequest, data)
    return body, prepare_chat(state, body)


def completion_request(state: ServerState, raw: bytes) -> tuple[CompletionRequest, Prepared]:
    data = load_json(raw)
    if isinstance(data, dict):
        _bound_prompt(state, data.get("prompt"))
    body = validate_body(CompletionRequest, data)
    return body, prepare_completion(state, body)


def tokenize_reply(state: ServerState, raw: bytes) -> JSONResponse:
    """vLLM's /tokenize: the prompt ids /v1/completions (prompt) or /v1/chat/completions (messages) would
    decode from. Not bounded by the context (it is how a client counts); the reply is rendered here too."""
    body = validate_body(TokenizeRequest, load_json(raw))
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of prompt and messages.", "prompt")
    if body.messages is not None:
        ids = chat_prompt_ids(state, body)[0]
    elif state.prompts is None:
        raise bad_request("This model has no tokenizer.", "prompt")
    else:
        ids = state.prompts.text_ids(body.prompt)
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids})


def detokenize_reply(state: ServerState, raw: bytes) -> JSONResponse:
    data = load_json(raw)
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if isinstance(tokens, list) and len(tokens) > state.engine.max_context:  # before validating each one
        raise bad_request(f"Send at most {state.engine.max_context} tokens (the context length), got "
                          f"{len(tokens)}.", "tokens")
    body = validate_body(DetokenizeRequest, data)
    check_model(state, body.model)
    check_token_ids(body.tokens, state.engine.vocab_size, "tokens", "tokens")
    return JSONResponse({"prompt": state.engine.decode(body.tokens)})


def _bound_prompt(state: ServerState, prompt: Any) -> None:
    """Refuse a completions prompt that cannot fit the context from its size alone: token ids by their
    count, text by the fewest tokens that many characters can make."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    limit = state.engine.max_context
    if isinstance(prompt, list) and len(prompt) >= limit and all(isinstance(t, int) for t in prompt[:8]):
        raise _context_error(limit, len(prompt), "prompt")
    if isinstance(prompt, str) and state.prompts is not None and state.prompts.min_tokens(len(prompt)) >= limit:
        raise _context_error(limit, state.prompts.min_tokens(len(prompt)), "prompt", at_least=True)


def _bound_messages(state: ServerState, data: Any) -> None:
    """Refuse a chat whose message text alone cannot fit the context, before rendering or tokenizing it."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if state.prompts is None or not isinstance(messages, list):
        return
    chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [content]
        chars += sum(len(p) for p in parts if isinstance(p, str))
        chars += sum(len(p["text"]) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    fewest = state.prompts.min_tokens(chars)
    if fewest >= state.engine.max_context:
        raise _context_error(state.engine.max_context, fewest, "messages", at_least=True)


def _context_error(limit: int, prompt_tokens: int, param: str, max_tokens: int | None = None,
                   at_least: bool = False) -> APIError:
    """In OpenAI's words, which clients parse to trim a chat and retry."""
    if max_tokens is None:
        count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        return bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                           f"{count} tokens. Please reduce the length of the prompt.", param)
    return bad_request(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
        "completion). Please reduce the length of the prompt or the completion.", param)


# --------------------------------------------------------------------------------------------------------
# Validation: request -> prompt ids, sampling params, stop strings


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    prompt_text: str = ""
    reply: ReplyFormat = field(default_factory=ReplyFormat)  # how a chat reply splits (reasoning, tool calls)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of an n > 1 request: with a seed, seed + index, so the choices differ and the reply
    is still reproducible; without one, each choice draws its own randomness."""
    if index == 0 or params.seed is None:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


def check_token_ids(ids: list[int], vocab: int, what: str, param: str) -> None:
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"{what} must be token ids in [0, {vocab}).", param)


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", type="NotFoundError", param="model",
                       code=404)


def _check_unsupported(req: SamplingFields) -> None:
    """Refuse what would silently change the output distribution if ignored."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is only returned without streaming.", "prompt_logprobs")
    if req.model_extra:
        log.info("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))


def _sampling(state: ServerState, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
              logprobs: int | None, prompt_param: str, max_param: str = "max_tokens") -> Prepared:
    """Check lengths and sampling fields; unset max tokens means "up to the context length"."""
    engine = state.engine
    if not prompt_ids:
        raise bad_request("The prompt is empty.", prompt_param)
    if req.n > state.config.max_queue:  # a 429 would invite retries that can never succeed
        raise bad_request(f"n is {req.n}, but this server queues at most {state.config.max_queue} sequences "
                          "(--max-queue).", "n")
    limit = engine.max_context
    if len(prompt_ids) >= limit:
        raise _context_error(limit, len(prompt_ids), prompt_param)
    if max_tokens is None:
        max_tokens = limit - len(prompt_ids)
    if len(prompt_ids) + max_tokens > limit:
        raise _context_error(limit, len(prompt_ids), max_param, max_tokens)
    vocab = engine.vocab_size
    stop_ids = tuple(req.stop_token_ids or ())
    check_token_ids(stop_ids, vocab, "stop_token_ids", "stop_token_ids")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        bias = tuple((int(key), value) for key, value in (req.logit_bias or {}).items())
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings).", "logit_bias") from None
    check_token_ids([token for token, _ in bias], vocab, "logit_bias keys", "logit_bias")
    sent = {k: getattr(req, k) for k in NEUTRAL_SAMPLING if getattr(req, k) is not None}
    try:
        params = SamplingParams(
            **merged_sampling(state.sampling_defaults, sent),
            max_new_tokens=max_tokens,
            seed=req.seed,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=bias,
            prompt_logprobs=req.prompt_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return Prepared(prompt_ids, params, tuple(s for s in stop if s))


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        if message.role != "assistant":
            raise bad_request(f"messages.{index}.content is required: a {message.role} message needs content.",
                              f"messages.{index}.content")
        if not message.tool_calls:
            raise bad_request(f"messages.{index}.content is required: an assistant message needs content or "
                              "tool_calls.", f"messages.{index}.content")
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Only text content parts are supported, got {part.type!r}.",
                              f"messages.{index}.content")
        texts.append(part.text)
    return "\n".join(texts)


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> tuple[list[int], bool]:
    """(the prompt ids of a chat, whether its tools were rendered into them): /tokenize renders with this
    too, so both agree, and so does `ddtree generate --chat`."""
    tools = _tools_rendered(state, req)
    # OpenAI's "developer" role is the system prompt under a new name; chat templates only know "system".
    messages = []
    for i, m in enumerate(req.messages):
        message = {"role": "system" if m.role == "developer" else m.role, "content": _message_text(m, i)}
        extra = {"tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id, "name": m.name}
        messages.append(template_message(message | {k: v for k, v in extra.items() if v is not None}))
    if state.prompts is None:
        raise bad_request("This model has no tokenizer: use /v1/completions with token ids.", "messages")
    kwargs = _template_kwargs(state, req) | ({"tools": req.tools} if tools else {})
    try:
        ids = state.prompts.chat_ids(messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message, **kwargs)
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the client's
        raise bad_request(f"Could not apply the chat template: {exc}", "messages") from None
    return ids, tools


def _template_kwargs(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The chat template arguments a chat renders with: the server's defaults, the request's own keys winning;
    keys that would set `apply_chat_template`'s own arguments are refused (rendering.template_kwargs_refusal)."""
    own = req.chat_template_kwargs or {}
    if (refusal := template_kwargs_refusal(own)) is not None:
        raise bad_request(f"chat_template_kwargs {refusal}", "chat_template_kwargs")
    return state.config.default_chat_template_kwargs | own


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> Prepared:
    check_model(state, req.model)
    _check_unsupported(req)
    prompt_ids, tool_calls = chat_prompt_ids(state, req)
    structure = _requested_grammar(req, _forced_call(req) if tool_calls else None)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prepared = _sampling(state, req, prompt_ids, max_tokens, logprobs, "messages", max_param)
    thinks = _parser_on(state, state.config.reasoning_parser, "qwen3", REASONING_CLOSE)
    prompt_block = _prompt_think_block(state, prompt_ids) if thinks else None
    think = None
    if thinks and structure is not None:
        think = _think_block(state, req, prompt_block)
        thinks = think is not None  # else the grammar applies from the first token: no room for a think block
    prepared.reply = ReplyFormat(reasoning=thinks, tool_calls=tool_calls,
                                 parallel_tool_calls=req.parallel_tool_calls,
                                 reasoning_opened=thinks and prompt_block == "open")
    return _constrained(state, prepared, structure, think)


def _parser_on(state: ServerState, setting: str, name: str, marker: str) -> bool:
    """Whether the reply parser `name` runs: set to it, or `auto` and the chat template writes `marker`."""
    if setting == "auto":
        return template_mentions(getattr(state.engine.tokenizer, "chat_template", None), marker)
    return setting == name


def _prompt_think_block(state: ServerState, prompt_ids: list[int]) -> str | None:
    """How the rendered prompt leaves a think block: "open" (templates that open it for the model),
    "closed" (an empty one, as Qwen3's template writes with enable_thinking false), or None."""
    tail = state.engine.decode(prompt_ids[-16:])
    opened, closed = tail.rfind(REASONING_OPEN), tail.rfind(REASONING_CLOSE)
    return None if opened == closed else "open" if opened > closed else "closed"


def _think_block(state: ServerState, req: ChatCompletionRequest, prompt_block: str | None) -> ThinkBlock | None:
    """The think block a constrained chat may write before its grammar applies, as vLLM's reasoning parser
    allows; None when the request does not think (enable_thinking false, or the prompt closed the block)
    or the tokenizer has no single <think> and </think> tokens to tell where the block ends."""
    if prompt_block == "closed" or _template_kwargs(state, req).get("enable_thinking") is False:
        return None
    tags = [state.engine.encode(tag) for tag in (REASONING_OPEN, REASONING_CLOSE)]
    if any(len(ids) != 1 for ids in tags):
        return None
    return ThinkBlock(tags[0][0], tags[1][0], opened=prompt_block == "open")


def _constrained(state: ServerState, prepared: Prepared, structure: str | None,
                 think: ThinkBlock | None = None) -> Prepared:
    if structure is not None:
        if state.engine.tokenizer is None:
            raise bad_request("Structured outputs need the model's tokenizer.", "response_format")
        prepared.params = dataclasses.replace(prepared.params, grammar=structure, think=think)
    return prepared


def _requested_grammar(req: SamplingFields, forced_call: str | None = None) -> str | None:
    """The grammar a request decodes under, from whichever one structure it asks for: `response_format`
    (`json_object`: any JSON object; `json_schema`: its `json_schema.schema`), vLLM's `structured_outputs`
    (`json`, `regex` or `choice`) or `guided_json` / `guided_regex` / `guided_choice`, or a forced tool
    choice. None for free text."""
    asked: list[tuple[str, str, Any]] = []  # (param, kind, spec)
    response_format = req.response_format or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", "json", grammar.JSON_OBJECT))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        asked.append(("response_format", "json", spec.get("schema") if isinstance(spec, dict) else None))
    elif kind != "text":
        raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}.",
                          "response_format")
    for key, spec in (req.structured_outputs or {}).items():
        if key in ("json", "regex", "choice") and spec is not None:
            asked.append(("structured_outputs", key, spec))
        elif spec is not None and key not in ("disable_any_whitespace", "disable_additional_properties"):
            raise bad_request(f"structured_outputs.{key} is not supported (json, regex and choice are).",
                              "structured_outputs")
    for key in ("json", "regex", "choice"):
        if (spec := getattr(req, f"guided_{key}")) is not None:
            asked.append((f"guided_{key}", key, spec))
    if forced_call is not None:
        asked.append(("tool_choice", "grammar", forced_call))
    if len(asked) > 1:
        raise bad_request(f"Ask for one output structure at a time (got {', '.join(a[0] for a in asked)}).",
                          asked[1][0])
    if not asked:
        return None
    param, kind, spec = asked[0]
    try:
        if kind == "grammar":
            return spec
        if kind == "json":
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema object is needed" + (" (json_schema.schema)"
                                                                     if param == "response_format" else ""))
            return grammar.json_schema_grammar(schema)
        if kind == "regex":
            if not isinstance(spec, str):
                raise ValueError("the regex must be a string")
            return grammar.regex_grammar(spec)
        return grammar.choice_grammar(spec)
    except (ValueError, DDTreeError) as exc:  # json.JSONDecodeError is a ValueError
        raise bad_request(f"{param}: {exc}", param) from None


def _tools_rendered(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> bool:
    """Whether a chat renders its tools into the prompt (and parses calls from the reply): it offers some
    and tool_choice is not "none"; the refusals, with reasons."""
    choice = req.tool_choice
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if isinstance(choice, dict) and (choice.get("type") != "function" or not isinstance(named, str)):
        raise bad_request("A named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                          "tool_choice")
    if not isinstance(choice, dict) and choice not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, got {choice!r}.",
                          "tool_choice")
    if (choice == "required" or named is not None) and not req.tools:
        raise bad_request("tool_choice forces a call but the request offers no tools.", "tool_choice")
    if not req.tools or choice == "none":
        return False
    for i, tool in enumerate(req.tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("Each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}.",
                              f"tools.{i}")
    if not _parser_on(state, state.config.tool_call_parser, "hermes", TOOL_CALL_START):
        raise bad_request("This server does not parse tool calls for this model: its chat template does not "
                          "write Hermes <tool_call> blocks (start it with --tool-call-parser hermes if the model "
                          "does), or it runs with --tool-call-parser none.", "tools")
    if named is not None and named not in {t["function"]["name"] for t in req.tools}:
        raise bad_request(f"tool_choice names {named!r}, which is not among the tools.", "tool_choice")
    return True


def _forced_call(req: ChatCompletionRequest) -> str | None:
    """The grammar a forced tool_choice (`required`, or a named function) decodes under; None for `auto`."""
    named = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
    if req.tool_choice != "required" and named is None:
        return None
    try:
        return grammar.lark_grammar(forced_call_grammar(req.tools, named, req.parallel_tool_calls))
    except (ValueError, DDTreeError) as exc:
        raise bad_request(f"The tools' parameters cannot constrain decoding: {exc}", "tools") from None


def prepare_completion(state: ServerState, req: CompletionRequest) -> Prepared:
    check_model(state, req.model)
    _check_unsupported(req)
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    if req.best_of not in (None, 1):
        raise bad_request("best_of must be 1.", "best_of")
    if req.echo and req.logprobs is not None and req.stream:
        raise bad_request("echo with logprobs (the prompt's log-probabilities) is only returned without "
                          "streaming.", "echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("Send one prompt per request (batched prompts are not supported).", "prompt")
        prompt = prompt[0]
    engine = state.engine
    if isinstance(prompt, str):
        if state.prompts is None:
            raise bad_request("This model has no tokenizer: send the prompt as token ids.", "prompt")
        prompt_ids = state.prompts.text_ids(prompt)
    else:
        check_token_ids(prompt, engine.vocab_size, "Prompt token ids", "prompt")
        prompt_ids = list(prompt)
    structure = _requested_grammar(req)
    prepared = _sampling(state, req, prompt_ids, req.max_tokens, req.logprobs, "prompt")
    if req.echo:  # the only use of the prompt's text
        prepared.prompt_text = prompt if isinstance(prompt, str) else engine.decode(prompt_ids)
    if req.echo and req.logprobs is not None:  # the echoed prompt comes with its own log-probabilities
        k = max(req.logprobs, req.prompt_logprobs or 0)
        prepared.params = dataclasses.replace(prepared.params, prompt_logprobs=k)
    return _constrained(state, prepared, structure)


