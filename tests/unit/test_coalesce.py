from __future__ import annotations

from types import SimpleNamespace

from llmhost.backend.coalesce import StreamWindow, coalesce
from llmhost.backend.engine import Chunk


def chunk(text: str, count: int, final: bool = False, reason: str = "") -> Chunk:
    """A response of COUNT new tokens (per response, as vllm_backend counts them)."""
    return Chunk([text], [reason], 5, [count], final)


def test_merges_pending_steps_of_one_stream_in_order():
    a, b = object(), object()
    items = [("chunk", a, chunk("x", 1)), ("chunk", b, chunk("p", 1)), ("chunk", a, chunk("y", 2)),
             ("track", a, "id"), ("chunk", a, chunk("z", 3, final=True, reason="length")),
             ("chunk", b, chunk("q", 2))]
    out = coalesce(items)
    assert [(k, s is a) for k, s, _ in out] == [("chunk", True), ("chunk", False), ("track", True)]
    merged_a = out[0][2]
    assert merged_a.texts == ["xyz"] and merged_a.num_output_tokens == [1 + 2 + 3]
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
    c2 = Chunk(["b", "c"], ["", "stop"], 3, [1, 1], False)
    (_, _, merged), = coalesce([("chunk", a, c1), ("chunk", a, c2)])
    assert merged.texts == ["ab", "c"] and merged.finish_reasons == ["", "stop"]
    assert merged.num_output_tokens == [2, 1]


def test_window_sends_first_and_final_at_once_and_holds_the_rest_until_the_tick():
    a = object()
    w = StreamWindow(0.020)
    assert not w.ticking
    assert [p.texts for _, _, p in w.admit([("chunk", a, chunk("x", 1))])] == [["x"]]
    assert w.ticking  # an open stream: the sending thread must tick
    assert w.admit([("chunk", a, chunk("y", 2))]) == []
    assert w.admit([("chunk", a, chunk("z", 3))]) == []
    (_, sink, merged), = w.flush()
    assert sink is a and merged.texts == ["yz"] and merged.num_output_tokens == [2 + 3]
    assert w.flush() == []
    w.admit([("chunk", a, chunk("u", 4))])
    (_, _, last), = w.admit([("chunk", a, chunk("v", 5, final=True, reason="length"))])
    assert last.texts == ["uv"] and last.final and last.finish_reasons == ["length"]
    assert w.held == {} and w.started == {} and not w.ticking


def test_window_keeps_streams_apart_and_order_of_other_items():
    a, b = object(), object()
    w = StreamWindow(0.05)
    w.admit([("chunk", a, chunk("a1", 1)), ("chunk", b, chunk("b1", 1))])
    out = w.admit([("chunk", a, chunk("a2", 2)), ("track", b, "id"), ("chunk", b, chunk("b2", 2)),
                   ("chunk", a, chunk("a3", 3))])
    assert [k for k, _, _ in out] == ["track"]
    texts = {id(s): p.texts for _, s, p in w.flush()}
    assert texts == {id(a): ["a2a3"], id(b): ["b2"]}


def test_window_sends_held_text_before_an_error_and_flushes_on_stop():
    a, b = object(), object()
    w = StreamWindow(1.0)
    w.admit([("chunk", a, chunk("a1", 1)), ("chunk", a, chunk("a2", 2)),
             ("chunk", b, chunk("b1", 1)), ("chunk", b, chunk("b2", 2))])
    out = w.admit([("error", a, "engine error")])
    assert [(k, p if k == "error" else p.texts) for k, _, p in out] == [("chunk", ["a2"]), ("error", "engine error")]
    (_, sink, rest), = w.flush()
    assert sink is b and rest.texts == ["b2"]
    assert w.held == {}


def test_no_window_holds_nothing_and_never_ticks():
    a = object()
    w = StreamWindow(0.0)
    out = w.admit([("chunk", a, chunk("x", 1))]) + w.admit([("chunk", a, chunk("y", 2))])
    assert [p.texts for _, _, p in out] == [["x"], ["y"]] and w.held == {}
    assert not w.ticking


def test_forget_drops_a_streams_state():
    a = object()
    w = StreamWindow(1.0)
    w.admit([("chunk", a, chunk("x", 1)), ("chunk", a, chunk("y", 2))])
    w.forget(a)
    assert w.held == {} and w.started == {}
    # A stream the window does not know yet is sent at once.
    assert len(w.admit([("chunk", a, chunk("z", 3))])) == 1


def test_hold_back_puts_unsent_chunks_ahead_of_newer_ones():
    a, b = object(), object()
    w = StreamWindow(1.0)
    w.admit([("chunk", a, chunk("a1", 1)), ("chunk", b, chunk("b1", 1))])
    w.admit([("chunk", a, chunk("a2", 2)), ("chunk", b, chunk("b2", 2))])
    flushed = w.flush()
    # a2 went out; b2 did not before a newer b3 arrived.
    w.admit([("chunk", b, chunk("b3", 3))])
    w.hold_back(flushed[1:])
    (_, sink, merged), = w.flush()
    assert sink is b and merged.texts == ["b2b3"] and merged.num_output_tokens == [2 + 3]
    # A final after a hold-back leaves at once, with what was held before it.
    w.admit([("chunk", a, chunk("a3", 3))])
    w.hold_back(w.flush())
    (_, _, last), = w.admit([("chunk", a, chunk("a4", 4, final=True))])
    assert last.texts == ["a3a4"] and last.final


def test_merged_steps_keep_each_outputs_per_response_meaning():
    a = object()
    top = {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}
    c1 = Chunk(["x", ""], ["", ""], 3, [1, 0], False, cumulative_logprobs=[-0.5, -1.0], logprobs=[[top], []])
    c2 = Chunk(["y", "z"], ["", "stop"], 3, [1, 1], False, cumulative_logprobs=[-0.75, None], logprobs=[[top], [top]])
    (_, _, merged), = coalesce([("chunk", a, c1), ("chunk", a, c2)])
    assert merged.num_output_tokens == [2, 1]  # the tokens of both steps
    assert merged.logprobs == [[top, top], [top]]  # one position per token
    assert merged.cumulative_logprobs == [-0.75, -1.0]  # the latest known
    nulls = Chunk(["x"], [""], 3, [1], False, logprobs=[None])
    (_, _, merged), = coalesce([("chunk", a, nulls), ("chunk", a, nulls)])
    assert merged.logprobs == [None]  # not asked of vLLM: still null


def test_a_streams_own_window_overrides_the_default():
    grouped, per_step = SimpleNamespace(window_s=1.0), SimpleNamespace(window_s=0.0)
    w = StreamWindow(0.0)  # the model's default: no window
    w.admit([("chunk", grouped, chunk("g1", 1)), ("chunk", per_step, chunk("p1", 1))])
    assert w.ticking
    out = w.admit([("chunk", grouped, chunk("g2", 1)), ("chunk", per_step, chunk("p2", 1))])
    assert [(s is per_step, p.texts) for _, s, p in out] == [(True, ["p2"])]  # only the grouped one waits
    due = w.next_due()
    assert due is not None
    assert w.flush_due(due - 0.5) == []  # its window has not passed
    (_, sink, held), = w.flush_due(due)
    assert sink is grouped and held.texts == ["g2"]
    w.admit([("chunk", grouped, chunk("g3", 1, final=True))])
    assert not w.ticking  # the grouped stream ended
    # A stream may also turn the model's window off for itself.
    w = StreamWindow(1.0)
    w.admit([("chunk", per_step, chunk("p1", 1))])
    assert len(w.admit([("chunk", per_step, chunk("p2", 1))])) == 1 and not w.ticking
