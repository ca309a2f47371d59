"""OpenAI request bodies as pydantic models. Unknown fields are refused by name
(``extra="forbid"``); fields of OpenAI's API this server does not implement are
refused by name before validation (``UNSUPPORTED``) unless left at their null/off
value."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# Fields of OpenAI's (or vLLM's) API that exist but are not served here.
UNSUPPORTED_COMMON = ("logit_bias", "suffix", "best_of", "functions", "function_call", "audio",
                      "modalities", "prediction", "store", "metadata", "service_tier", "web_search_options",
                      "use_beam_search")

Number = float


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None


class _Schema(_Strict):
    """A named JSON schema: a response format's, or a function tool's parameters'."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    strict: StrictBool | None = None


class JsonSchemaFormat(_Schema):
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    # JSON text, as OpenAI sends it (an object is taken too, as vLLM's server takes it).
    arguments: str | dict[str, Any] = ""


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # None only for an assistant turn that called tools. Parts: text, and image_url
    # (llmhost.gateway.images), checked by llmhost.gateway.mapping, which names the part.
    content: str | list[dict[str, Any]] | None
    name: str | None = None
    # An assistant's tool calls, and the call a tool's result answers (OpenAI's).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Schema):
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Strict):
    model: str = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    n: StrictInt | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    user: str | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields, as its OpenAI server accepts them.
    top_k: StrictInt | None = None
    min_p: Number | None = Field(default=None, ge=0, le=1)
    repetition_penalty: Number | None = Field(default=None, gt=0)
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    # vLLM's structured outputs: {"json" | "regex" | "choice" | "grammar": ...}, or one of
    # its older top-level names (the backend checks them as it checks Triton's requests).
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the prompt tokens' log probabilities (and the top k more), not streamed.
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)


# vLLM's default bound on the top log probabilities per token (its max_logprobs).
MAX_TOP_LOGPROBS = 20


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # The sampled token's log probability per generated token, and TOP_LOGPROBS more.
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    # Function tools the model may call, which it must call, and whether several at once.
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's: the chat template's extra arguments (e.g. enable_thinking), how hard a
    # reasoning model thinks (to the template, as reasoning_effort), and whether its
    # thinking is sent.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: StrictBool | None = None


# The most inputs one embeddings request may hold (OpenAI's own bound).
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Strict):
    model: str = Field(min_length=1)
    # Text, several texts, token ids, or several lists of token ids.
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    # Text, or token ids (one list of them, or a list holding one such list).
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # The top LOGPROBS log probabilities per generated token (besides the sampled token's).
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # The prompt's text before the completion's.
    echo: StrictBool | None = None
    response_format: ResponseFormat | None = None
