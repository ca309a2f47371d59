"""Prompts are tokenized on worker threads: the event loop never waits for a big
prompt, a small one is not held up behind it, and the byte limit's default is
derived from max_model_len."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmhost.backend.config import BackendSettings, ConfigError, parse_model_config
from llmhost.backend.errors import RequestError
from llmhost.backend.prompts import LARGE_PROMPT_BYTES, PromptEncoder, derived_prompt_bytes, longest_token_chars
from llmhost.backend.request import GenerateJob


class SlowTokenizer:
    """Encodes one token per character; a prompt starting with 'BIG' blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: set[str] = set()
        self.max_chars_per_token = 16

    def __deepcopy__(self, memo: dict) -> SlowTokenizer:
        return self  # shares the event; the encoder copies one per thread

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.add(threading.current_thread().name)
        if text.startswith("BIG"):
            assert self.release.wait(10)
        return [1] * len(text)

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        if messages[0]["content"] == "reject":
            raise ValueError('template error in "/usr/share/templates/chat.jinja"')
        return "".join(m["content"] for m in messages)


def job(prompt: str | None = None, messages: list[dict] | None = None) -> GenerateJob:
    text = prompt or "".join(m["content"] for m in messages or [])
    return GenerateJob(prompt=prompt, messages=messages, stream=False, exclude_input=False, sampling={},
                       prompt_bytes=len(text.encode()))


def test_small_prompt_overtakes_a_big_one():
    tok = SlowTokenizer()

    async def main() -> list[str]:
        enc = PromptEncoder(tok, max_model_len=10**7, threads=2)
        order: list[str] = []

        async def run(name: str, j: GenerateJob) -> None:
            await enc.encode(j)
            order.append(name)

        big = asyncio.create_task(run("big", job("BIG" + "x" * LARGE_PROMPT_BYTES)))
        await asyncio.sleep(0.05)  # the big one is being tokenized
        ticks = 0
        small = asyncio.create_task(run("small", job("hello")))
        while not small.done():  # the loop keeps running meanwhile
            ticks += 1
            await asyncio.sleep(0.001)
        assert ticks > 0
        tok.release.set()
        await big
        enc.close()
        return order

    assert asyncio.run(main()) == ["small", "big"]
    assert all(name.startswith("llmhost-tokenize-") for name in tok.threads)


def test_big_prompts_leave_one_thread_free():
    tok = SlowTokenizer()

    async def main() -> list[str]:
        enc = PromptEncoder(tok, max_model_len=10**7, threads=3)
        order: list[str] = []

        async def run(name: str, j: GenerateJob) -> None:
            await enc.encode(j)
            order.append(name)

        bigs = [asyncio.create_task(run(f"big{i}", job("BIG" + "x" * LARGE_PROMPT_BYTES))) for i in range(4)]
        await asyncio.sleep(0.05)
        await asyncio.wait_for(run("small", job("hi")), 5)
        tok.release.set()
        await asyncio.gather(*bigs)
        enc.close()
        return order

    assert asyncio.run(main())[0] == "small"


def test_errors_come_back_as_request_errors():
    tok = SlowTokenizer()

    async def main() -> None:
        enc = PromptEncoder(tok, max_model_len=10, threads=1)
        with pytest.raises(RequestError, match="prompt is 10 tokens; the model's max_model_len is 10"):
            await enc.encode(job("x" * 10))
        with pytest.raises(RequestError, match="chat template rejected 'messages'") as err:
            await enc.encode(job(messages=[{"role": "user", "content": "reject"}]))
        assert "/usr/" not in str(err.value)
        assert await enc.encode(job(messages=[{"role": "user", "content": "abc"}])) == [1, 1, 1]
        enc.close()

    asyncio.run(main())


def test_derived_limit():
    assert longest_token_chars(SlowTokenizer()) == 16
    assert longest_token_chars(object()) == 64
    assert derived_prompt_bytes(512, 16) == 512 * 16 * 4


def test_settings():
    assert (BackendSettings().max_prompt_bytes, BackendSettings().tokenizer_threads) == (0, 4)
    cfg = parse_model_config({"model": "/m", "llmhost": {"max_prompt_bytes": 8_000_000, "tokenizer_threads": 2}})
    assert (cfg.settings.max_prompt_bytes, cfg.settings.tokenizer_threads) == (8_000_000, 2)
    with pytest.raises(ConfigError, match=r"llmhost\.max_prompt_bytes must be >= 0"):
        parse_model_config({"model": "/m", "llmhost": {"max_prompt_bytes": -1}})
    with pytest.raises(ConfigError, match=r"llmhost\.tokenizer_threads must be >= 1"):
        parse_model_config({"model": "/m", "llmhost": {"tokenizer_threads": 0}})
    with pytest.raises(ConfigError, match=r"llmhost\.tokenizer_threads must be <= 64"):
        parse_model_config({"model": "/m", "llmhost": {"tokenizer_threads": 65}})


def test_token_ids_are_used_as_given_within_the_vocabulary_and_the_context():
    class Vocab(SlowTokenizer):
        def __len__(self) -> int:
            return 100

    async def main() -> None:
        enc = PromptEncoder(Vocab(), max_model_len=10, threads=1)
        ids_job = GenerateJob(prompt=None, messages=None, stream=False, exclude_input=True, sampling={},
                              prompt_token_ids=[0, 99, 5])
        assert await enc.encode(ids_job) == [0, 99, 5]
        ids_job.prompt_token_ids = [1, 100]
        with pytest.raises(RequestError, match=r"token id 100; the model's vocabulary has 100 tokens \(0-99\)"):
            await enc.encode(ids_job)
        ids_job.prompt_token_ids = [1] * 10
        with pytest.raises(RequestError, match="prompt is 10 tokens; the model's max_model_len is 10"):
            await enc.encode(ids_job)
        enc.close()

    asyncio.run(main())
