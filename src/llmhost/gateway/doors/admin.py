"""The gateway's admin API, for keys with ``admin: true`` (others get 403): hold an
upstream out of the pool while it is changed, and return it.

- ``GET /admin/upstreams``: every upstream with its state (``in_service``, ``draining``
  or ``out``), whether it is held, and its requests in flight.
- ``POST /admin/upstreams/{target}/hold``: no new requests go to TARGET (HOST:PORT as the
  gateway lists it); those in flight finish. Its state reads ``draining``.
- ``POST /admin/upstreams/{target}/return``: TARGET takes requests again as soon as its
  health checks have it in service.

Each answers the upstreams as ``GET`` does; an unknown target is 404. A rolling change
(playbooks/rolling.yml) holds a host on every gateway, waits until its requests in
flight are 0, changes it, then returns it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmhost.gateway.access import Access
from llmhost.gateway.errors import ApiError
from llmhost.gateway.httpio import error_response, json_response


def _forbidden(name: str) -> ApiError:
    return ApiError(403, f"API key '{name}' may not use the admin API (its entry has no 'admin: true')",
                    "permission_error", None, "admin_only")


class AdminApi:
    def __init__(self, access: Access) -> None:
        self.access = access

    def routes(self) -> list[Route]:
        return [Route("/admin/upstreams", self.upstreams, methods=["GET"]),
                Route("/admin/upstreams/{target}/hold", self.hold, methods=["POST"]),
                Route("/admin/upstreams/{target}/return", self.give_back, methods=["POST"])]

    async def _body(self) -> dict[str, Any]:
        return {"upstreams": await self.access.upstreams()}

    def _admin(self, request: Request) -> None:
        key = self.access.auth(request)
        if not key.admin:
            raise _forbidden(key.name)

    async def upstreams(self, request: Request) -> Response:
        try:
            self._admin(request)
        except ApiError as exc:
            return error_response(exc)
        return json_response(await self._body())

    async def _set(self, request: Request, held: bool) -> Response:
        try:
            self._admin(request)
            target = request.path_params["target"]
            try:
                await self.access.hold(target, held)
            except KeyError:
                raise ApiError(404, f"no upstream '{target}'; the gateway has "
                               f"{', '.join(m.target for m in self.access.pool.members)}",
                               "not_found_error", "target", "upstream_not_found") from None
        except ApiError as exc:
            return error_response(exc)
        return json_response(await self._body())

    async def hold(self, request: Request) -> Response:
        return await self._set(request, True)

    async def give_back(self, request: Request) -> Response:
        return await self._set(request, False)
