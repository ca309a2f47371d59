"""Serving features against the real tritonserver + vLLM (tiny model, CPU)."""

from __future__ import annotations

import json
import re
from typing import Any

from transformers import AutoTokenizer

from tests.e2e._client import generate, grpc_stream, more_than, sampling, shaped, stream, texts

PROMPT = "def fibonacci(n):"


def test_generate_counts_and_defaults(server):
    r = generate(server, text_input=PROMPT, max_tokens=12, ignore_eos=True, return_finish_reason=True,
                 return_num_input_tokens=True, return_num_output_tokens=True)
    assert r["_status"] == 200, r
    assert r["num_output_tokens"] == 12 and r["finish_reason"] == "length"
    assert r["num_input_tokens"] > 0
    assert r["text_output"].startswith(PROMPT)  # the prompt is included unless excluded
    r2 = generate(server, text_input=PROMPT, max_tokens=12, ignore_eos=True, exclude_input_in_output=True,
                  temperature=0)
    assert not r2["text_output"].startswith(PROMPT)


def test_default_max_tokens_is_not_vllms_16(server):
    r = generate(server, text_input=PROMPT, ignore_eos=True, return_num_output_tokens=True)
    assert r["num_output_tokens"] == 512 - r.get("num_input_tokens", 0) or r["num_output_tokens"] > 16


def test_stream_equals_non_stream(server):
    body = {"text_input": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "exclude_input_in_output": True, "return_num_output_tokens": True}
    full = generate(server, **body)["text_output"]

    def take() -> list[dict[str, Any]]:
        events = stream(server, **body)
        assert "".join(e["text_output"] for e in events) == full
        counts = [e["num_output_tokens"] for e in events]  # each response's own tokens
        assert sum(counts) == 24 and all(c >= 1 for c in counts[:-1])
        return events

    shaped(take, more_than(1))


def test_stream_window_merges_deltas_and_loses_none(server):
    """A stream_interval_ms of 50 (here the request's) merges later deltas: fewer events than tokens, same text."""
    body = {"text_input": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "exclude_input_in_output": True, "return_num_output_tokens": True}
    full = generate(server, **body)["text_output"]

    def take() -> list[dict[str, Any]]:
        events = stream(server, **body, stream_interval_ms=50)
        counts = [e["num_output_tokens"] for e in events]  # each response's own tokens
        assert all(c >= 1 for c in counts[:-1]) and sum(counts) == 200
        assert "".join(e["text_output"] for e in events) == full
        return events

    def windowed(events: list[dict[str, Any]]) -> None:
        # Without the window an idle server sends about one event per engine step: 153
        # events for these 200 tokens with stream_interval_ms=0 (2026-11-23), where only
        # a busy I/O thread merged some. With it, the tokens of up to 50 ms leave
        # together: 30 events. Fewer than 100 (over two tokens an event) tells the two
        # apart. More than one event: the first token still leaves at once.
        assert 1 < len(events) < 100, f"{len(events)} events for 200 tokens"

    shaped(take, windowed)


def test_grpc_stream_matches_http(server):
    body = {"text_input": PROMPT, "max_tokens": 20, "ignore_eos": True, "temperature": 0,
            "exclude_input_in_output": True}
    full = generate(server, **body)["text_output"]

    def take() -> list[Any]:
        results, error = grpc_stream(server, {"text_input": PROMPT, "stream": True,
                                              "sampling_parameters": sampling(max_tokens=20, ignore_eos=True,
                                                                              temperature=0)})
        assert error is None
        assert "".join(texts(r)[0] for r in results) == full
        return results

    shaped(take, more_than(1))


def test_grpc_request_parameters(server):
    results, error = grpc_stream(server, {"text_input": PROMPT, "return_num_output_tokens": True},
                                 params={"max_tokens": 5, "ignore_eos": True})
    assert error is None and len(results) == 1
    assert int(results[0].as_numpy("num_output_tokens")[0]) == 5


def test_messages_use_the_chat_template(server, tiny_model):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Write a loop."},
                {"role": "assistant", "content": "for i in range(3): pass"},
                {"role": "user", "content": "Now a function."}]
    r = generate(server, messages=json.dumps(messages), max_tokens=8, ignore_eos=True,
                 return_num_input_tokens=True)
    assert r["_status"] == 200, r
    tok = AutoTokenizer.from_pretrained(tiny_model)
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["num_input_tokens"] == len(tok.encode(expected, add_special_tokens=False))
    assert "You write Python." not in r["text_output"]  # never echoes the conversation


def test_n_completions(server):
    r = generate(server, text_input=PROMPT, n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=7,
                 return_num_output_tokens=True)
    assert len(r["text_output"]) == 3 and r["num_output_tokens"] == [6, 6, 6]
    events = stream(server, text_input=PROMPT, n=2, max_tokens=5, ignore_eos=True, temperature=1.0,
                    return_num_output_tokens=True)
    # Each response counts its own tokens per completion: 5 each in all.
    assert [sum(e["num_output_tokens"][i] for e in events) for i in range(2)] == [5, 5]


def test_seed_is_deterministic(server):
    body = {"text_input": PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 1.0,
            "exclude_input_in_output": True}
    a = generate(server, seed=42, **body)["text_output"]
    b = generate(server, seed=42, **body)["text_output"]
    c = generate(server, seed=43, **body)["text_output"]
    assert a == b
    assert a != c


def test_stop_string(server):
    body = {"text_input": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 1.0, "seed": 3,
            "exclude_input_in_output": True}
    full = generate(server, **body)["text_output"]
    # A piece of the output whose first occurrence is well inside it.
    stop = next(full[k:k + 3] for k in range(5, len(full) - 3) if full.index(full[k:k + 3]) == k)
    r = generate(server, stop=stop, return_finish_reason=True, **body)
    assert r["finish_reason"] == "stop"
    assert r["text_output"] == full[: full.index(stop)]


def test_structured_output_json_regex_choice(server):
    # Bounded by construction, so even a random model must finish it.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    r = generate(server, text_input=PROMPT, max_tokens=64, exclude_input_in_output=True,
                 sampling_parameters=json.dumps({"temperature": 0, "json_schema": schema}))
    assert r["_status"] == 200, r
    value = json.loads(r["text_output"])
    assert isinstance(value["ok"], bool) and value["size"] in ("S", "M")
    r = generate(server, text_input=PROMPT, max_tokens=10, exclude_input_in_output=True, regex="[0-9]{3}")
    assert re.fullmatch("[0-9]{3}", r["text_output"]), r
    r = generate(server, text_input=PROMPT, max_tokens=10, exclude_input_in_output=True,
                 choice=json.dumps(["red", "green"]))
    assert r["text_output"] in ("red", "green")


def test_request_parameters_win_over_sampling_json(server):
    r = generate(server, text_input=PROMPT, ignore_eos=True, max_tokens=3, return_num_output_tokens=True,
                 sampling_parameters=json.dumps({"max_tokens": 9}))
    assert r["num_output_tokens"] == 3
