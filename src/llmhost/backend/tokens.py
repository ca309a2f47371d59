"""The tokenizer's answer to a request that asks for it alone (the request parameters
``tokenize`` and ``detokenize``, which the gateway's ``/tokenize`` and ``/detokenize``
set): one final response, whatever path it came by (Triton's gRPC or HTTP, or the
engine socket), so a gateway on a host without the model's files gets it from any
upstream. The engine never sees the request.

- ``tokenize``: the prompt's token ids as a generation request's prompt gets them
  (``text_input`` with the tokenizer's special tokens; ``messages`` through the chat
  template with the generation prompt). ``text_output`` holds JSON
  ``{"tokens": [...], "token_strs": [...], "max_model_len": N}`` (``token_strs``: the
  tokenizer's own strings of the ids, as vLLM's ``return_token_strs`` gives them);
  ``num_input_tokens`` is the count.
- ``detokenize``: ``prompt_token_ids`` (each in the vocabulary) back to text, in
  ``text_output``.
"""

from __future__ import annotations

import json
from typing import Any

from llmhost.backend.request import DETOKENIZE, GenerateJob


def tokens_answer(job: GenerateJob, ids: list[int], tokenizer: Any, max_model_len: int) -> str:
    """The ``text_output`` of the one response to JOB (its ``tokens`` is set), whose prompt is IDS."""
    if job.tokens == DETOKENIZE:
        return str(tokenizer.decode(ids))
    return json.dumps({"tokens": ids, "token_strs": list(tokenizer.convert_ids_to_tokens(ids)),
                       "max_model_len": max_model_len})
