"""One client cannot stall the others: a multi-megabyte prompt is tokenized on a
worker thread, so a small request sent right after it is answered before the big
prompt's rejection (for its token length) comes back. Ordering, not timing.

Needs a server other than the session's: the default byte limit (derived from
max_model_len 512) is far below a multi-megabyte prompt, so this one raises
llmhost.max_prompt_bytes (tests/e2e/conftest.py's tuned server: its LoRA and stream
window do not touch these plain requests).
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.e2e._servers import BIG_PROMPT_LIMIT
from tests.harness.server import Server

BIG_LIMIT = BIG_PROMPT_LIMIT


@pytest.fixture(scope="module")
def big_prompt_server(tuned_server: Server) -> Server:
    """max_prompt_bytes BIG_LIMIT, with two tokenizer threads."""
    return tuned_server


def _post(server: Server, body: dict, name: str, done: list[tuple[str, dict]], lock: threading.Lock) -> None:
    r = requests.post(f"{server.http}/v2/models/{server.name}/generate", json=body, timeout=600)
    with lock:
        done.append((name, {"status": r.status_code, **r.json()}))


def test_small_request_overtakes_a_multi_megabyte_prompt(big_prompt_server: Server) -> None:
    server = big_prompt_server
    big = "def f(x):\n    return x\n" * 350_000  # 8 MB: under the byte limit, far over 512 tokens
    assert len(big) < BIG_LIMIT
    done: list[tuple[str, dict]] = []
    lock = threading.Lock()
    big_thread = threading.Thread(target=_post, args=(server, {"text_input": big, "max_tokens": 4}, "big", done, lock))
    big_thread.start()
    time.sleep(1.0)  # let the big request reach the backend (not an assertion on time)
    small = {"text_input": "hello", "max_tokens": 8, "ignore_eos": True, "return_num_output_tokens": True}
    _post(server, small, "small", done, lock)
    big_thread.join(timeout=600)
    assert [name for name, _ in done] == ["small", "big"], [(n, str(r)[:200]) for n, r in done]
    small_answer, big_answer = done[0][1], done[1][1]
    assert small_answer["status"] == 200 and small_answer["num_output_tokens"] == 8, small_answer
    assert big_answer["status"] == 400, str(big_answer)[:300]
    assert "tokens; the model's max_model_len is 512" in big_answer["error"], big_answer["error"][:300]


def test_explicit_limit_is_named(big_prompt_server: Server) -> None:
    r = requests.post(f"{big_prompt_server.http}/v2/models/{big_prompt_server.name}/generate",
                      json={"text_input": "x" * (BIG_LIMIT + 1)}, timeout=120)
    assert r.status_code == 400
    assert r.json()["error"] == (f"input 'text_input' is {BIG_LIMIT + 1} bytes; at most {BIG_LIMIT} bytes are "
                                 "allowed (llmhost.max_prompt_bytes)")
