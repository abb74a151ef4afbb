"""OpenAI request bodies (completions, chat completions) as strict pydantic models.

Strict: a string is not a number and a number is not a string; unknown fields are rejected with
the field's name (as OpenAI's own API does: "Unrecognized request argument supplied"). Fields
that OpenAI defines but this server cannot honour are accepted only at their neutral value, so a
client sending `logit_bias: {}` or `suffix: null` still works.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.runner.grammar import StructuredOutput
from serving.errors import APIError, invalid

MAX_N = 128
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""A 64-bit signed seed (what torch generators take)."""
MAX_STOP = 16
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


Prob = Annotated[float, Field(ge=0, le=2)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class JSONSchemaFormat(_Body):
    """response_format.json_schema (OpenAI): the schema the output must be valid against."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    """A JSON schema; absent: any JSON object."""
    strict: bool | None = None
    """Accepted for the openai client; the output always follows the schema."""


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return StructuredOutput("json_object", param="response_format")
        return StructuredOutput.json_schema(self.json_schema.schema_, "response_format.json_schema.schema")


class _Sampling(_Body):
    """Fields both endpoints share (names and ranges as in the OpenAI API; extras as in vLLM)."""

    model: str
    temperature: Prob | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: Any = None
    """A string or a list of strings."""
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    task: str | None = None
    """P-tuned task (shardserve extension; the openai client sends it via extra_body)."""
    response_format: ResponseFormat | None = None
    """Structured output: json_object or json_schema (engines/runner/grammar.py); text: unconstrained."""

    @field_validator("task")
    @classmethod
    def _task(cls, v):
        if v is not None:
            from engines.transforms.ptuning import TaskError, check_task_name

            try:
                check_task_name(v)
            except TaskError as exc:
                raise ValueError(str(exc).removeprefix("task: ")) from None
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("must be a string or a list of strings")
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server (send {} or leave it out)")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The set fields, named as engines.SamplingParams names them."""
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "n", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                     "include_stop_str_in_output"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        if self.stop is not None:
            out["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = tuple(self.stop_token_ids)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Any
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("must be a non-empty string, list of strings, list of token ids, or list of "
                             "token-id lists")
        if all(isinstance(x, str) for x in v):
            if not all(v):
                raise ValueError("the prompts of a list must not be empty")
            return v
        if all(_is_int(x) for x in v):
            return v
        if all(isinstance(x, list) for x in v):
            if not all(x and all(_is_int(t) for t in x) for x in v):
                raise ValueError("each token-id prompt must be a non-empty list of integers")
            return v
        raise ValueError("a list prompt must hold only strings, only token ids (integers), or only lists of "
                         "token ids")

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    """A string, or a list of {"type": "text", "text": ...} parts."""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant message's earlier tool calls (passed to the chat template as they came)."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")  # noqa: TRY004 - pydantic wants ValueError
        parts = []
        for i, p in enumerate(v):
            if not isinstance(p, dict) or p.get("type") != "text":
                raise ValueError(f"part {i}: only {{\"type\": \"text\", \"text\": ...}} parts are supported")
            if not isinstance(p.get("text"), str) or set(p) - {"type", "text"}:
                raise ValueError(f"part {i}: a text part has a string `text` and nothing else")
            parts.append(TextPart(type="text", text=p["text"]))
        return parts

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; absent: no arguments."""
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {
            "type": "object", "properties": {}, "additionalProperties": False}


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """As vLLM without a tool-call parser: "auto" (the default when tools are given) is refused;
    "required" or a named function constrain the output to tool calls; "none" ignores the tools."""
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tools(self):
        choice = self.tool_choice
        if choice is None and self.tools:
            choice = "auto"
        if choice == "auto":
            raise ValueError('tool_choice: "auto" needs a tool-call parser, which this server does not have '
                             '(as vLLM without --enable-auto-tool-choice); use "required", a named function '
                             'or "none"')
        if choice in (None, "none"):
            return self
        if not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with tool_choice required or a named function")
        return self

    @property
    def tool_mode(self) -> str | None:
        """None (plain text), "required" (a JSON array of calls), or the named function's name."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    def structured(self) -> StructuredOutput | None:
        mode = self.tool_mode
        if mode is None:
            return self.response_format.structured() if self.response_format is not None else None
        from engines.runner.grammar import check

        for i, t in enumerate(self.tools):  # each function's schema alone first, to name the bad one
            param = f"tools[{i}].function.parameters"
            why = check(StructuredOutput.json_schema(t.function.schema(), param))
            if why is not None:
                raise APIError(invalid(f"{param}: {why}", param).info)
        if mode != "required":
            fn = next(t.function for t in self.tools if t.function.name == mode)
            return StructuredOutput.json_schema(fn.schema(), "tool_choice")
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": t.function.schema()},
             "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]}}
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return StructuredOutput.json_schema(calls, "tools")

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens: give max_tokens or max_completion_tokens, not both")
        return self

    def template_variables(self) -> tuple[bool, dict[str, Any]]:
        """(add_generation_prompt, the other chat_template_kwargs): add_generation_prompt may be given
        in either place (vLLM reads it from chat_template_kwargs too), not differently in both."""
        from serving.chat import check_template_kwargs

        extra = dict(self.chat_template_kwargs or {})
        check_template_kwargs(extra)
        add = self.add_generation_prompt
        if "add_generation_prompt" in extra:
            param = "chat_template_kwargs.add_generation_prompt"
            value = extra.pop("add_generation_prompt")
            if not isinstance(value, bool):
                raise invalid(f"{param}: must be a boolean, got {value!r}", param, "invalid_type")
            if "add_generation_prompt" in self.model_fields_set and value != add:
                raise invalid(f"{param}: {value} contradicts add_generation_prompt {add}; give it once", param)
            add = value
        return add, extra

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _param(loc: tuple) -> str | None:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + str(p)
    return out or None


_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = _param(err["loc"])
        typ = err["type"]
        if typ == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        elif typ == "missing":
            msg = f"Missing required parameter: '{param}'"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if param:
                msg = f"Invalid value for '{param}': {msg}"
            elif m := re.match(r"^([a-z_]+): ", msg):  # a cross-field check names its field first
                param = m.group(1)
        code = _CODES.get(typ, "invalid_type" if typ.endswith(("_type", "_parsing")) else "invalid_value")
        raise APIError(invalid(msg, param, code).info) from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
