"""The upstream pool: several Triton servers, health-checked, least outstanding first.

- A background check (every ``interval_s``) asks each upstream ``ModelReady`` for every
  served model (each call with ``timeout_s``): unreachable -> down; otherwise its
  ready models are what it may be sent. A check that times out (a busy server answers
  late) takes it out only after ``unhealthy_threshold`` such checks in a row.
- Per request the pool picks, among upstreams where the model is ready, the one with
  the fewest requests outstanding. At most ``max_concurrent`` requests are in flight on
  one upstream; beyond that a request waits in a queue of at most ``max_queue``
  requests for up to ``queue_timeout_s``, then gets 503 with ``Retry-After``. A full
  queue, or no upstream where the model is ready, is 503 at once.
- A call that fails with UNAVAILABLE (unreachable, stream dropped) marks that upstream
  down; a backend answer that it is shutting down or its engine stopped (upstream.classify,
  or the engine socket's ``unavailable`` kind) takes it out (draining) until a health
  check passes again. Either way, when nothing of the answer
  was produced yet, the request is tried once more on another ready upstream; never
  after a response went to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from llmhost.gateway.errors import ApiError, unavailable
from llmhost.gateway.upstream import Draining, UpstreamDown

T = TypeVar("T")


class Client(Protocol):
    """What the pool needs of one upstream (``upstream.Upstream`` or a test's fake)."""

    async def model_ready(self, model: str) -> bool: ...


@dataclass
class Member:
    target: str
    client: Any
    checked: bool = False
    reachable: bool = False
    draining: bool = False
    ready: set[str] = field(default_factory=set)
    outstanding: int = 0
    timeouts: int = 0  # health checks in a row that timed out

    def serves(self, model: str) -> bool:
        return self.reachable and not self.draining and model in self.ready

    @property
    def up(self) -> bool:
        """Routable: reachable, not draining, at least one served model ready."""
        return self.reachable and not self.draining and bool(self.ready)


@dataclass
class PoolSettings:
    max_concurrent: int = 1024
    max_queue: int = 512
    queue_timeout_s: float = 30.0
    interval_s: float = 2.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 3


class UpstreamPool:
    def __init__(self, members: list[tuple[str, Any]], models: list[str],
                 settings: PoolSettings | None = None) -> None:
        if not members:
            raise ValueError("an upstream pool needs at least one upstream")
        self.members = [Member(target, client) for target, client in members]
        self.models = list(models)
        self.settings = settings or PoolSettings()
        self.waiting = 0
        self._changed = asyncio.Condition()

    # --- health -----------------------------------------------------------------

    async def _ready(self, member: Member, model: str) -> bool:
        call = member.client.model_ready(model)
        return bool(await asyncio.wait_for(call, self.settings.timeout_s))

    async def check_member(self, member: Member) -> None:
        ready: set[str] = set()
        reachable = True
        for model in self.models:
            try:
                if await self._ready(member, model):
                    ready.add(model)
            except TimeoutError:
                member.timeouts += 1
                if member.checked and member.reachable and member.timeouts < self.settings.unhealthy_threshold:
                    return  # late under load: keep it as it was until the threshold
                reachable = False
                break
            except (UpstreamDown, OSError):
                reachable = False
                break
            except ApiError:
                continue
            except Exception:  # noqa: BLE001 - anything else unexpected: down, and the checks go on
                reachable = False
                break
        if reachable:
            member.timeouts = 0
        member.checked, member.reachable = True, reachable
        member.ready = ready if reachable else set()
        if reachable and ready:  # the check passed: a draining upstream is back
            member.draining = False
        await self._notify()

    async def check(self) -> None:
        """Check every upstream once (concurrently)."""
        await asyncio.gather(*(self.check_member(m) for m in self.members))

    async def _ensure_checked(self) -> None:
        unchecked = [m for m in self.members if not m.checked]
        if unchecked:
            await asyncio.gather(*(self.check_member(m) for m in unchecked))

    async def run_health_checks(self) -> None:
        """Forever: check every upstream, then sleep ``interval_s``."""
        while True:
            await self.check()
            await asyncio.sleep(self.settings.interval_s)

    def mark_down(self, member: Member) -> None:
        member.reachable = False
        member.ready = set()

    def mark_draining(self, member: Member) -> None:
        member.draining = True

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- what is served ---------------------------------------------------------------

    async def ready_models(self) -> list[str]:
        """The served models ready on at least one upstream."""
        await self._ensure_checked()
        return [m for m in self.models if any(member.serves(m) for member in self.members)]

    async def model_ready(self, model: str) -> bool:
        return model in await self.ready_models()

    def snapshot(self) -> list[tuple[str, bool, int]]:
        """(target, up, outstanding) per upstream, for the metrics."""
        return [(m.target, m.up, m.outstanding) for m in self.members]

    async def call(self, model: str, fn: Callable[[Any], Any]) -> Any:
        """FN(client) on the least busy upstream where MODEL is ready (no slot taken:
        for metadata)."""
        await self._ensure_checked()
        ready = [m for m in self.members if m.serves(model)]
        if not ready:
            raise self._none_ready(model)
        member = min(ready, key=lambda m: m.outstanding)
        try:
            return await fn(member.client)
        except UpstreamDown:
            self.mark_down(member)
            raise

    # --- routing ----------------------------------------------------------------------------

    def _none_ready(self, model: str) -> ApiError:
        return unavailable(f"no healthy upstream serves model '{model}' now; retry shortly", "no_healthy_upstream",
                           self.settings.interval_s)

    def _free(self, model: str, exclude: set[str]) -> Member | None:
        ready = [m for m in self.members if m.serves(model) and m.target not in exclude
                 and m.outstanding < self.settings.max_concurrent]
        return min(ready, key=lambda m: m.outstanding) if ready else None

    async def acquire(self, model: str, exclude: set[str] | frozenset[str] = frozenset()) -> Member:
        """A slot on the least busy upstream where MODEL is ready, waiting in the queue
        when all are full; 503 (with Retry-After) when none serves it, the queue is
        full, or the wait is over."""
        await self._ensure_checked()
        exclude = set(exclude)
        if not any(m.serves(model) and m.target not in exclude for m in self.members):
            raise self._none_ready(model)
        member = self._free(model, exclude)
        if member is None:
            if self.waiting >= self.settings.max_queue:
                raise unavailable(f"the gateway is at capacity ({self.settings.max_queue} requests waiting); retry "
                                  "shortly", "queue_full", 1)
            member = await self._wait(model, exclude)
        member.outstanding += 1
        return member

    async def _wait(self, model: str, exclude: set[str]) -> Member:
        self.waiting += 1
        deadline = time.monotonic() + self.settings.queue_timeout_s
        try:
            async with self._changed:
                while True:
                    member = self._free(model, exclude)
                    if member is not None:
                        return member
                    if not any(m.serves(model) and m.target not in exclude for m in self.members):
                        raise self._none_ready(model)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise unavailable(f"no upstream had room for this request within "
                                          f"{self.settings.queue_timeout_s:g} s; retry shortly", "queue_timeout", 1)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), left)
        finally:
            self.waiting -= 1

    async def release(self, member: Member) -> None:
        member.outstanding -= 1
        await self._notify()

    async def stream(self, model: str, open_call: Callable[[Any], AsyncIterator[T]],
                     note: Callable[[str], None] | None = None) -> AsyncIterator[T]:
        """The items of OPEN_CALL(client) on a picked upstream, holding its slot until
        the iteration ends; retried once on another upstream when it failed as down
        or draining before its first item."""
        tried: set[str] = set()
        last: ApiError | None = None
        while True:
            try:
                member = await self.acquire(model, tried)
            except ApiError:
                if last is not None:  # no other upstream to retry on: the first failure
                    raise last from None
                raise
            tried.add(member.target)
            if note is not None:
                note(member.target)
            produced = False
            try:
                # aclosing: a consumer that stops early cancels the upstream call now.
                async with contextlib.aclosing(open_call(member.client)) as items:
                    async for item in items:
                        produced = True
                        yield item
                return
            except (UpstreamDown, Draining) as exc:
                if isinstance(exc, Draining):
                    self.mark_draining(member)
                else:
                    self.mark_down(member)
                if produced or len(tried) > 1:
                    raise
                last = exc
            finally:
                await self.release(member)
