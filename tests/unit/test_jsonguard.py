"""The JSON depth guard: measured without parsing, equal to the parsed depth, and
a clean RequestError (never RecursionError) for any depth."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmhost.backend.errors import RequestError
from llmhost.backend.jsonguard import check_depth, loads, nesting_depth


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\ab\x01é😀', max_size=8)
values = st.recursive(st.one_of(st.none(), st.integers(), tricky_text),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
                      max_leaves=20)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(value=values, ascii_only=st.booleans())
def test_depth_equals_parsed_depth(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert nesting_depth(text) == depth(value)
    assert nesting_depth(text.encode()) == depth(value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", 0), ("1", 0), ("[]", 1), ('"[[["', 0), ('["\\"[["]', 1), ('["\\\\", [[]]]', 3),
     ('{"a": [{"b": "]]]"}]}', 3), ("[" * 100_000, 100_000), ("[]," * 10_000, 1)],
)
def test_examples(text, expected):
    assert nesting_depth(text) == expected


@pytest.mark.parametrize("text", ["[" * 100_000, "[" * 100_000 + "]" * 100_000, '{"a":' * 100_000])
def test_deep_text_is_a_clean_error(text):
    with pytest.raises(RequestError, match="input 'x' nests arrays/objects 100000 levels deep; at most 100"):
        loads(text, "input 'x'")


def test_limit_and_other_errors():
    assert loads("[" * 100 + "]" * 100, "x") is not None
    check_depth("[" * 5 + "]" * 5, "x", max_depth=5)
    with pytest.raises(RequestError, match="x nests arrays/objects 6 levels deep; at most 5"):
        check_depth("[" * 6 + "]" * 6, "x", max_depth=5)
    with pytest.raises(RequestError, match="x is not valid JSON: Expecting value at position 1"):
        loads("[", "x")
    with pytest.raises(RequestError, match="x is not acceptable JSON: Exceeds the limit"):
        loads("1" * 5000, "x")
