"""The images of an upload: each one decoded and checked once, as its line is validated, in flat memory.

Every image part of a row (``trainers.chat.images``) is checked here, wherever its bytes come from:

- a ``data:`` URL diverted by ``service.files.data_urls.DataUrlSplitter``: its base64 text streams into a
  ``_DataSink``, decoded into a temporary file as it comes (never more than a chunk in memory), and the
  line the validator parses holds a placeholder for it (``UploadImages.placeholder_prefix``, with a
  per-upload secret so a row cannot name another row's image, or forge one);
- a ``data:`` URL left in its line (a ``url`` key the splitter does not take out: see its docstring);
- an ``http(s)`` URL: fetched once (``service.files.fetch``) and stored with the file.

Each is checked whole (``inspect_image``): the media type declared (a data URL's, a response's
``Content-Type``) against what the bytes are, the format, mode, size in bytes and pixels, the aspect
ratio, and a full decode (a truncated file fails there). Every limit is a setting
(``ImageLimits``, from ``TUNEHOUSE_IMAGE_*``); each violation fails the upload naming the line and the
part's field. Memory per upload: a chunk of text, one decoded image (at most ``max_pixels`` x 4 bytes),
and per file the fetched URLs already seen.

What is kept, with the file (``files/{tenant}/{file}``): the upload as sent (data URLs inline), each
fetched image once (``.images/{sha256}``) and a manifest (``.images.jsonl``: one line per image of the
file, in order, with its line, field, source URL when fetched, sha256, media type, size and, for the
first ``THUMBNAILS`` images, a small WEBP thumbnail for the dashboard). Nothing is kept of a failed
upload (``abort``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import json
import secrets
import tempfile
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn

from PIL import Image, UnidentifiedImageError

from service.config import Settings
from service.storage import BlobStore, BlobWriter
from trainers.chat.images import MEDIA_TYPES, ImageLimits, parse_data_url, parse_data_url_header, url_kind
from trainers.chat.rows import ImageRef

# the first images of a file get a thumbnail in its manifest (the dashboard's file view shows them)
THUMBNAILS = 64
THUMBNAIL_SIDE = 96
# fetched URLs a file remembers (a URL used again is not fetched again); beyond, it is fetched again
_SEEN_URLS = 10_000
_FORMAT_NAMES = {"JPEG": "JPEG", "PNG": "PNG", "WEBP": "WEBP", "GIF": "GIF", "BMP": "BMP", "TIFF": "TIFF"}


def image_limits(settings: Settings) -> ImageLimits:
    """The deployment's image limits (``TUNEHOUSE_IMAGE_*``; OpenAI's by default)."""
    return ImageLimits(
        max_bytes=settings.image_max_bytes,
        max_per_example=settings.image_max_per_example,
        max_image_examples=settings.image_max_examples,
        formats=tuple(settings.image_formats),
        modes=tuple(settings.image_modes),
        max_pixels=settings.image_max_pixels,
        max_aspect_ratio=settings.image_max_aspect_ratio,
    )


def manifest_key(blob_key: str) -> str:
    """Where a file's image manifest is kept, beside the file (``files/{tenant}/{file}.jsonl``)."""
    return blob_key.rsplit(".", 1)[0] + ".images.jsonl"


def fetched_key(blob_key: str, sha256: str) -> str:
    """Where a file keeps an image it fetched."""
    return blob_key.rsplit(".", 1)[0] + f".images/{sha256}"


class ImageProblem(ValueError):
    """An image that fails a check: ``str`` is the message a 400 gives (after its line and field)."""


@dataclass(frozen=True)
class ImageInfo:
    """A checked image."""

    media_type: str
    width: int
    height: int
    bytes: int
    sha256: str
    thumbnail: str | None = None  # a data URL


def inspect_image(
    file: IO[bytes], *, size: int, sha256: str, declared: str | None, limits: ImageLimits, thumbnail: bool
) -> ImageInfo:
    """Check the image in ``file`` (``size`` bytes; ``declared``: the media type its URL or response
    gave); ``ImageProblem`` saying what is wrong."""
    if size > limits.max_bytes:
        raise ImageProblem(f"the image is {size} bytes, more than the limit of {limits.max_bytes}")
    if size == 0:
        raise ImageProblem("the image is empty")
    file.seek(0)
    accepted = " or ".join(limits.formats)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(file, formats=None)
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageProblem(f"not a readable image (expected {accepted}): {exc}") from exc
    with image:
        found = str(image.format)
        if found not in limits.formats:
            raise ImageProblem(f"a {_FORMAT_NAMES.get(found, found)} image; expected {accepted}")
        media_type = next((m for m, f in MEDIA_TYPES.items() if f == found), f"image/{found.lower()}")
        if declared is not None and declared != media_type:
            raise ImageProblem(f"declared {declared}, but the data is a {found} image ({media_type})")
        if image.mode not in limits.modes:
            raise ImageProblem(f"image mode {image.mode!r}; expected {' or '.join(limits.modes)}")
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ImageProblem(f"{width}x{height} pixels, more than the limit of {limits.max_pixels}")
        if min(width, height) < 1 or max(width, height) / min(width, height) > limits.max_aspect_ratio:
            raise ImageProblem(
                f"{width}x{height} pixels: an aspect ratio over {limits.max_aspect_ratio:g} to 1 "
                "(the vision processors refuse it)"
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a decoder's complaint is a damaged image
                image.load()
        except (OSError, SyntaxError, ValueError, EOFError, Warning) as exc:
            raise ImageProblem(f"the image data is damaged or truncated ({exc})") from exc
        small = _thumbnail(image) if thumbnail else None
    return ImageInfo(media_type, width, height, size, sha256, small)


def _thumbnail(image: Image.Image) -> str:
    copy = image.copy()
    copy.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
    out = io.BytesIO()
    copy.save(out, format="WEBP", quality=70)
    return "data:image/webp;base64," + base64.b64encode(out.getvalue()).decode()


class _Spool:
    """Decoded image bytes in a temporary file, with their count and sha256."""

    def __init__(self, limit: int) -> None:
        self.file: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed by ``close``
        self.size = 0
        self.digest = hashlib.sha256()
        self.limit = limit
        self.over = False

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:  # kept counting, not kept: the check says how large it was
            self.over = True
            return
        self.file.write(data)
        self.digest.update(data)

    def close(self) -> None:
        self.file.close()


@dataclass
class _Record:
    """A diverted data URL, checked: its info, or what is wrong with it."""

    info: ImageInfo | None = None
    problem: str | None = None


class _DataSink:
    """One diverted data URL's base64 text, decoded into a spool as it comes, checked at its end."""

    def __init__(self, owner: UploadImages, header: str) -> None:
        self.owner, self.index = owner, owner.next_index()
        self.spool = _Spool(owner.limits.max_bytes)
        self.pending = b""  # base64 characters short of a 4-character group
        self.problem: str | None = None
        try:
            self.declared: str | None = parse_data_url_header(header)
        except ValueError as exc:
            self.declared, self.problem = None, str(exc)

    def write(self, data: bytes) -> None:
        if self.problem is not None:
            return
        text = self.pending + data.translate(None, b" \t\r\n")
        whole = len(text) - len(text) % 4
        self.pending = text[whole:]
        try:
            self.spool.write(binascii.a2b_base64(text[:whole], strict_mode=True))
        except binascii.Error as exc:
            self.problem = f"the data URL is not valid base64 ({exc})"

    def finish(self) -> bytes:
        record = _Record(problem=self.problem)
        if record.problem is None and self.pending:
            record.problem = "the data URL's base64 is truncated (its length is not a multiple of 4)"
        if record.problem is None:
            try:
                record.info = self.owner.inspect_spool(self.spool, self.declared)
            except ImageProblem as exc:
                record.problem = str(exc)
        self.spool.close()
        self.owner.records[self.index] = record
        return json.dumps(f"{self.owner.placeholder_prefix}{self.index}").encode()


@dataclass
class _Stored:
    """The writers of what an upload keeps of its images, and the keys already committed."""

    blobs: BlobStore
    blob_key: str
    manifest: BlobWriter
    committed: list[str] = field(default_factory=list)


class UploadImages:
    """An upload's images (module docstring): the splitter's sinks, each line's image parts checked
    (``check``), fetched images and the manifest written (``store``: None keeps nothing, as for a
    validation without an upload); ``commit`` or ``abort`` at the end."""

    def __init__(
        self,
        limits: ImageLimits,
        *,
        fetch: Callable[[str], tuple[IO[bytes], int, str | None]] | None = None,
        blobs: BlobStore | None = None,
        blob_key: str | None = None,
    ) -> None:
        self.limits = limits
        # a diverted data URL's stand-in: a data URL still (the row reader checks the scheme), naming the
        # record by a number after a secret no row can guess
        self.placeholder_prefix = f"data:image/png;base64,tunehouse{secrets.token_hex(8)}n"
        self.records: dict[int, _Record] = {}
        self._fetch = fetch
        self._index = 0
        self._seen: dict[str, ImageInfo] = {}
        self.images = 0
        self.image_examples = 0
        self._stored = (
            _Stored(blobs, blob_key, blobs.writer(manifest_key(blob_key)))
            if blobs is not None and blob_key is not None
            else None
        )

    def next_index(self) -> int:
        self._index += 1
        return self._index - 1

    def open_sink(self, header: str) -> _DataSink:
        return _DataSink(self, header)

    def inspect_spool(self, spool: _Spool, declared: str | None) -> ImageInfo:
        if spool.over:
            raise ImageProblem(f"the image is more than {self.limits.max_bytes} bytes (the limit)")
        spool.file.flush()
        return inspect_image(
            spool.file,
            size=spool.size,
            sha256=spool.digest.hexdigest(),
            declared=declared,
            limits=self.limits,
            thumbnail=self.images < THUMBNAILS,
        )

    def check(self, line: int, refs: list[ImageRef], fail: Callable[[str | None, str], NoReturn]) -> None:
        """Check a validated line's image parts; ``fail(field, message)`` on the first problem."""
        if not refs:
            return
        if len(refs) > self.limits.max_per_example:
            fail(
                refs[self.limits.max_per_example].path,
                f"more than {self.limits.max_per_example} images in one example",
            )
        self.image_examples += 1
        if self.image_examples > self.limits.max_image_examples:
            fail(None, f"more than {self.limits.max_image_examples} examples with images in one file")
        for ref in refs:
            url_field = f"{ref.path}.image_url.url"
            try:
                info, source = self._checked(ref.url)
            except ImageProblem as exc:
                fail(url_field, str(exc))
            self._record(line, ref, info, source)

    def _checked(self, url: str) -> tuple[ImageInfo, str | None]:
        """The image ``url`` holds, checked, and the URL it was fetched from (None: a data URL)."""
        if url.startswith(self.placeholder_prefix):
            record = self.records.pop(int(url[len(self.placeholder_prefix) :]))
            if record.problem is not None:
                raise ImageProblem(record.problem)
            assert record.info is not None
            return record.info, None
        if url_kind(url) == "data":  # a data URL the splitter left in its line
            try:
                declared, payload = parse_data_url(url)
                data = base64.b64decode(payload.translate({ord(c): None for c in " \t\r\n"}), validate=True)
            except (ValueError, binascii.Error) as exc:
                raise ImageProblem(f"the data URL is not valid base64 ({exc})") from exc
            spool = _Spool(self.limits.max_bytes)
            try:
                spool.write(data)
                return self.inspect_spool(spool, declared), None
            finally:
                spool.close()
        return self._fetched(url), url

    def _fetched(self, url: str) -> ImageInfo:
        if url in self._seen:
            return self._seen[url]
        if self._fetch is None:
            raise ImageProblem("http(s) image URLs are fetched only when a file is uploaded")
        file, size, declared = self._fetch(url)
        with file:
            digest = hashlib.sha256()
            file.seek(0)
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
            info = inspect_image(
                file,
                size=size,
                sha256=digest.hexdigest(),
                declared=declared,
                limits=self.limits,
                thumbnail=self.images < THUMBNAILS,
            )
            self._keep(file, info)
        if len(self._seen) < _SEEN_URLS:
            self._seen[url] = info
        return info

    def _keep(self, file: IO[bytes], info: ImageInfo) -> None:
        stored = self._stored
        if stored is None:
            return
        key = fetched_key(stored.blob_key, info.sha256)
        if key in stored.committed:
            return
        file.seek(0)
        with stored.blobs.writer(key) as writer:
            for block in iter(lambda: file.read(1 << 20), b""):
                writer.write(block)
        stored.committed.append(key)

    def _record(self, line: int, ref: ImageRef, info: ImageInfo, source: str | None) -> None:
        entry: dict[str, Any] = {
            "index": self.images,
            "line": line,
            "field": ref.path,
            "detail": ref.detail,
            "url": source,
            "sha256": info.sha256,
            "media_type": info.media_type,
            "width": info.width,
            "height": info.height,
            "bytes": info.bytes,
            "thumbnail": info.thumbnail if self.images < THUMBNAILS else None,
        }
        self.images += 1
        if self._stored is not None:
            self._stored.manifest.write(json.dumps(entry).encode() + b"\n")

    def commit(self) -> None:
        """Keep the manifest (the fetched images are kept as they come); a file without images keeps none."""
        if self._stored is None:
            return
        if self.images:
            self._stored.manifest.commit()
        else:
            self._stored.manifest.abort()

    def abort(self) -> None:
        """Keep nothing: the manifest dropped, the fetched images deleted. Never raises."""
        if self._stored is None:
            return
        self._stored.manifest.abort()
        for key in self._stored.committed:
            with contextlib.suppress(Exception):
                self._stored.blobs.delete(key)


def stored_image_keys(blobs: BlobStore, blob_key: str) -> list[str]:
    """The keys of the images a file fetched at upload (from its manifest), each once."""
    keys = {fetched_key(blob_key, e["sha256"]) for e in read_manifest(blobs, blob_key) if e["url"]}
    return sorted(keys)


def read_manifest(blobs: BlobStore, blob_key: str) -> Generator[dict[str, Any], None, None]:
    """The entries of a file's image manifest, in order (none for a file without images)."""
    try:
        stream = blobs.open(manifest_key(blob_key))
    except FileNotFoundError:
        return
    with io.TextIOWrapper(stream, encoding="utf-8") as text:  # (closing it closes the stream)
        for raw in text:
            if raw.strip():
                yield json.loads(raw)
