"""Images in chat rows, declared once: OpenAI's image content part, its limits and the URLs it may hold.

A user or system message's content may hold image parts beside its text parts, as OpenAI's vision
fine-tuning has them::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | "https://...",
                                        "detail": "low" | "high" | "auto"}}

``ImageLimits`` holds OpenAI's limits as defaults (the service's settings start from them, each one a
setting of its own): JPEG, PNG or WEBP; RGB or RGBA; at most 10 MB an image, 10 images an example and
50,000 examples with images a file; no image in an assistant message. Two more are ours, since a
processor cannot take what they refuse and the upload validator decodes every image whole: a pixel
count (what one decode may hold in memory) and an aspect ratio (Qwen's processors refuse beyond 200:1).

A ``data:`` URL is checked here to the point a string allows (its media type and encoding); its bytes,
and an ``http(s)`` URL's (fetched once at upload by the service and stored with the file), are checked
by the service (``service.files.images``). Standard library only: the API process reads rows with it.

>>> parse_data_url("data:image/png;base64,iVBORw0KGgo=")
('image/png', 'iVBORw0KGgo=')
>>> url_kind("https://example.com/cat.jpg"), url_kind("data:image/webp;base64,UklG")
('http', 'data')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IMAGE_PART_TYPE = "image_url"
"""OpenAI's ``type`` of an image content part."""
DETAILS: tuple[str, ...] = ("low", "high", "auto")
"""OpenAI's ``image_url.detail`` values (``auto`` when absent)."""
MEDIA_TYPES: dict[str, str] = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP"}
"""The media types an image may have, and Pillow's name of each format."""
IMAGE_ROLES: tuple[str, ...] = ("user", "system", "developer")
"""The roles whose messages may hold images (``developer`` is read as ``system``)."""
# the longest header a data URL may have before its comma ("data:image/jpeg;base64," is 23 characters;
# parameters such as ";name=x.png" are allowed)
MAX_DATA_URL_HEADER = 256
_DATA_HEADER = re.compile(r"^data:([a-zA-Z0-9.+-]+/[a-zA-Z0-9.+-]+)((?:;[^;,]*)*)$")


@dataclass(frozen=True)
class ImageLimits:
    """What an image, an example and a file may hold. Defaults: OpenAI's limits for vision fine-tuning
    (``max_bytes`` to ``modes``), then ours (``max_pixels``, ``max_aspect_ratio``)."""

    max_bytes: int = 10 * 1024 * 1024
    max_per_example: int = 10
    max_image_examples: int = 50_000
    formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP")
    modes: tuple[str, ...] = ("RGB", "RGBA")
    # one decode holds width x height x 4 bytes at most: 144 MB at this bound
    max_pixels: int = 36_000_000
    max_aspect_ratio: float = 200.0


DEFAULT_LIMITS = ImageLimits()


def url_kind(url: str) -> str | None:
    """``"data"`` for a ``data:`` URL, ``"http"`` for an ``http(s)`` one, None for anything else."""
    lowered = url[:8].lower()
    if lowered.startswith("data:"):
        return "data"
    if lowered.startswith(("http://", "https://")):
        return "http"
    return None


def parse_data_url_header(header: str) -> str:
    """The media type of a data URL's header (what precedes its comma); ``ValueError`` saying what is
    wrong when it is not a base64 image of an accepted type."""
    match = _DATA_HEADER.match(header)
    if match is None:
        raise ValueError(f"not a data URL header: {header[:40]!r}")
    media_type = match.group(1).lower()
    params = [p.strip().lower() for p in match.group(2).split(";") if p.strip()]
    if "base64" not in params:
        raise ValueError("a data URL of an image must be base64-encoded (data:image/png;base64,...)")
    if media_type not in MEDIA_TYPES:
        accepted = ", ".join(MEDIA_TYPES)
        raise ValueError(f"unsupported image media type {media_type!r} (expected {accepted})")
    return media_type


def parse_data_url(url: str) -> tuple[str, str]:
    """(media type, base64 payload) of a ``data:`` URL of an image; ``ValueError`` otherwise."""
    header, comma, payload = url.partition(",")
    if not comma or len(header) > MAX_DATA_URL_HEADER:
        raise ValueError("a data URL needs a header and a comma before its data")
    return parse_data_url_header(header), payload
