"""Image parts of chat messages (``{"type": "image_url", "image_url": {"url": ...}}``)
for multimodal models, as vLLM's OpenAI server takes them: each picture goes, in the
order of the messages, to the backend's ``image`` input (base64, see
llmhost.backend.images), which vLLM reads as the prompt's ``multi_modal_data``.

A data URL (``data:image/png;base64,...``) is taken as it is. An http(s) URL is
fetched by the gateway only where the operator allows it (``allow_remote_images``,
off by default: a fetch from inside the network on a client's word is a way in);
otherwise it is refused with a 400 naming the field. Every problem names the part
at fault (``messages[i].content[j].image_url.url``)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from llmhost.gateway.errors import invalid, unsupported
from llmhost.gateway.upstreams.request import RemoteImage

# At most this many pictures in one request, each at most MAX_IMAGE_BYTES (the
# backend's own bounds, llmhost.backend.images).
MAX_IMAGES = 16
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# A remote picture: how long its fetch may take in all, and how many redirects.
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
DETAILS = ("auto", "low", "high")


def data_url_image(url: str, param: str) -> str:
    """The base64 text of a data URL's picture (checked: an image type, valid base64)."""
    header, sep, payload = url[len("data:"):].partition(",")
    kind = header.split(";", 1)[0].strip().lower()
    if not sep or not header.lower().endswith(";base64"):
        raise invalid(f"'{param}' must be a base64 data URL (data:image/png;base64,...) or an http(s) URL",
                      param, "invalid_image_url")
    if kind and not kind.startswith("image/"):
        raise invalid(f"'{param}' is a data URL of {kind[:40]!r}, not of an image", param, "invalid_image_url")
    payload = "".join(payload.split())
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise invalid(f"'{param}' holds more than {MAX_IMAGE_BYTES} bytes of image", param, "image_too_large")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"'{param}' is not valid base64 (standard alphabet, '=' padding)", param,
                      "invalid_image_url") from None
    if not raw:
        raise invalid(f"'{param}' holds no image", param, "invalid_image_url")
    return payload


def image_part(part: dict[str, Any], where: str) -> str | RemoteImage:
    """An ``image_url`` content part at WHERE (``messages[i].content[j]``): the picture as
    base64 text, or the remote URL to fetch."""
    extra = sorted(set(part) - {"type", "image_url"})
    if extra:
        raise unsupported(f"{where}.{extra[0]}", "is not a known field")
    spec = part.get("image_url")
    if isinstance(spec, str):  # vLLM's server takes the URL itself too
        spec = {"url": spec}
    if not isinstance(spec, dict):
        raise invalid(f"'{where}.image_url' must be an object with 'url'", f"{where}.image_url")
    extra = sorted(set(spec) - {"url", "detail"})
    if extra:
        raise unsupported(f"{where}.image_url.{extra[0]}", "is not a known field")
    if spec.get("detail") is not None and spec["detail"] not in DETAILS:
        raise invalid(f"'{where}.image_url.detail' must be one of {', '.join(DETAILS)}", f"{where}.image_url.detail")
    url, param = spec.get("url"), f"{where}.image_url.url"
    if not isinstance(url, str) or not url:
        raise invalid(f"missing required field '{param}'", param, "missing_required_parameter")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return data_url_image(url, param)
    if scheme in ("http", "https"):
        return RemoteImage(url, param)
    raise invalid(f"'{param}' must be a data URL (data:image/...;base64,...) or an http(s) URL, not "
                  f"{scheme[:16]!r}", param, "invalid_image_url")


async def fetch_images(images: list[str | RemoteImage], allowed: bool) -> list[str]:
    """Every picture as base64 text: remote ones fetched where ALLOWED, else a 400
    naming the first remote one's field."""
    remote = [img for img in images if isinstance(img, RemoteImage)]
    if not remote:
        return [img for img in images if isinstance(img, str)]
    if not allowed:
        raise unsupported(remote[0].param, "is a remote URL, which this server does not fetch: send the picture "
                                           "as a data URL (data:image/png;base64,...)")
    import httpx

    out: list[str] = []
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True,
                                 max_redirects=MAX_REDIRECTS) as client:
        for img in images:
            out.append(img if isinstance(img, str) else await _fetch(client, img))
    return out


async def _fetch(client: Any, img: RemoteImage) -> str:
    import httpx

    try:
        async with client.stream("GET", img.url) as r:
            if r.status_code != 200:
                raise invalid(f"'{img.param}': fetching the image gave HTTP {r.status_code}", img.param,
                              "image_fetch_failed")
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_IMAGE_BYTES:
                    raise invalid(f"'{img.param}' is an image of more than {MAX_IMAGE_BYTES} bytes", img.param,
                                  "image_too_large")
    except httpx.HTTPError as exc:
        raise invalid(f"'{img.param}': the image could not be fetched ({type(exc).__name__})", img.param,
                      "image_fetch_failed") from None
    if not body:
        raise invalid(f"'{img.param}': the fetched image is empty", img.param, "image_fetch_failed")
    return base64.b64encode(bytes(body)).decode("ascii")
