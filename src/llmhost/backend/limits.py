"""Upper bounds on what one request may send, so no input can cost the server
unbounded memory or time. Each is checked before the value reaches vLLM, and a
request over one gets an error naming the input and the bound.

The prompt's own size is a backend setting (``max_prompt_bytes``, derived from
``max_model_len`` by default); these are fixed.
"""

from __future__ import annotations

# JSON inputs (messages, sampling_parameters, parameters given as JSON strings,
# structured-output specs) may nest objects and arrays at most this deep. vLLM
# refuses JSON schemas nested deeper than 64 itself; this leaves room for the
# wrapping levels around a schema.
MAX_JSON_DEPTH = 100
# The sampling_parameters input (JSON text), and any one request parameter given
# as a JSON string.
MAX_PARAMETERS_BYTES = 4 * 1024 * 1024
# vLLM's own OpenAI server takes a seed in torch.long's range; larger ones
# overflow in vLLM's GPU model runner.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
# Lists and maps of sampling parameters: (most items, longest string item).
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 262_144  # the largest vocabularies in use
# Structured output: a regex, grammar or JSON schema (as JSON text) at most this
# many characters; a choice list at most MAX_CHOICES items and this many characters in all.
MAX_STRUCTURED_CHARS = 65_536
MAX_CHOICES = 1024
# An error message sent to a client is cut to this many characters.
MAX_ERROR_CHARS = 1000
