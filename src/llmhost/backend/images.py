"""The ``image`` input, as NVIDIA's vllm_backend takes it: a STRING tensor of one or
more base64-encoded images (PNG, JPEG, ... whatever Pillow reads), handed to a
multimodal model as vLLM's ``multi_modal_data={"image": [...]}``. The prompt
carries the model's own image placeholder (e.g. ``<image>``), as with vLLM.

``parse_images`` runs where the request is parsed (cheap: base64 only, bounded);
``open_images`` decodes the pictures on the tokenizer's worker pool. Every problem is
a ``RequestError`` naming the element at fault.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from llmhost.backend.errors import RequestError

IMAGE = "image"
# At most this many images in one request, each at most MAX_IMAGE_BYTES once
# base64-decoded, and at most MAX_IMAGE_PIXELS pixels (below Pillow's own
# decompression-bomb bounds; Pillow raises past twice its limit while opening).
MAX_IMAGES = 16
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def parse_images(value: Any) -> list[bytes]:
    """The decoded bytes of each element of the ``image`` input (an array or a list of
    base64 text, str or bytes)."""
    items = value.reshape(-1).tolist() if hasattr(value, "reshape") else list(value)
    if not items:
        raise RequestError(f"input '{IMAGE}' is empty: give one or more base64-encoded images, or leave it out")
    if len(items) > MAX_IMAGES:
        raise RequestError(f"input '{IMAGE}' holds {len(items)} images; at most {MAX_IMAGES} are allowed")
    out: list[bytes] = []
    limit_b64 = (MAX_IMAGE_BYTES + 2) // 3 * 4
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = item.encode("ascii", "replace")
        if not isinstance(item, (bytes, bytearray)):
            raise RequestError(f"input '{IMAGE}'[{i}] must be base64 text, got {type(item).__name__}")
        text = bytes(item).strip()
        if len(text) > limit_b64 + 4:  # before decoding anything
            raise RequestError(f"input '{IMAGE}'[{i}] is {len(text)} bytes of base64; an image may be at most "
                               f"{MAX_IMAGE_BYTES} bytes ({limit_b64} of base64)")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"input '{IMAGE}'[{i}] is not valid base64 (standard alphabet, '=' padding)") from None
        if not raw:
            raise RequestError(f"input '{IMAGE}'[{i}] is empty")
        out.append(raw)
    return out


def open_images(blobs: list[bytes]) -> list[Any]:
    """Each image opened with Pillow and converted to RGB (as vllm_backend does)."""
    from PIL import Image

    images = []
    for i, raw in enumerate(blobs):
        try:
            # Image.open reads only the header: the size is checked before any pixel
            # is decoded. (No warnings filter here: it is process-wide state, and this
            # runs on several pool threads at once.)
            img = Image.open(io.BytesIO(raw))
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise RequestError(f"input '{IMAGE}'[{i}] is {width}x{height} pixels; at most "
                                   f"{MAX_IMAGE_PIXELS} pixels are allowed")
            images.append(img.convert("RGB"))
        except RequestError:
            raise
        except Image.DecompressionBombError:
            raise RequestError(f"input '{IMAGE}'[{i}] decodes to too many pixels (Pillow's bound)") from None
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise RequestError(f"input '{IMAGE}'[{i}] is not an image Pillow can read: "
                               f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return images


def no_images_here(architectures: list[str]) -> RequestError:
    arch = ", ".join(architectures) or "its architecture"
    return RequestError(f"input '{IMAGE}' needs a multimodal model; this model takes text only "
                        f"(vLLM reports no multimodal support for {arch})")
