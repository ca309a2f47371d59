from __future__ import annotations

from llmhost.backend.coalesce import coalesce
from llmhost.backend.engine import Chunk


def chunk(text: str, count: int, final: bool = False, reason: str = "") -> Chunk:
    return Chunk([text], [reason], 5, [count], final)


def test_merges_pending_steps_of_one_stream_in_order():
    a, b = object(), object()
    items = [("chunk", a, chunk("x", 1)), ("chunk", b, chunk("p", 1)), ("chunk", a, chunk("y", 2)),
             ("track", a, "id"), ("chunk", a, chunk("z", 3, final=True, reason="length")),
             ("chunk", b, chunk("q", 2))]
    out = coalesce(items)
    assert [(k, s is a) for k, s, _ in out] == [("chunk", True), ("chunk", False), ("track", True)]
    merged_a = out[0][2]
    assert merged_a.texts == ["xyz"] and merged_a.num_output_tokens == [3]
    assert merged_a.final and merged_a.finish_reasons == ["length"]
    assert out[1][2].texts == ["pq"] and not out[1][2].final


def test_nothing_merges_past_a_final_or_an_error():
    a = object()
    items = [("chunk", a, chunk("x", 1, final=True)), ("chunk", a, chunk("late", 2))]
    assert [p.texts for _, _, p in coalesce(items)] == [["x"], ["late"]]
    items = [("chunk", a, chunk("x", 1)), ("error", a, "boom"), ("chunk", a, chunk("y", 2))]
    out = coalesce(items)
    assert [k for k, _, _ in out] == ["chunk", "error", "chunk"]


def test_n_completions_merge_per_index():
    a = object()
    c1 = Chunk(["a", ""], ["", ""], 3, [1, 0], False)
    c2 = Chunk(["b", "c"], ["", "stop"], 3, [2, 1], False)
    (_, _, merged), = coalesce([("chunk", a, c1), ("chunk", a, c2)])
    assert merged.texts == ["ab", "c"] and merged.finish_reasons == ["", "stop"]
    assert merged.num_output_tokens == [2, 1]
