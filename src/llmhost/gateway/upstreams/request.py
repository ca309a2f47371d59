"""What one request upstream carries, whichever door it came in by: the model, its
inputs and sampling parameters, and where it goes (see docs/api.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmhost.gateway.routing.policies import Route


@dataclass
class RemoteImage:
    """An http(s) URL the gateway may fetch, and the field that gave it."""

    url: str
    param: str


@dataclass
class BackendRequest:
    """What one upstream request carries (see docs/api.md)."""

    model: str
    text_input: str | None
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    stream: bool
    n: int
    include_usage: bool
    chat: bool
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Top log probabilities asked per generated token (0: the sampled token's only);
    # None: no log probabilities.
    logprobs: int | None = None
    # The prompt's text, to come before the completion's (completions' echo).
    echo: str | None = None
    # The prompt's log probabilities were asked for (vLLM's prompt_logprobs field).
    prompt_logprobs: bool = False
    # The prompt as token ids (completions), instead of text_input.
    prompt_token_ids: list[int] | None = None
    # Several prompts (completions): each is a request of its own with n choices, and
    # the answer's choices run prompt by prompt (llmhost.gateway.doors.openai.batch).
    batch: list[str | list[int]] = field(default_factory=list)
    # The prompt's embedding, not generated text (/v1/embeddings; an embedding model).
    embed: bool = False
    # The chat's pictures in order (image_url parts): base64 text, or remote URLs that
    # the gateway fetches before the request goes upstream (llmhost.gateway.doors.openai.images).
    images: list[str | RemoteImage] = field(default_factory=list)
    # Where the gateway sends it (llmhost.gateway.routing.policies); never sent upstream.
    route: Route | None = None
    # The name the answer gives as its model: the LoRA adapter's the client asked for,
    # where model is the adapter's base model (llmhost.gateway.access); None: model.
    answer_model: str | None = None
    # Streamed with include_usage: every chunk carries the usage so far, not only the last.
    continuous_usage: bool = False
    # "tokenize" or "detokenize": the backend's tokenizer answers alone (llmhost.gateway.doors.openai.tokenize).
    tokens: str | None = None

    @property
    def choices(self) -> int:
        return self.n * max(1, len(self.batch))
