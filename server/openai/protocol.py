"""The OpenAI wire protocol at the HTTP boundary: pydantic request models, the limits they
enforce, and `ModelCard` (what the API says about the served model).

Owns what a request body may contain and its shape-level limits (how many choices, prompts, stop
strings, logprobs). How its fields become sampling parameters is `server.openai.sampling_params`'.
Value checks the engine already makes (temperature >= 0, top_p in (0, 1], ...) are left to
`SamplingParams`, whose `InvalidRequestError` names the field; `server.errors` makes it a 400.
Responses are plain dicts built in `server.openai.render` (one `json.dumps` per SSE chunk is the hot
path, and the shapes are small).

Unknown fields are ignored, as vLLM and OpenAI's own server do, so newer SDKs keep working.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from server.openai.body import Body, JSONObject, Text
from server.openai.tool_protocol import ToolCallParam, ToolChoice, Tools

# Limits a single HTTP request may ask for. They bound the work one call can queue and the size
# of a response; the engine's own limits (context length, KV pool) are checked separately.
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 64  # prompts x n
# Seeds are within I-JSON's interoperable integers (RFC 7493: |n| <= 2**53 - 1): beyond that,
# tools that compare JSON numbers as float64 (jsonschema-rs, JavaScript) round a seed next to
# the bound onto it, so the document would accept what the server refuses.
MAX_SEED = 2**53 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # completions `logprobs` and chat `top_logprobs`
MAX_LOGIT_BIAS = 300
MAX_MESSAGES = 1024
# Sampling value ranges, checked here so the OpenAPI schema states them (SamplingParams checks
# them again for callers of the engine). A repetition penalty near 0 (or huge) divides logits into
# infinities, so only a sane band is allowed; OpenAI's penalties are in [-2, 2].
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def _integral(value: Any) -> Any:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema, and so the OpenAPI
    document, says). Anything else, "5" and true included, is left to the strict int check."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# Request integers: strict (no strings, no booleans) but 5.0 is 5.
Int = Annotated[int, BeforeValidator(_integral)]


def int_in(**bounds: int) -> Any:
    """`Int` with bounds (ge, le, ...). The bounds sit on the int inside the validator, so the
    JSON schema says minimum/maximum (on the wrapped type it would say ge/le, not JSON Schema)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    """`response_format.json_schema`: OpenAI's {"name", "schema", "strict"}."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text | None = None
    description: Text | None = None
    # `schema` would shadow a BaseModel attribute: stored as schema_, spelled "schema" on the wire.
    schema_: JSONObject | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatParam(Body):
    """`response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": ...}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatParam:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class StructuredOutputsParam(Body):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields): one of these."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: JSONObject | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = None
    json_object: bool | None = None


StopField = Annotated[
    Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
    | Annotated[
        list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
        Field(max_length=MAX_STOP_STRINGS),
    ]
    | None,
    Field(description="Up to 16 strings; generation stops before the first match."),
]


class SamplingFields(Body):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: Text | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int_in(ge=-1) | None = Field(None, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    stop: StopField = None
    stop_token_ids: list[int_in(ge=0)] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    # Choice j samples with seed + j (torch seeds are 64-bit, far above MAX_SEED + MAX_N).
    seed: int_in(ge=-MAX_SEED, le=MAX_SEED) | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    logit_bias: dict[Text, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    user: Text | None = None
    # vLLM's extras: scheduling priority (lower runs earlier; used by --scheduling priority and
    # fair) and a prefix-cache salt (only requests with the same salt share cached KV blocks).
    priority: int_in(ge=-(2**31), le=2**31 - 1) = 0
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured output (server.grammars.compiler): OpenAI's response_format, or vLLM's spellings.
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: JSONObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}"
            )
        for s in stops:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters"
                )
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        # After validation `stop` is always a list.
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = Text | list[Text] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int_in(ge=0) | None = 16  # 0 only with echo: the prompt's logprobs alone
    echo: bool = False
    logprobs: int_in(ge=0, le=MAX_LOGPROBS) | None = None
    # vLLM's: top-N logprobs of each prompt token, in `choices[].prompt_logprobs`
    prompt_logprobs: int_in(ge=0, le=MAX_LOGPROBS) | None = None
    suffix: Text | None = None
    # vLLM V1's rule: null or 1 (the n choices themselves; clients such as LangChain send 1
    # with any n). Choosing the best n of more candidates is not supported.
    best_of: int_in(ge=1, le=1) | None = Field(None, description="null or 1")

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed, got {len(v)}")
        return v

    @field_validator("best_of", mode="before")
    @classmethod
    def _best_of_is_one(cls, v: Any) -> Any:
        # Before the type's own check, for a message saying what to do instead.
        if isinstance(v, int | float) and not isinstance(v, bool) and v > 1:
            raise ValueError(
                "best_of > 1 (the best of more candidates than returned) is not supported; "
                "use n for several choices"
            )
        return v

    def max_output_tokens(self) -> int:
        """max_tokens; OpenAI's default of 16 when it is sent as null."""
        return 16 if self.max_tokens is None else self.max_tokens

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(Body):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(Body):
    role: Text = Field(min_length=1)
    # Only text content: image/audio parts fail validation with a 400 naming the part.
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    # Tool calling (server.tooling.plan): an assistant turn's calls, and the call a tool turn answers.
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: Text | None = None
    # An assistant turn's reasoning as this server returned it: templates that render
    # reasoning back (gpt-oss's, before a tool call) read it (server.tooling.chat_template).
    reasoning_content: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int_in(ge=1) | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int_in(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: int_in(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: bool = True
    # -- tool calling (server.tooling.plan) and the chat template's inputs (server.tooling.chat_template) --
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    chat_template_kwargs: JSONObject | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def max_output_tokens(self, context_left: int) -> int:
        """max_completion_tokens, else max_tokens, else what the context leaves after the prompt
        (`context_left`), as vLLM does."""
        return self.max_completion_tokens or self.max_tokens or context_left

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token, None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Body):
    model: Text | None = None
    tokens: list[Int]


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the API says about the served model."""

    names: tuple[str, ...]  # the first is the one responses carry
    max_model_len: int
    parameter_count: int
    engine: str
    created: int = field(default_factory=lambda: int(time.time()))
    # Sampling defaults for fields a request leaves out (models.generation_config), e.g.
    # {"temperature": 0.2, "top_p": 0.9}; empty: OpenAI's defaults.
    default_sampling_params: Mapping[str, Any] = field(default_factory=dict)
    # How /v1/embeddings pools a prompt's final hidden states: "mean", or "last" (the last
    # token's, for models trained that way; engine.prompt_outputs.Pooling).
    embedding_pooling: str = "mean"

    @property
    def name(self) -> str:
        return self.names[0]
