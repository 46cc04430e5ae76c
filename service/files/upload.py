"""Streaming multipart upload: the file part flows chunk by chunk into the validator, a sha256 and the
blob store, so neither memory nor disk ever holds more than the size limit allows; nothing is kept
when any check fails.

A body python-multipart cannot parse (a part header over ~4 KB, a CR inside a header, bytes after a
boundary that are neither CRLF nor `--`), one without its closing boundary (a truncated upload), or one
with more than `MAX_PARTS` parts is a 400 and stores nothing. Filenames are kept as sent: UTF-8 bytes
as UTF-8, anything else as Latin-1 (what older clients send); control characters are refused.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from service.errors import BadRequest, PayloadTooLarge
from service.files.images import UploadImages
from service.files.validation import FileStats, FileValidationError, JsonlValidator
from service.storage import BlobWriter

MAX_FIELD_BYTES = 4096
# `file`, `purpose` and OpenAI's `expires_after[anchor]`/`[seconds]` are four; leave room, refuse floods
MAX_PARTS = 16
# the files.filename column
MAX_FILENAME_CHARS = 500
# one header line of a part (python-multipart's default, stated to it): a Content-Disposition
# whose filename is longer than ~4,100 bytes breaks it before the name can be read (docs/limits.md)
MAX_PART_HEADER_BYTES = 4096 + 128
# header lines of one part (python-multipart's default, stated to it): a client sends
# Content-Disposition and perhaps Content-Type
MAX_PART_HEADERS = 8
# RFC 2046: a boundary is 1 to 70 characters
MAX_BOUNDARY_BYTES = 70
# All the multipart framing a body may hold besides its file: each part's boundary line, headers and (but
# the file's) value. With the file's limit it bounds the whole body, so a Content-Length over that is
# refused before anything is read (service/middleware.py), and a body that runs past it while streaming
MAX_FRAMING_BYTES = (MAX_PARTS + 1) * (
    MAX_BOUNDARY_BYTES + 8 + MAX_PART_HEADERS * (MAX_PART_HEADER_BYTES + 4) + MAX_FIELD_BYTES
)


def max_body_bytes(max_file_bytes: int) -> int:
    """The largest upload body a file of `max_file_bytes` can come in."""
    return max_file_bytes + MAX_FRAMING_BYTES


@dataclass
class UploadResult:
    stats: FileStats
    sha256: str
    filename: str
    fields: dict[str, str]


@dataclass
class _State:
    validator: JsonlValidator
    writer: BlobWriter
    max_bytes: int
    headers: dict[str, bytes] = field(default_factory=dict)
    header_name: bytes = b""
    header_value: bytes = b""
    part_name: str | None = None
    field_value: bytes = b""
    parts: int = 0
    seen_file: bool = False
    ended: bool = False
    file_bytes: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    fields: dict[str, str] = field(default_factory=dict)
    filename: str = ""


def _decode_header_text(raw: bytes) -> str:
    # RFC 7578: names are UTF-8 in practice; a client that is not UTF-8 clean sent Latin-1
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _filename(raw: bytes | None) -> str:
    if raw is None:
        return "upload.jsonl"
    # a name is a name, not a path: a client that sent its directory gets the last part kept
    # (python-multipart already cuts the `C:\...` paths old browsers sent)
    name = _decode_header_text(raw).rsplit("/", 1)[-1]
    if any(unicodedata.category(ch) == "Cc" for ch in name):
        raise BadRequest(
            "the file's name contains a control character", param="file", code="invalid_filename"
        )
    if len(name) > MAX_FILENAME_CHARS:
        raise BadRequest(
            f"the file's name is longer than {MAX_FILENAME_CHARS} characters",
            param="file",
            code="invalid_filename",
        )
    return name or "upload.jsonl"


def _callbacks(st: _State) -> dict[str, object]:
    def on_part_begin() -> None:
        st.parts += 1
        if st.parts > MAX_PARTS:
            raise BadRequest(f"the form has more than {MAX_PARTS} parts", param="file", code="too_many_parts")
        st.headers, st.part_name, st.field_value = {}, None, b""

    def on_header_field(data: bytes, start: int, end: int) -> None:
        st.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        st.header_value += data[start:end]

    def on_header_end() -> None:
        st.headers[st.header_name.decode("latin-1").lower()] = st.header_value
        st.header_name, st.header_value = b"", b""

    def on_headers_finished() -> None:
        # latin-1 maps bytes to characters one to one, so the parameters come back as the raw bytes
        _, params = parse_options_header(st.headers.get("content-disposition", b"").decode("latin-1"))
        st.part_name = _decode_header_text(params.get(b"name", b""))
        if st.part_name == "file":
            if st.seen_file:
                raise BadRequest("only one 'file' part is allowed", param="file")
            st.seen_file = True
            st.filename = _filename(params.get(b"filename"))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if st.part_name == "file":
            st.file_bytes += len(chunk)
            if st.file_bytes > st.max_bytes:
                raise PayloadTooLarge(
                    f"file is larger than the limit of {st.max_bytes} bytes",
                    param="file",
                    code="file_too_large",
                )
            st.validator.feed(chunk)
            st.digest.update(chunk)
            st.writer.write(chunk)
        else:
            st.field_value += chunk
            if len(st.field_value) > MAX_FIELD_BYTES:
                raise BadRequest(f"form field '{st.part_name}' is too long", param=st.part_name)

    def on_part_end() -> None:
        if st.part_name and st.part_name != "file":
            st.fields[st.part_name] = st.field_value.decode("utf-8", "replace")

    def on_end() -> None:
        st.ended = True

    return {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
        "on_end": on_end,
    }


def _malformed(detail: str) -> BadRequest:
    return BadRequest(f"malformed multipart body: {detail}", param="file", code="invalid_multipart")


async def receive_upload(
    *,
    content_type: str,
    stream: AsyncIterator[bytes],
    writer: BlobWriter,
    max_bytes: int,
    min_examples: int,
    images: UploadImages | None = None,
) -> UploadResult:
    """Parse a multipart body into `writer`, its rows' images checked (and kept) by `images`. The caller
    commits or aborts the writer and `images`."""
    ctype, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise BadRequest("upload must be multipart/form-data with a 'file' part", param="file")
    if len(boundary) > MAX_BOUNDARY_BYTES:
        raise _malformed(f"its boundary is longer than {MAX_BOUNDARY_BYTES} characters (RFC 2046)")
    validator = JsonlValidator(min_examples=min_examples, images=images)
    st = _State(validator=validator, writer=writer, max_bytes=max_bytes)
    received, most = 0, max_body_bytes(max_bytes)
    try:
        parser = MultipartParser(
            boundary,
            _callbacks(st),  # type: ignore[arg-type]
            max_header_size=MAX_PART_HEADER_BYTES,
            max_header_count=MAX_PART_HEADERS,
        )
        async for chunk in stream:
            received += len(chunk)
            if received > most:  # past what its framing and file could fill: padding, an endless epilogue
                raise PayloadTooLarge(
                    f"request body is larger than the limit of {most} bytes for an upload",
                    code="request_too_large",
                )
            # JSON parsing is CPU work: keep it off the event loop
            await run_in_threadpool(parser.write, chunk)
        if not st.ended:
            raise _malformed("it ends before the closing boundary (truncated upload?)")
        if not st.seen_file:
            raise BadRequest("missing the 'file' part", param="file", code="missing_file")
        stats = st.validator.finish()
    except FileValidationError as exc:
        raise BadRequest(str(exc), param="file", code="invalid_file") from exc
    except FormParserError as exc:
        if "Maximum header size exceeded" in str(exc):  # issue 46: say which limit, and the name's own
            raise BadRequest(
                f"a multipart part's header line is longer than {MAX_PART_HEADER_BYTES} bytes (the file's "
                f"name is at most {MAX_FILENAME_CHARS} characters)",
                param="file",
                code="invalid_filename",
            ) from exc
        if "Maximum header count exceeded" in str(exc):
            raise _malformed(f"a part has more than {MAX_PART_HEADERS} header lines") from exc
        raise _malformed(str(exc)) from exc
    return UploadResult(stats=stats, sha256=st.digest.hexdigest(), filename=st.filename, fields=st.fields)
