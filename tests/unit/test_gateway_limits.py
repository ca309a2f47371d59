"""Per-key limits: rpm and tpm token buckets (a fake clock), max_concurrent, the
429 OpenAI sends with Retry-After, and bad limits in the keys file named."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmhost.gateway.keys import ApiKey, KeysError, hash_key, parse_keys
from llmhost.gateway.limits import KeyLimiter, RateLimited, TokenBucket
from tests.unit._gateway_fakes import KEY, Fake, chat, client, keystore, make_app


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(**limits: int) -> ApiKey:
    return ApiKey("k", "0" * 64, **limits)


def test_bucket_refills_continuously_up_to_its_capacity():
    clock = Clock()
    bucket = TokenBucket(60, clock=clock)
    bucket.take(60)
    assert bucket.wait_s(1) == pytest.approx(1.0)
    clock.now += 30
    assert bucket.wait_s(30) == 0 and bucket.wait_s(31) == pytest.approx(1.0)
    clock.now += 1000
    assert bucket.tokens <= 60 and bucket.wait_s(60) == 0
    assert bucket.tokens == 60


def test_rpm_refuses_with_the_seconds_until_a_request_is_allowed():
    clock = Clock()
    limiter = KeyLimiter(clock)
    key = _key(rpm=2)
    limiter.admit(key, 0).finish(0)
    limiter.admit(key, 0).finish(0)
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 0)
    err = info.value
    assert err.status == 429 and err.limit == "rpm" and err.type == "requests" and err.code == "rate_limit_exceeded"
    assert err.headers == {"Retry-After": "30"}  # 1 request refills in 60/2 s
    clock.now += 29.5
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 0)
    assert info.value.headers == {"Retry-After": "1"}  # 0.5 s, rounded up
    clock.now += 0.5
    limiter.admit(key, 0)


def test_tpm_charges_the_estimate_and_settles_with_the_real_usage():
    clock = Clock()
    limiter = KeyLimiter(clock)
    key = _key(tpm=120)
    first = limiter.admit(key, 100)  # max_tokens up front: 20 left
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 50)
    assert info.value.limit == "tpm" and info.value.type == "tokens"
    assert info.value.headers == {"Retry-After": "15"}  # 30 tokens at 2 per second
    first.finish(10)  # it used 10: 90 come back, 110 left
    limiter.admit(key, 50).finish(200)  # 60 left, then used 150 more than charged: -90
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 1)
    assert info.value.headers == {"Retry-After": "46"}  # from -90 to 1: 91 tokens at 2 per second
    first.finish(0)  # a second finish changes nothing
    with pytest.raises(RateLimited):
        limiter.admit(key, 1)


def test_an_estimate_above_the_whole_allowance_passes_on_a_full_bucket():
    limiter = KeyLimiter(Clock())
    key = _key(tpm=100)
    limiter.admit(key, 10_000)  # a full bucket lets it through (else no such request could ever run)
    with pytest.raises(RateLimited) as info:  # and it emptied the bucket
        limiter.admit(key, 1)
    assert info.value.limit == "tpm"


def test_max_concurrent_counts_requests_in_flight():
    limiter = KeyLimiter(Clock())
    key = _key(max_concurrent=1)
    lease = limiter.admit(key, 0)
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 0)
    assert info.value.limit == "max_concurrent" and info.value.headers == {"Retry-After": "1"}
    lease.finish(None)
    limiter.admit(key, 0)


def test_a_refused_request_takes_nothing():
    limiter = KeyLimiter(Clock())
    key = _key(rpm=3, tpm=10, max_concurrent=5)
    limiter.admit(key, 10)
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 5)
    assert info.value.limit == "tpm"
    limiter.admit(key, 0)
    limiter.admit(key, 0)  # rpm 3: the refused request took none of it
    with pytest.raises(RateLimited) as info:  # and the three admitted took all of it
        limiter.admit(key, 0)
    assert info.value.limit == "rpm"


def test_keys_without_limits_are_unlimited():
    limiter = KeyLimiter(Clock())
    leases = [limiter.admit(_key(), 10_000) for _ in range(1000)]  # 1000 in flight at once, none refused
    assert [lease.charged for lease in leases] == [0.0] * 1000  # no tpm bucket: nothing charged up front
    assert limiter.admit(ApiKey("tpm", "1" * 64, tpm=100), 10_000).charged == 100  # a key with tpm is charged


def test_a_key_without_its_own_bound_gets_the_default_one():
    limiter = KeyLimiter(Clock(), default_max_concurrent=2)
    free, own = _key(), ApiKey("own", "1" * 64, max_concurrent=3)
    held = [limiter.admit(free, 0) for _ in range(2)]
    with pytest.raises(RateLimited) as info:
        limiter.admit(free, 0)
    assert info.value.limit == "max_concurrent" and "Limit 2" in info.value.message
    assert len([limiter.admit(own, 0) for _ in range(3)]) == 3  # a key's own bound wins over the default
    held[0].finish(None)
    limiter.admit(free, 0)


def test_limits_are_per_key():
    limiter = KeyLimiter(Clock())
    a, b = ApiKey("a", "0" * 64, rpm=1), ApiKey("b", "1" * 64, rpm=1)
    limiter.admit(a, 0)
    limiter.admit(b, 0)  # a's request took nothing of b's
    for key in (a, b):
        with pytest.raises(RateLimited) as info:
            limiter.admit(key, 0)
        assert info.value.limit == "rpm"


@pytest.mark.parametrize(("field", "value"), [("rpm", 0), ("tpm", "100"), ("max_concurrent", True), ("rpm", -1),
                                              ("tpm", 1.5)])
def test_bad_limits_in_the_keys_file_are_named(field, value):
    text = json.dumps({"keys": [{"name": "a", "sha256": hash_key(KEY), field: value}]})
    with pytest.raises(KeysError, match=rf"keys\[0\]\.{field} must be a positive integer"):
        parse_keys(text)


def test_limits_are_read_from_the_keys_file():
    key = parse_keys(f"keys: [{{name: a, sha256: {hash_key(KEY)}, rpm: 5, tpm: 600, max_concurrent: 2}}]")[0]
    assert (key.rpm, key.tpm, key.max_concurrent, key.max_tokens) == (5, 600, 2, None)


# --- through the app --------------------------------------------------------------

def test_the_app_answers_429_as_openai_with_retry_after():
    clock = Clock()
    fake = Fake()
    app = make_app(fake, keystore(rpm=1), limiter=KeyLimiter(clock))

    async def run() -> None:
        async with client(app) as c:
            assert (await c.post("/v1/chat/completions", content=chat())).status_code == 200
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 429 and r.headers["retry-after"] == "60"
            err = r.json()["error"]
            assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded" and "RPM" in err["message"]
            clock.now += 60
            assert (await c.post("/v1/chat/completions", content=chat())).status_code == 200

    asyncio.run(run())
    assert fake.calls == 2  # the 429 never reached the upstream


def test_the_app_refunds_tokens_with_the_real_usage():
    clock = Clock()
    app = make_app(Fake(), keystore(tpm=100), limiter=KeyLimiter(clock))

    async def run() -> None:
        async with client(app) as c:
            # 60 charged up front each; the fake uses 3 prompt + 4 completion tokens: 86 left.
            assert (await c.post("/v1/chat/completions", content=chat(max_tokens=60))).status_code == 200
            assert (await c.post("/v1/chat/completions", content=chat(max_tokens=60, stream=True))).status_code == 200
            assert (await c.post("/v1/chat/completions", content=chat(max_tokens=85))).status_code == 200
            r = await c.post("/v1/chat/completions", content=chat(max_tokens=80))  # 79 left
            assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"

    asyncio.run(run())


@pytest.mark.parametrize(("key_limits", "key_max_concurrent"), [({"max_concurrent": 1}, 512), ({}, 1)],
                         ids=["its own bound", "the gateway's default bound"])
def test_the_app_limits_concurrent_streams_of_a_key(key_limits, key_max_concurrent):
    from llmhost.gateway.config import GatewayConfig

    fake = Fake()
    fake.gate = asyncio.Event()
    config = GatewayConfig(upstreams=["up:1"], models=["m"], max_body_bytes=4096,
                           key_max_concurrent=key_max_concurrent)
    app = make_app(fake, keystore(**key_limits), config=config)

    async def run() -> None:
        async with client(app) as c:
            first = asyncio.ensure_future(c.post("/v1/chat/completions", content=chat(stream=True)))
            while fake.started == 0:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/chat/completions", content=chat())
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert "concurrent requests: Limit 1" in r.json()["error"]["message"]
            fake.gate.set()
            assert (await first).status_code == 200
            assert (await c.post("/v1/chat/completions", content=chat())).status_code == 200

    asyncio.run(run())


def test_the_default_per_key_bound_is_512():
    from llmhost.gateway.config import GatewayConfig

    assert GatewayConfig().key_max_concurrent == 512


def test_the_up_front_charge_counts_the_prompt_too():
    from llmhost.gateway.doors.openai.api import _estimate
    from llmhost.gateway.doors.openai.mapping import parse_body, to_backend

    def req(**body: object):  # type: ignore[no-untyped-def]
        chat = "messages" in body
        return to_backend(parse_body(json.dumps({"model": "m", "max_tokens": 10, **body}).encode(), chat))

    assert _estimate(req(prompt="a" * 400)) == 100 + 10
    assert _estimate(req(prompt=[1, 2, 3], n=2)) == 3 + 2 * 10
    assert _estimate(req(prompt=["a" * 8, "b" * 4])) == 2 + 1 + 2 * 10
    assert _estimate(req(messages=[{"role": "user", "content": "é" * 200}])) == 100 + 10
    # A key's tokens per minute: a long prompt in flight leaves no room for the next request.
    limiter = KeyLimiter(Clock())
    key = _key(tpm=1000)
    limiter.admit(key, _estimate(req(prompt="x" * 3600)))
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, _estimate(req(prompt="y" * 400)))  # 110: more than the 90 left, though max_tokens is 10
    assert info.value.limit == "tpm"
