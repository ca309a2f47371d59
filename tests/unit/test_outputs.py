"""The additional outputs' values (backend/outputs.py), as vllm_backend shapes them."""

from __future__ import annotations

import json
from types import SimpleNamespace

from llmhost.backend.outputs import finish_reasons, logprobs_json, positions


def lp(logprob: float, rank: int, token: str) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def test_positions_are_token_id_strings_to_logprob_rank_and_decoded_token():
    got = positions([{11: lp(-0.25, 1, " a"), 7: lp(-2.0, 2, " b")}, {3: lp(-0.5, 1, "c")}])
    assert got == [{"11": {"logprob": -0.25, "rank": 1, "decoded_token": " a"},
                    "7": {"logprob": -2.0, "rank": 2, "decoded_token": " b"}},
                   {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}}]
    assert positions(None) == [] and positions([None]) == [{}]


def test_logprobs_output_is_json_per_completion_and_null_when_not_asked():
    out = logprobs_json([[{"5": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}], None, []])
    assert [json.loads(o) for o in out] == [[{"5": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}], None, []]


def test_a_running_completion_reports_the_string_none():
    assert finish_reasons(["", "length", "stop"]) == ["None", "length", "stop"]
