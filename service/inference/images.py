"""The images of a `/v1/chat/completions` request, checked before a worker sees them (docs/vision.md).

Each image part (``ImagePart``: OpenAI's ``image_url``) is checked as an uploaded row's are
(``service.files.images.inspect_image``, the deployment's ``TUNEHOUSE_IMAGE_*`` limits): in a user or
system message, at most ``image_max_per_example`` in a request, and an ``http(s)`` URL fetched here, once,
under the upload's SSRF rules (``service.files.fetch``), and handed on as a data URL. A request's body is
bounded by ``max_json_body_bytes`` (1 MB by default: a data URL of ~750 KB); a larger image goes by URL.
Each problem is a 400 naming ``messages[i].content[j]...``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io

from service.config import Settings
from service.errors import BadRequest
from service.files.fetch import ImageFetcher
from service.files.images import ImageProblem, image_limits, inspect_image
from service.inference.schemas import ChatCompletionRequest, ImagePart
from trainers.chat.images import IMAGE_ROLES, parse_data_url, url_kind


def check_images(request: ChatCompletionRequest, settings: Settings) -> None:
    """Check every image of ``request`` in place (an http(s) one becomes the data URL of what was
    fetched); ``BadRequest`` naming the first that fails."""
    parts = [
        (f"messages[{i}].content[{j}]", message.role, part)
        for i, message in enumerate(request.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]
    if not parts:
        return
    limits = image_limits(settings)
    if len(parts) > limits.max_per_example:
        path = parts[limits.max_per_example][0]
        raise BadRequest(f"{path}: more than {limits.max_per_example} images in one request", param=path)
    fetch = ImageFetcher(
        max_bytes=limits.max_bytes,
        timeout_seconds=settings.image_fetch_timeout_seconds,
        max_redirects=settings.image_fetch_max_redirects,
        allow_private=settings.image_fetch_allow_private,
    )
    try:
        for path, role, part in parts:
            if role not in IMAGE_ROLES:
                raise BadRequest(f"{path}: images are allowed in user and system messages only", param=path)
            field = f"{path}.image_url.url"
            try:
                part.image_url.url = _checked(part.image_url.url, fetch, settings)
            except ImageProblem as exc:
                raise BadRequest(f"{field}: {exc}", param=field, code="invalid_image") from exc
    finally:
        fetch.close()


def _checked(url: str, fetch: ImageFetcher, settings: Settings) -> str:
    """``url``'s image checked, as a data URL."""
    limits = image_limits(settings)
    kind = url_kind(url)
    declared: str | None
    if kind == "data":
        try:
            declared, payload = parse_data_url(url)
            data = base64.b64decode(payload, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise ImageProblem(f"not a base64 data URL of an image ({exc})") from exc
    elif kind == "http":
        file, _, declared = fetch(url)
        with file:
            file.seek(0)
            data = file.read()
    else:
        raise ImageProblem("expected a data: URL (base64) or an http(s) URL")
    info = inspect_image(
        io.BytesIO(data),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        declared=declared,
        limits=limits,
        thumbnail=False,
    )
    return f"data:{info.media_type};base64,{base64.b64encode(data).decode()}"
