"""A chat's chat_template_kwargs and reasoning_effort reach the chat template as vLLM's
server passes them (vLLM's own resolve_chat_template_kwargs): what the template reads
is passed, the rest dropped, 'chat_template' and 'tokenize' refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmhost.backend.errors import RequestError
from llmhost.backend.prompts import template_kwargs
from llmhost.backend.request import GenerateJob, parse_chat_options

TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[no thinking]{% endif %}"
            "{% if reasoning_effort is defined and reasoning_effort %}[effort {{ reasoning_effort }}]{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    tok.chat_template = TEMPLATE
    return tok


def _job(**params: object) -> GenerateJob:
    kwargs, effort, include = parse_chat_options(dict(params))
    return GenerateJob(prompt="", messages=[{"role": "user", "content": "hi"}], stream=False, exclude_input=True,
                       sampling={}, chat_template_kwargs=kwargs, reasoning_effort=effort,
                       include_reasoning=include is not False)


def _render(tok, job: GenerateJob) -> str:  # type: ignore[no-untyped-def]
    return tok.apply_chat_template(job.messages, tokenize=False, add_generation_prompt=True,
                                   **template_kwargs(tok, job))


@pytest.mark.parametrize(("params", "rendered"), [
    ({}, "hi"),
    ({"chat_template_kwargs": {"enable_thinking": False, "unknown_to_it": 1}}, "hi[no thinking]"),
    ({"reasoning_effort": "low"}, "hi[effort low]"),
    # Effort "none" turns thinking off, unless the client says otherwise.
    ({"reasoning_effort": "none"}, "hi[no thinking][effort none]"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "hi[effort none]"),
    # The call's own arguments stay the server's.
    ({"chat_template_kwargs": {"add_generation_prompt": False, "return_dict": True}}, "hi"),
])
def test_what_the_template_sees(tokenizer, params, rendered):
    assert _render(tokenizer, _job(**params)) == rendered


@pytest.mark.parametrize(("params", "needle"), [
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
])
def test_refused_template_arguments_name_the_field(tokenizer, params, needle):
    with pytest.raises(RequestError, match=needle):
        template_kwargs(tokenizer, _job(**params))


@pytest.mark.parametrize(("params", "needle"), [
    ({"chat_template_kwargs": ["x"]}, "'chat_template_kwargs' must be a JSON object"),
    ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of none, minimal"),
    ({"include_reasoning": "no"}, "include_reasoning"),
])
def test_bad_values_are_refused_by_name(params, needle):
    with pytest.raises(RequestError, match=needle):
        parse_chat_options(dict(params))
