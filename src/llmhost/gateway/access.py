"""What every door of the gateway (``doors``: OpenAI's API, Triton's HTTP and gRPC
APIs, the admin API) shares: its settings and upstream pool, the API key of a request, and the
key's limits taken for the request's lifetime. In a worker process (``workers``) the
limits and the admin API's hold are the supervisor's, shared by every worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from llmhost.gateway.config import GatewayConfig
from llmhost.gateway.errors import model_not_found
from llmhost.gateway.keys import ApiKey, KeyStore
from llmhost.gateway.limits import KeyLimiter, RateLimited
from llmhost.gateway.record import RequestRecord, record_of
from llmhost.gateway.routing.pool import UpstreamPool
from llmhost.gateway.upstreams.request import BackendRequest

_ADMIN_FIELDS = ("target", "state", "held", "outstanding")
# The backend's sampling parameter that picks a LoRA adapter of the model.
LORA_NAME = "lora_name"


class Access:
    def __init__(self, config: GatewayConfig, keys: KeyStore, pool: UpstreamPool,
                 limiter: KeyLimiter | None = None) -> None:
        self.config = config
        self.keys = keys
        self.pool = pool
        self.limiter = limiter or KeyLimiter(default_max_concurrent=config.key_max_concurrent or None)
        self.shared: Any = None  # workers.SharedState, in a worker process


    def auth(self, request: Request) -> ApiKey:
        """The request's API key (401 without a known one), noted in its record."""
        return self.auth_header(request.headers.get("authorization"), record_of(request.scope))

    def auth_header(self, authorization: str | None, rec: RequestRecord) -> ApiKey:
        """The API key of an Authorization header's value (401 without a known one), noted in REC."""
        key = self.keys.authenticate(authorization)
        rec.key = key.name
        return key

    async def admit(self, request: Request, key: ApiKey, estimated_tokens: int) -> None:
        """Take the key's limits for this request (429 over one); given back when it ends."""
        await self.admit_record(record_of(request.scope), key, estimated_tokens)

    async def admit_record(self, rec: RequestRecord, key: ApiKey, estimated_tokens: int) -> None:
        """Take the key's limits for the request of REC; given back when REC is closed."""
        try:
            if self.shared is not None:
                lease = await self.shared.admit(key, estimated_tokens)
            else:
                lease = self.limiter.admit(key, estimated_tokens)
        except RateLimited as exc:
            rec.limited = exc.limit
            raise
        rec.cleanups.append(lambda r: lease.finish(r.used_tokens))

    async def upstreams(self) -> list[dict[str, Any]]:
        """Every upstream (as the admin API lists them): of every worker, where there are several."""
        rows = (await self.shared.upstreams())["upstreams"] if self.shared is not None else self.pool.view()
        return [{k: row[k] for k in _ADMIN_FIELDS} for row in rows]

    async def hold(self, target: str, held: bool) -> None:
        """Hold TARGET out of the pool or return it (on every worker); KeyError if unknown."""
        member = self.pool.member(target)
        if member is None:
            raise KeyError(target)
        if self.shared is not None:
            await self.shared.hold(target, held)
        else:
            await self.pool.hold(member, held)

    async def served_as(self, key: ApiKey, name: str) -> tuple[str, str | None]:
        """The served model that NAME stands for, and the LoRA adapter of it that NAME is
        (None: the model itself). A name KEY may not use does not exist to it (404): an
        adapter is in a key's scope only by its own name, not by its base model's."""
        if name in self.config.models:
            if key.may_use(name):
                return name, None
            raise model_not_found(name)
        base = await self.pool.adapter_base(name)
        if base is None or not key.may_use(name):
            raise model_not_found(name)
        return base, name

    async def to_served_model(self, key: ApiKey, req: BackendRequest) -> None:
        """Point REQ at the served model its ``model`` names; a LoRA adapter's name
        becomes its base model and the backend's sampling parameter ``lora_name``; the
        answer still names the adapter, as vLLM's server's does."""
        req.model, adapter = await self.served_as(key, req.model)
        if adapter is not None:
            req.sampling[LORA_NAME] = adapter
            req.answer_model = adapter

    def note_upstream(self, request: Request) -> Callable[[str], None]:
        """A callback that notes, in the request's record, the upstream that serves it."""
        rec = record_of(request.scope)

        def note(target: str) -> None:
            rec.upstream = target

        return note
