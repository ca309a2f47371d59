"""The fuzzers' leak check (tests.harness.fuzz): an error may quote back what the
request carried, JSON-escaped on the wire, but never show a traceback or a server path
the request did not carry. Hypothesis found the first case on 2026-11-25."""

from __future__ import annotations

import json

import pytest

from tests.harness.fuzz import assert_no_leak, sent_text


def test_a_value_quoted_back_unescaped_is_no_leak():
    params = b'{"temperature": "File \\"", "max_tokens": 3}'
    error = "sampling parameter 'temperature' must be a number, got 'File \"'"
    assert_no_leak(error, sent_text(b"\x00", params))


def test_json_text_inside_json_is_unescaped_too():
    body = {"sampling_parameters": json.dumps({"stop": ["/usr/lib \"x\""]})}
    assert '/usr/lib "x"' in sent_text(json.dumps(body), body)


@pytest.mark.parametrize("leak", ['Traceback (most recent call last):', 'File "/srv/x.py", line 3',
                                  "/site-packages/vllm/engine.py"])
def test_a_traceback_or_path_the_request_did_not_carry_is_caught(leak: str):
    with pytest.raises(AssertionError):
        assert_no_leak(f"error: {leak}", sent_text(b"hello", b'{"temperature": "warm"}'))
