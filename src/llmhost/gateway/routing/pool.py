"""The upstream pool: several Triton servers, health-checked, least outstanding first.

- A background check (every ``interval_s``) asks each upstream ``ModelReady`` for every
  served model (each call with ``timeout_s``). An upstream in service is taken out after
  ``unhealthy_threshold`` failed checks in a row (timed out, or unreachable), and one
  that is out comes back after ``healthy_threshold`` passed checks in a row, so that
  one late answer from a busy server neither takes it out nor one good answer from a
  flapping server brings it back. At start, an upstream's first check decides.
- Per request the pool picks, among upstreams in service where the model is ready and
  with room, one by the model's routing policy (``llmhost.gateway.routing.policies``: by the
  request's prompt prefix with a load bound, the least outstanding, or in turn); an
  upstream of this host then picks one of the model's engine sockets the same way.
  The policies weigh requests in flight counted over every worker of this gateway
  (``llmhost.gateway.routing.inflight``); the ``max_concurrent`` bound counts this
  worker's own.
  When none is in service for the model, it
  still tries those not known to be draining or unreachable whose last answer had the
  model ready (a panic mode, as Envoy's panic threshold), rather than refuse every
  request because the checks are late. At most ``max_concurrent`` requests are in
  flight on one upstream; beyond that a request waits in a queue of at most
  ``max_queue`` requests for up to ``queue_timeout_s``, then gets 503 with
  ``Retry-After``. A full queue, or no upstream to try, is 503 at once.
- An operator may hold an upstream out (``hold``: the admin API), for example while it
  is changed: no new requests go to it, those in flight finish, and it counts as
  draining until it is returned.
- A call that fails with UNAVAILABLE (unreachable, stream dropped) takes that upstream
  out at once, as unreachable; a backend answer that it is shutting down or its engine
  stopped (upstream.classify, or the engine socket's ``unavailable`` kind) takes it out
  as draining. Either way it comes back after ``healthy_threshold`` passed checks, and,
  when nothing of the answer was produced yet, the request is tried once more on another
  upstream; never after a response went to the client.
- A backend answer that it could not hand this one request to its model
  (``upstream.NotStarted``) leaves the upstream in service: the request is tried once
  more, on another upstream where one serves the model, else on the same one after
  ``SAME_UPSTREAM_PAUSE_S``.
- Each check also reads, from each ready model's Triton configuration, the LoRA adapters
  it serves (config.pbtxt's parameter ``lora_adapters``, a JSON list of names that the
  backend checks against its multi_lora.json at load): the gateway serves each as a
  model of its own, on the upstreams of its base model. An upstream whose configuration
  cannot be read keeps the names it last gave.
- Each change of an upstream's state is written to standard error (the journal of
  the gateway's unit), with why: ``llmhost gateway: upstream HOST:PORT out: ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from llmhost.gateway.errors import ApiError, unavailable
from llmhost.gateway.routing.inflight import InFlight, upstream_load_name
from llmhost.gateway.routing.kvevents import KvEventsIndex
from llmhost.gateway.routing.policies import KV_EVENTS, Chooser, Route
from llmhost.gateway.upstreams.client import Draining, NotStarted, UpstreamDown

T = TypeVar("T")


class Client(Protocol):
    """What the pool needs of one upstream (``upstream.Upstream`` or a test's fake)."""

    async def model_ready(self, model: str) -> bool: ...

    async def model_config(self, model: str) -> Any: ...


IN_SERVICE, DRAINING, OUT = "in_service", "draining", "out"
STATES = (IN_SERVICE, DRAINING, OUT)
# A request the backend could not hand to its model is tried again on the same upstream
# (none other serving the model) after this pause: the moment that failed it passes.
SAME_UPSTREAM_PAUSE_S = 1.0
# The parameter of a model's Triton configuration that lists its LoRA adapters.
ADAPTERS_PARAMETER = "lora_adapters"


def _to_stderr(line: str) -> None:
    print(f"llmhost gateway[{os.getpid()}]: {line}", file=sys.stderr, flush=True)


@dataclass
class Member:
    target: str
    client: Any
    checked: bool = False
    in_service: bool = False  # taken in by its health checks (and not out since)
    unreachable: bool = False  # its last check or request could not reach it
    draining: bool = False
    held: bool = False  # held out by an operator (the admin API) until returned
    ready: set[str] = field(default_factory=set)  # models ready at its last check that answered
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)  # model -> LoRA adapters it last published
    outstanding: int = 0
    fails: int = 0  # failed health checks in a row
    passes: int = 0  # passed health checks in a row

    def serves(self, model: str) -> bool:
        return self.in_service and not self.draining and not self.held and model in self.ready

    def may_try(self, model: str) -> bool:
        """Worth a try when nothing is in service: not known to be draining or unreachable,
        and its last answer had MODEL ready."""
        return not self.draining and not self.held and not self.unreachable and model in self.ready

    @property
    def up(self) -> bool:
        """Routable: in service, not draining or held, at least one served model ready."""
        return self.in_service and not self.draining and not self.held and bool(self.ready)

    @property
    def state(self) -> str:
        if self.draining or self.held:
            return DRAINING
        return IN_SERVICE if self.in_service else OUT


@dataclass
class PoolSettings:
    max_concurrent: int = 1024
    max_queue: int = 512
    queue_timeout_s: float = 30.0
    interval_s: float = 2.0
    timeout_s: float = 2.0
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2


class UpstreamPool:
    def __init__(self, members: list[tuple[str, Any]], models: list[str],
                 settings: PoolSettings | None = None, log: Callable[[str], None] = _to_stderr) -> None:
        if not members:
            raise ValueError("an upstream pool needs at least one upstream")
        self.members = [Member(target, client) for target, client in members]
        self.models = list(models)
        self.settings = settings or PoolSettings()
        self.waiting = 0
        self.panic_routed = 0  # requests sent to an upstream out of service, none being in service
        self.log = log
        self.chooser = Chooser()
        # What the policies weigh: requests in flight per upstream (every worker's, where shared).
        self.in_flight = InFlight()
        # What this host's engines' caches hold (the kv_events policy among upstreams with
        # engine sockets here); None: no such upstream.
        self.kv_events: KvEventsIndex | None = None
        self.kv_events_models: list[str] = []  # the models routed by them
        # Sees (model, reason) of each routed request once it ends (the gateway's metrics).
        self.on_route: Callable[[str, str], None] | None = None
        self._changed = asyncio.Condition()

    # --- health -----------------------------------------------------------------

    async def _ready(self, member: Member, model: str) -> bool:
        call = member.client.model_ready(model)
        return bool(await asyncio.wait_for(call, self.settings.timeout_s))

    async def check_member(self, member: Member) -> None:
        ready: set[str] = set()
        failure = ""
        for model in self.models:
            try:
                if await self._ready(member, model):
                    ready.add(model)
            except TimeoutError:
                failure = "late"
                break
            except (UpstreamDown, OSError):
                failure = "unreachable"
                break
            except ApiError:
                continue
            except Exception:  # noqa: BLE001 - anything else unexpected: a failed check, and the checks go on
                failure = "unreachable"
                break
        if not failure:
            await self._read_adapters(member, ready)
        before = _condition(member)
        if failure:
            self._failed(member, unreachable=failure == "unreachable")
        else:
            self._passed(member, ready)
        why = (f"{member.fails} failed health check(s) in a row, the last {failure}" if failure
               else f"{member.passes} passed health check(s) in a row")
        self._note(member, before, why)
        member.checked = True
        await self._notify()

    async def _read_adapters(self, member: Member, models: set[str]) -> None:
        """The LoRA adapters each of MODELS publishes on MEMBER (kept as they were where
        its configuration cannot be read now), all at once."""
        async def read(model: str) -> None:
            try:
                response = await asyncio.wait_for(member.client.model_config(model), self.settings.timeout_s)
            except Exception:  # noqa: BLE001 - a late or failed read changes nothing; the next check reads again
                return
            member.adapters[model] = published_adapters(response)

        await asyncio.gather(*(read(model) for model in models))

    def _passed(self, member: Member, ready: set[str]) -> None:
        member.fails, member.passes = 0, member.passes + 1
        member.unreachable, member.ready = False, ready
        if not member.checked or member.passes >= self.settings.healthy_threshold:
            member.in_service, member.draining = True, False

    def _failed(self, member: Member, unreachable: bool) -> None:
        member.passes, member.fails = 0, member.fails + 1
        member.unreachable = member.unreachable or unreachable  # a late answer proves nothing either way
        if not member.checked or member.fails >= self.settings.unhealthy_threshold:
            member.in_service = False

    async def check(self) -> None:
        """Check every upstream once (concurrently); then follow the KV-cache events of
        the engines of the models routed by them (from the start, not from their first request)."""
        await asyncio.gather(*(self.check_member(m) for m in self.members))
        if self.kv_events is not None:
            for model in self.kv_events_models:
                self.kv_events.prepare([s for m in self.members for s in _engine_sockets(m, model)])

    async def _ensure_checked(self) -> None:
        unchecked = [m for m in self.members if not m.checked]
        if unchecked:
            await asyncio.gather(*(self.check_member(m) for m in unchecked))

    async def run_health_checks(self) -> None:
        """Forever: check every upstream, then sleep ``interval_s``."""
        while True:
            await self.check()
            await asyncio.sleep(self.settings.interval_s)

    def _note(self, member: Member, before: tuple[str, bool, bool], why: str) -> None:
        """Log MEMBER's new condition (state, unreachable, held) where it changed from BEFORE."""
        if _condition(member) == before:
            return
        extra = [w for w, on in (("held", member.held), ("unreachable", member.unreachable)) if on]
        self.log(f"upstream {member.target} {member.state}{' (' + ', '.join(extra) + ')' if extra else ''}: {why}")

    def mark_down(self, member: Member, why: str = "a request could not reach it") -> None:
        """A request could not reach MEMBER: out at once, until its checks pass again."""
        before = _condition(member)
        member.in_service, member.unreachable, member.passes = False, True, 0
        self._note(member, before, why)

    def member(self, target: str) -> Member | None:
        return next((m for m in self.members if m.target == target), None)

    async def hold(self, member: Member, held: bool) -> None:
        """Hold MEMBER out of the pool (no new requests; those in flight go on) or return it;
        a returned member serves again as soon as its checks say it is in service."""
        before = _condition(member)
        member.held = held
        self._note(member, before, "held by the admin API" if held else "returned by the admin API")
        await self._notify()

    def mark_draining(self, member: Member, why: str = "it said it is stopping") -> None:
        """MEMBER said it is stopping: no new requests until its checks pass again."""
        before = _condition(member)
        member.draining, member.passes = True, 0
        self._note(member, before, why)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- what is served ---------------------------------------------------------------

    async def ready_models(self) -> list[str]:
        """The served models ready on at least one upstream."""
        await self._ensure_checked()
        return [m for m in self.models if self._candidates(m, set())]

    async def model_ready(self, model: str) -> bool:
        return model in await self.ready_models()

    def adapters(self, model: str) -> list[str]:
        """The LoRA adapters of MODEL on the upstreams it would be sent to now, each once."""
        names: dict[str, None] = {}
        for member in self._candidates(model, set()):
            names.update(dict.fromkeys(member.adapters.get(model, ())))
        return list(names)

    async def adapter_base(self, name: str) -> str | None:
        """The served model whose LoRA adapter NAME is, as any upstream last published it
        (None: no served model has one by that name). A served model's own name is never
        an adapter's."""
        await self._ensure_checked()
        if name in self.models:
            return None
        return next((model for model in self.models
                     if any(name in m.adapters.get(model, ()) for m in self.members)), None)

    def view(self) -> list[dict[str, Any]]:
        """Every upstream: its state, whether it is held, requests in flight, routable."""
        return [{"target": m.target, "state": m.state, "held": m.held, "outstanding": m.outstanding, "up": m.up}
                for m in self.members]

    async def call(self, model: str, fn: Callable[[Any], Any]) -> Any:
        """FN(client) on the least busy upstream where MODEL is ready (no slot taken:
        for metadata)."""
        await self._ensure_checked()
        ready = self._candidates(model, set())
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

    def _candidates(self, model: str, exclude: set[str]) -> list[Member]:
        """The upstreams to send MODEL to, less EXCLUDE: those in service where it is
        ready or, when none is in service for it, those worth a try (panic mode)."""
        if any(m.serves(model) for m in self.members):
            return [m for m in self.members if m.serves(model) and m.target not in exclude]
        return [m for m in self.members if m.may_try(model) and m.target not in exclude]

    def _free(self, model: str, exclude: set[str], route: Route | None = None) -> Member | None:
        ready = [m for m in self._candidates(model, exclude) if m.outstanding < self.settings.max_concurrent]
        if not ready:
            return None
        return self.chooser.choose(route, model, ready, lambda m: m.target,
                                   lambda m: self.in_flight.count(upstream_load_name(m.target)))

    async def acquire(self, model: str, exclude: set[str] | frozenset[str] = frozenset(),
                      route: Route | None = None) -> Member:
        """A slot on an upstream where MODEL is ready, picked by ROUTE (None: the least
        busy), waiting in the queue when all are full; 503 (with Retry-After) when none
        serves it, the queue is full, or the wait is over."""
        await self._ensure_checked()
        exclude = set(exclude)
        if not self._candidates(model, exclude):
            raise self._none_ready(model)
        if route is not None and route.policy == KV_EVENTS and route.kind == "prefix":
            route.matches = await self._upstream_matches(model, exclude, route)
        member = self._free(model, exclude, route)
        if member is None:
            if self.waiting >= self.settings.max_queue:
                raise unavailable(f"the gateway is at capacity ({self.settings.max_queue} requests waiting); retry "
                                  "shortly", "queue_full", 1)
            member = await self._wait(model, exclude, route)
        member.outstanding += 1
        self.in_flight.add(upstream_load_name(member.target), 1)
        if not member.in_service:
            self.panic_routed += 1
        return member

    async def _upstream_matches(self, model: str, exclude: set[str], route: Route) -> dict[str, int] | None:
        """kv_events: how many of ROUTE's prompt's leading blocks each candidate upstream's
        engines hold, by its target; None (the prefix hash decides) where one of them
        has no engine sockets on this host, or there is one candidate."""
        members = self._candidates(model, exclude)
        if self.kv_events is None or len(members) < 2:
            return None
        return await self.kv_events.matches({m.target: _engine_sockets(m, model) for m in members}, route)

    async def _wait(self, model: str, exclude: set[str], route: Route | None) -> Member:
        self.waiting += 1
        deadline = time.monotonic() + self.settings.queue_timeout_s
        try:
            async with self._changed:
                while True:
                    member = self._free(model, exclude, route)
                    if member is not None:
                        return member
                    if not self._candidates(model, exclude):
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
        self.in_flight.add(upstream_load_name(member.target), -1)
        await self._notify()

    async def stream(self, model: str, open_call: Callable[[Any], AsyncIterator[T]],
                     note: Callable[[str], None] | None = None, route: Route | None = None) -> AsyncIterator[T]:
        """The items of OPEN_CALL(client) on an upstream picked by ROUTE, holding its
        slot until the iteration ends; tried once more when it failed before its first
        item: as down or draining, on another upstream; not started, on another where
        one serves the model, else on the same."""
        try:
            async with contextlib.aclosing(self._stream(model, open_call, note, route)) as items:
                async for item in items:
                    yield item
        finally:
            if route is not None and route.reason is not None and self.on_route is not None:
                self.on_route(model, route.reason)

    async def _stream(self, model: str, open_call: Callable[[Any], AsyncIterator[T]],
                      note: Callable[[str], None] | None, route: Route | None) -> AsyncIterator[T]:
        tried: set[str] = set()
        last: ApiError | None = None
        while True:
            if last is not None and not tried:  # not started, and no other upstream serves it
                await asyncio.sleep(SAME_UPSTREAM_PAUSE_S)
            try:
                member = await self.acquire(model, tried, route)
            except ApiError:
                if last is not None:  # no other upstream to retry on: the first failure
                    raise last from None
                raise
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
            except (UpstreamDown, Draining, NotStarted) as exc:
                if isinstance(exc, Draining):
                    self.mark_draining(member, f"it said: {exc.message}"[:300])
                elif isinstance(exc, UpstreamDown):
                    self.mark_down(member, f"a request failed: {exc.message}"[:300])
                if produced or last is not None:
                    raise
                last = exc
                if not isinstance(exc, NotStarted) or self._candidates(model, {member.target}):
                    tried.add(member.target)
            finally:
                await self.release(member)


def published_adapters(response: Any) -> tuple[str, ...]:
    """The adapter names a ModelConfigResponse publishes in ADAPTERS_PARAMETER; none
    where it is absent or not a JSON list of names."""
    params = response.config.parameters
    if ADAPTERS_PARAMETER not in params:
        return ()
    try:
        names = json.loads(params[ADAPTERS_PARAMETER].string_value)
    except ValueError:
        return ()
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        return ()
    return tuple(names)


def _engine_sockets(member: Member, model: str) -> list[Path]:
    """MODEL's engine sockets on MEMBER's host, where it is this host (none for a remote upstream)."""
    sockets = getattr(member.client, "engine_sockets", None)
    return sockets(model) if callable(sockets) else []


def _condition(member: Member) -> tuple[str, bool, bool]:
    return member.state, member.unreachable, member.held
