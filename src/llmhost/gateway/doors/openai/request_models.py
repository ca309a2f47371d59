"""OpenAI request bodies as pydantic models. Unknown fields are refused by name
(``extra="forbid"``); fields of OpenAI's API this server does not implement are
refused by name before validation (``UNSUPPORTED``) unless left at their null/off
value."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

# Fields of OpenAI's (or vLLM's) API that exist but are not served here.
UNSUPPORTED_COMMON = ("suffix", "best_of", "functions", "function_call", "audio",
                      "modalities", "prediction", "store", "metadata", "service_tier", "web_search_options",
                      "use_beam_search")

# Fields of vLLM's OpenAI server that this gateway refuses, and why (the 400 says it).
_BEAM = "is not served: beam search is not served"
_ENGINE = "is not served: it reaches into vLLM's engine past the backend"
_RETURN = "is not served: the answer carries what OpenAI's API carries, not this extra"
_TOOLS = "is not served: use tools and tool_choice"
_MEDIA = "is not served: text and images only"
_HOSTED = "is not served: a feature of OpenAI's hosted service"
REFUSED: dict[str, str] = {
    "use_beam_search": _BEAM, "best_of": _BEAM, "length_penalty": _BEAM,
    "suffix": "is not served: no fill-in-the-middle",
    "functions": _TOOLS, "function_call": _TOOLS, "audio": _MEDIA, "modalities": _MEDIA,
    "prediction": _HOSTED, "store": _HOSTED, "metadata": _HOSTED, "service_tier": _HOSTED,
    "web_search_options": _HOSTED,
    "truncate_prompt_tokens": "is not served: a prompt longer than the context is refused, never cut",
    "truncation_side": "is not served: a prompt longer than the context is refused, never cut",
    "logprob_token_ids": "is not served: ask logprobs/top_logprobs",
    "prompt_embeds": "is not served: send text or token ids",
    "watermarking": _ENGINE, "thinking_token_budget": _ENGINE, "repetition_detection": _ENGINE,
    "vllm_xargs": _ENGINE, "kv_transfer_params": _ENGINE, "ec_transfer_params": _ENGINE, "priority": _ENGINE,
    "cache_salt": _ENGINE, "routed_experts_prompt_start": _ENGINE,
    "stream_interval": "is not served: a stream follows the model's stream_interval_ms setting",
    "request_id": "is not served: the gateway names each request itself",
    "lora_name": "is not served: name the LoRA adapter as the model (GET /v1/models lists each model's adapters)",
    "session_id": "is not served: send the x-session-id header to keep a session on one replica",
    "return_tokens_as_token_ids": _RETURN, "return_token_ids": _RETURN, "return_token_offsets": _RETURN,
    "return_prompt_text": _RETURN, "mm_payload": _RETURN, "return_mm_kwargs": _RETURN,
    "add_generation_prompt": "is not served: the chat template always adds the generation prompt",
    "continue_final_message": "is not served: the chat template always adds the generation prompt",
    "add_special_tokens": "is not served: the prompt is tokenized as vLLM's server does by default",
    "documents": "is not served: pass what the template reads in chat_template_kwargs",
    "chat_template": "is not served: the model's own chat template is used",
    "media_io_kwargs": "is not served: images are read as the backend reads them",
    "mm_processor_kwargs": "is not served: images are read as the backend reads them",
}

Number = float
# Token ids: no vocabulary comes near the top (the backend's bound); vLLM checks the
# model's vocabulary.
TOKEN_ID_MAX = 2**31 - 1
TokenId = Annotated[StrictInt, Field(ge=0, le=TOKEN_ID_MAX)]
# OpenAI's range of a logit bias (vLLM's server clamps to it; we refuse beyond it).
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0
# The backend's bounds (llmhost.backend.limits), checked here first so that the answer
# names the field.
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 262_144


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: StrictBool | None = None


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
    # (llmhost.gateway.doors.openai.images), checked by llmhost.gateway.doors.openai.mapping, which names the part.
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
    # Token id (as a string, OpenAI's form) -> a bias added to its logit before sampling.
    logit_bias: dict[str, StrictFloat] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: words the output must not contain; the only tokens it may contain.
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    spaces_between_special_tokens: StrictBool | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= TOKEN_ID_MAX):
                raise ValueError(f"key {key[:32]!r} is not a token id (a decimal integer from 0 to {TOKEN_ID_MAX})")
            if not LOGIT_BIAS_MIN <= bias <= LOGIT_BIAS_MAX:
                raise ValueError(f"the bias of token {key} is {bias}; a bias is from {LOGIT_BIAS_MIN:g} "
                                 f"to {LOGIT_BIAS_MAX:g}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        for i, word in enumerate(value or ()):
            if not word or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"item {i} is {len(word)} characters long; a bad word is 1 to "
                                 f"{MAX_BAD_WORD_CHARS} characters")
        return value


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


# vLLM's server's /tokenize and /detokenize bodies (its TokenizeCompletionRequest,
# TokenizeChatRequest and DetokenizeRequest). The tokenizer switches are served at
# vLLM's defaults only, which are how a generation request's prompt is tokenized here.
TOKENIZE_DEFAULTS = {"add_special_tokens": (True, False), "add_generation_prompt": (None, True),
                     "continue_final_message": (None, False)}


class TokenizeCompletionRequest(_Strict):
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool | None = None


class TokenizeChatRequest(_Strict):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)


class DetokenizeRequest(_Strict):
    model: str = Field(min_length=1)
    tokens: list[TokenId] = Field(min_length=1)
