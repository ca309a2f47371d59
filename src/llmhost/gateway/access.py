"""What both of the gateway's doors (the OpenAI API in ``app``, Triton's native API in
``native``) share: its settings and upstream pool, the API key of a request, and the
key's limits taken for the request's lifetime."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.keys import ApiKey, KeyStore
from llmhost.gateway.limits import KeyLimiter, RateLimited
from llmhost.gateway.pool import UpstreamPool
from llmhost.gateway.record import record_of


class Access:
    def __init__(self, config: GatewayConfig, keys: KeyStore, pool: UpstreamPool,
                 limiter: KeyLimiter | None = None) -> None:
        self.config = config
        self.keys = keys
        self.pool = pool
        self.limiter = limiter or KeyLimiter(default_max_concurrent=config.key_max_concurrent or None)

    def auth(self, request: Request) -> ApiKey:
        """The request's API key (401 without a known one), noted in its record."""
        key = self.keys.authenticate(request.headers.get("authorization"))
        record_of(request.scope).key = key.name
        return key

    def admit(self, request: Request, key: ApiKey, estimated_tokens: int) -> None:
        """Take the key's limits for this request (429 over one); given back when it ends."""
        rec = record_of(request.scope)
        try:
            lease = self.limiter.admit(key, estimated_tokens)
        except RateLimited as exc:
            rec.limited = exc.limit
            raise
        rec.cleanups.append(lambda r: lease.finish(r.used_tokens))

    def note_upstream(self, request: Request) -> Callable[[str], None]:
        """A callback that notes, in the request's record, the upstream that serves it."""
        rec = record_of(request.scope)

        def note(target: str) -> None:
            rec.upstream = target

        return note
