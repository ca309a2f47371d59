from __future__ import annotations

from llmhost.backend.coalesce import StreamWindow, coalesce
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


def test_window_sends_first_and_final_at_once_and_holds_the_rest():
    a = object()
    w = StreamWindow(0.020)
    assert [p.texts for _, _, p in w.admit([("chunk", a, chunk("x", 1))], now=0.0)] == [["x"]]
    assert w.admit([("chunk", a, chunk("y", 2))], now=0.001) == []
    assert w.admit([("chunk", a, chunk("z", 3))], now=0.015) == []
    assert w.next_due() == 0.021
    assert w.due(0.020) == []
    (_, sink, merged), = w.due(0.021)
    assert sink is a and merged.texts == ["yz"] and merged.num_output_tokens == [3]
    assert w.next_due() is None
    w.admit([("chunk", a, chunk("u", 4))], now=0.03)
    (_, _, last), = w.admit([("chunk", a, chunk("v", 5, final=True, reason="length"))], now=0.031)
    assert last.texts == ["uv"] and last.final and last.finish_reasons == ["length"]
    assert w.held == {} and w.started == {}


def test_window_keeps_streams_apart_and_order_of_other_items():
    a, b = object(), object()
    w = StreamWindow(0.05)
    w.admit([("chunk", a, chunk("a1", 1)), ("chunk", b, chunk("b1", 1))], now=0.0)
    out = w.admit([("chunk", a, chunk("a2", 2)), ("track", b, "id"), ("chunk", b, chunk("b2", 2)),
                   ("chunk", a, chunk("a3", 3))], now=0.01)
    assert [k for k, _, _ in out] == ["track"]
    texts = {id(s): p.texts for _, s, p in w.due(0.07)}
    assert texts == {id(a): ["a2a3"], id(b): ["b2"]}


def test_window_sends_held_text_before_an_error_and_drains_on_stop():
    a, b = object(), object()
    w = StreamWindow(1.0)
    w.admit([("chunk", a, chunk("a1", 1)), ("chunk", a, chunk("a2", 2)),
             ("chunk", b, chunk("b1", 1)), ("chunk", b, chunk("b2", 2))], now=0.0)
    out = w.admit([("error", a, "engine error")], now=0.1)
    assert [(k, p if k == "error" else p.texts) for k, _, p in out] == [("chunk", ["a2"]), ("error", "engine error")]
    (_, sink, rest), = w.drain()
    assert sink is b and rest.texts == ["b2"]
    assert w.held == {} and w.next_due() is None


def test_no_window_holds_nothing():
    a = object()
    w = StreamWindow(0.0)
    out = w.admit([("chunk", a, chunk("x", 1))], now=0.0) + w.admit([("chunk", a, chunk("y", 2))], now=0.0)
    assert [p.texts for _, _, p in out] == [["x"], ["y"]] and w.held == {}


def test_forget_drops_a_streams_state():
    a = object()
    w = StreamWindow(1.0)
    w.admit([("chunk", a, chunk("x", 1)), ("chunk", a, chunk("y", 2))], now=0.0)
    w.forget(a)
    assert w.held == {} and w.started == {}
    # A stream the window does not know yet is sent at once.
    assert len(w.admit([("chunk", a, chunk("z", 3))], now=0.0)) == 1
