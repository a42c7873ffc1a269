"""The OpenAI API's request bodies as strict pydantic models, their validation, and the error shape.

The parameters Colibri knows are parsed strictly: a string where a number belongs or a negative `max_tokens` is a
400 naming the parameter (`APIError`), never coerced. A parameter it does not know is accepted and ignored, as
vLLM and llama-server do (clients such as Open WebUI, LiteLLM and LangChain send their own): `ignored` lists them,
and the server names them in a response header and its log. The few OpenAI defines that would change the answer
in a way Colibri does not implement (`logit_bias`, `best_of > 1`, `suffix`) are refused with a 400, so a client
never gets an answer that silently ignored what it asked for. Known ones that change nothing here are taken: an
assistant message's `refusal`, llama.cpp's `cache_prompt` (the prefix cache is always on) and `repeat_penalty`
(repetition_penalty's llama.cpp name).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from colibri.core.errors import InputError
from colibri.engine.sampling import MAX_LOGPROBS, SamplingParams

Number = Union[StrictInt, StrictFloat]
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request gives none (send 0 for greedy)
MAX_DEPTH = 64  # nesting of a body's arrays and objects (tool schemas need a few levels; Python's parser recurses)
# the parts of a pydantic error location that name a union member's type, not a parameter: 'str', 'list[str]',
# 'function-after[...]', 'TextPart'; parameters are lowercase names and list indices
_PARAM_PART = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class Strict(BaseModel):
    # extra="allow": an unknown field is kept aside (model_extra) for `ignored` to name, not refused
    # allow_inf_nan: `1e999` parses as inf, and a temperature or penalty of inf or NaN is no setting at all
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Function(Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: StrictStr
    type: Literal["function"]
    function: ToolCallFunction


class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None  # an assistant's refusal text (the official client's model_dump()): unused


class StreamOptions(Strict):
    include_usage: StrictBool = False


class JSONSchema(Strict):
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` shadows a BaseModel attribute
    strict: StrictBool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class Sampling(Strict):
    """The generation parameters chat and completions share (OpenAI's, plus top_k / min_p /
    repetition_penalty / ignore_eos as vLLM's and llama.cpp's servers accept them)."""

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    repeat_penalty: Number | None = None  # llama.cpp's name of repetition_penalty
    cache_prompt: StrictBool | None = None  # llama.cpp's: the prefix cache is always on here
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None  # accepted and unused: it identifies the end user to the provider
    ignore_eos: StrictBool | None = None  # vLLM's extension: generate max_tokens whatever (benchmarks)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None


class CompletionRequest(Sampling):
    logprobs: StrictInt | None = None  # the legacy API's: how many top log-probabilities per token
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class EmbeddingRequest(Strict):
    model: StrictStr
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = None  # only the model's own: the vectors are not truncated
    user: StrictStr | None = None


def parse(model: type[Strict], body: bytes) -> Any:
    """The request body as `model`, or an APIError(400) naming the first bad parameter."""
    if _depth(body) > MAX_DEPTH:  # before the parser, whose recursion a deep body exhausts
        raise APIError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep",
                       code="invalid_json")
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json")
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return validate(model, obj)


def validate(model: type[Strict], obj: dict) -> Any:
    """A parsed JSON object as `model`, or an APIError(400) naming the first bad parameter (also `colibri
    batch`'s check of an OpenAI Batch line's body)."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors()  # a union's members each add one: an infinite float names its own problem
        err = next((x for x in errors if x["type"] == "finite_number"), errors[0])
        loc = ".".join(str(x) for x in err["loc"]
                       if isinstance(x, int) or (_PARAM_PART.fullmatch(str(x)) and x not in _TYPE_TAGS))
        if err["type"] == "missing":
            raise APIError(400, f"missing required parameter: {loc}", param=loc, code="missing_parameter")
        raise APIError(400, f"invalid value for {loc}: {err['msg']}", param=loc, code="invalid_value")


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _depth(body: bytes) -> int:
    """How deep the body's brackets nest outside strings (without the parser, which recurses)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(1 if b in b"[{" else -1 for b in brackets), default=0)


def ignored(req: Strict) -> list[str]:
    """The parameters of a parsed body that Colibri does not know, by path (`frobnicate`, `messages.0.x`); null
    ones are not named (they ask for nothing: the official client's model_dump() of an assistant message carries
    `audio`, `annotations` and `function_call` as null)."""
    out: list[str] = []

    def walk(obj, path: str) -> None:
        if isinstance(obj, BaseModel):
            out.extend(f"{path}{k}" for k, v in (obj.model_extra or {}).items() if v is not None)
            for name in type(obj).model_fields:
                walk(getattr(obj, name), f"{path}{name}.")
        elif isinstance(obj, list):
            for i, x in enumerate(obj):
                walk(x, f"{path}{i}.")

    walk(req, "")
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


MAX_CHOICES = 16  # n: choices of one request


def refuse_unsupported(req: Sampling) -> None:
    """400 for parameters that would change the answer in a way Colibri does not implement, or out of range."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}] (got {req.n})", param="n", code="invalid_value")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
    if req.top_logprobs is not None and not (isinstance(req, ChatRequest) and req.logprobs):
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}] (got {req.top_logprobs})",
                       param="top_logprobs", code="invalid_value")
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema: {name, schema}",
                       param="response_format.json_schema", code="missing_parameter")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != 1:
        raise APIError(400, "best_of > 1 is not supported", param="best_of", code="unsupported_value")
    if getattr(req, "suffix", None):
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with `seed` (n > 1): seed + index, wrapped into [-2**63, 2**64),
    so choice i of a seeded request is the single request with seed + i."""
    if seed is None:
        return None
    s = seed + index
    return s - 2**64 if s >= 2**64 else s


def logprobs_wanted(req: Sampling) -> int | None:
    """How many top log-probabilities each token carries (None: no logprobs): chat's `logprobs: true` with
    `top_logprobs`, or the legacy completions' integer `logprobs`."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def sampling_params(req: Sampling, prompt_tokens: int, context: int, grammar: str | None = None) -> SamplingParams:
    """The engine's SamplingParams (`grammar`: what the reply must match, see grammar()); a prompt plus
    `max_tokens` beyond the context is a 400 (never truncated). Without max_tokens a reply may run to the end of
    the context."""
    chat = isinstance(req, ChatRequest)
    max_tokens = req.max_completion_tokens if chat else None
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    if prompt_tokens >= context:
        raise APIError(400, f"the prompt is {prompt_tokens} tokens but this model's context holds {context}"
                            " (with the reply); shorten the prompt", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = context - prompt_tokens
    elif max_tokens < 1:
        raise APIError(400, f"{param} must be at least 1 (got {max_tokens})", param=param, code="invalid_value")
    elif prompt_tokens + max_tokens > context:
        raise APIError(400, f"this model's context holds {context} tokens, but {prompt_tokens} in the prompt"
                            f" plus {param}={max_tokens} ask for {prompt_tokens + max_tokens}; lower {param}",
                       param=param, code="context_length_exceeded")
    kw = given_sampling(req)
    kw["temperature"] = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs_wanted(req), grammar=grammar, **kw)
    except InputError as e:
        name = str(e).split(" ")[0]
        raise APIError(400, str(e), param=name, code="invalid_value") from None


def given_sampling(req: Sampling) -> dict:
    """The SamplingParams fields a request sets itself (not max_tokens, which needs the prompt's length), with
    `repeat_penalty` as repetition_penalty and `stop` as a list."""
    kw = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                       "ignore_eos", "presence_penalty", "frequency_penalty")
          if getattr(req, k) is not None}
    if req.repeat_penalty is not None:
        if req.repetition_penalty is not None and req.repetition_penalty != req.repeat_penalty:
            raise APIError(400, "repeat_penalty and repetition_penalty disagree; send one of them",
                           param="repeat_penalty", code="invalid_value")
        kw["repetition_penalty"] = req.repeat_penalty
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop is not None and len(stop) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop", code="invalid_value")
    if stop:
        kw["stop"] = stop
    return kw
