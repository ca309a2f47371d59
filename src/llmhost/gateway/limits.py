"""Per-key limits: requests per minute and tokens per minute (token buckets) and
requests in flight.

Each bucket holds up to a minute's allowance and refills continuously (``rpm``/60
per second). A request takes one ``rpm`` token and, up front, its estimated tokens
from ``tpm`` (``max_tokens`` times ``n``, plus nothing for the prompt, which is not
tokenized here); when it ends, the bucket is corrected to what it really used
(prompt plus completion tokens). A bucket may so go below zero: later requests
then wait until it has refilled. An estimate above the whole allowance is
charged as the whole allowance, so a large request can still pass on a full bucket.

Over a limit: 429 with ``Retry-After``: when the bucket will hold enough again
(rounded up to whole seconds), or 1 s for ``max_concurrent``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmhost.gateway.errors import ApiError, rate_limited
from llmhost.gateway.keys import ApiKey

Clock = Callable[[], float]


class TokenBucket:
    """``capacity`` tokens, refilled at ``capacity / period_s`` per second."""

    def __init__(self, capacity: int, period_s: float = 60.0, clock: Clock = time.monotonic) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / period_s
        self.clock = clock
        self.tokens = float(capacity)
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, n: float) -> float:
        """Seconds until N tokens are there (0: now). Takes nothing."""
        self._refill()
        n = min(n, self.capacity)
        return 0.0 if self.tokens >= n else (n - self.tokens) / self.rate

    def take(self, n: float) -> None:
        """Take N tokens (at most the capacity); the balance may go below zero."""
        self._refill()
        self.tokens -= min(n, self.capacity)

    def give_back(self, n: float) -> None:
        """Return N tokens (negative: take more), never above the capacity."""
        self._refill()
        self.tokens = min(self.capacity, self.tokens + n)


@dataclass
class Lease:
    """One admitted request: ``finish`` (once) frees its concurrency slot and settles
    its token charge with the tokens it really used."""

    limiter: KeyLimiter
    key: str
    charged: float
    done: bool = False

    def finish(self, used_tokens: int | None) -> None:
        if self.done:
            return
        self.done = True
        self.limiter._finish(self, used_tokens)


class _KeyState:
    def __init__(self, key: ApiKey, clock: Clock, default_max_concurrent: int | None) -> None:
        self.rpm = TokenBucket(key.rpm, clock=clock) if key.rpm else None
        self.tpm = TokenBucket(key.tpm, clock=clock) if key.tpm else None
        self.max_concurrent = key.max_concurrent if key.max_concurrent is not None else default_max_concurrent
        self.in_flight = 0


class RateLimited(ApiError):
    """A 429; ``limit`` names the limit for the metrics: rpm, tpm or max_concurrent."""

    def __init__(self, limit: str, message: str, kind: str, retry_s: float) -> None:
        err = rate_limited(message, kind, retry_s)
        super().__init__(err.status, err.message, err.type, err.param, err.code, err.headers)
        self.limit = limit

    @classmethod
    def of(cls, limit: str, err: ApiError) -> RateLimited:
        """The refusal ERR (as another process's KeyLimiter made it) for LIMIT."""
        exc = cls.__new__(cls)
        ApiError.__init__(exc, err.status, err.message, err.type, err.param, err.code, err.headers)
        exc.limit = limit
        return exc


class KeyLimiter:
    """The limits of every key, by key name (state lives as long as the process). A key
    without a max_concurrent of its own gets DEFAULT_MAX_CONCURRENT (None: no bound)."""

    def __init__(self, clock: Clock = time.monotonic, default_max_concurrent: int | None = None) -> None:
        self.clock = clock
        self.default_max_concurrent = default_max_concurrent
        self._keys: dict[str, _KeyState] = {}

    def _state(self, key: ApiKey) -> _KeyState:
        state = self._keys.get(key.name)
        if state is None:
            state = self._keys[key.name] = _KeyState(key, self.clock, self.default_max_concurrent)
        return state

    def admit(self, key: ApiKey, estimated_tokens: int) -> Lease:
        """A lease for one request of KEY, or RateLimited (nothing taken then)."""
        state = self._state(key)
        if state.max_concurrent is not None and state.in_flight >= state.max_concurrent:
            raise RateLimited("max_concurrent", f"Rate limit reached for API key '{key.name}' on concurrent "
                              f"requests: Limit {state.max_concurrent}, in flight {state.in_flight}. Please "
                              "try again when one of them has finished.", "requests", 1)
        if state.rpm is not None:
            wait = state.rpm.wait_s(1)
            if wait > 0:
                raise RateLimited("rpm", f"Rate limit reached for API key '{key.name}' on requests per min "
                                  f"(RPM): Limit {key.rpm}. Please try again in {wait:.1f}s.", "requests", wait)
        if state.tpm is not None:
            wait = state.tpm.wait_s(estimated_tokens)
            if wait > 0:
                raise RateLimited("tpm", f"Rate limit reached for API key '{key.name}' on tokens per min "
                                  f"(TPM): Limit {key.tpm}, Requested {estimated_tokens} (max_tokens). Please "
                                  f"try again in {wait:.1f}s.", "tokens", wait)
        if state.rpm is not None:
            state.rpm.take(1)
        charged = 0.0
        if state.tpm is not None:
            charged = min(float(estimated_tokens), state.tpm.capacity)
            state.tpm.take(charged)
        state.in_flight += 1
        return Lease(self, key.name, charged)

    def _finish(self, lease: Lease, used_tokens: int | None) -> None:
        state = self._keys[lease.key]
        state.in_flight -= 1
        if state.tpm is not None and used_tokens is not None:
            state.tpm.give_back(lease.charged - used_tokens)
