"""Streaming multipart upload: the file part flows chunk by chunk into the validator, a sha256 and the
blob store, so neither memory nor disk ever holds more than the size limit allows; nothing is kept
when any check fails."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from service.errors import BadRequest, PayloadTooLarge
from service.files.validation import FileStats, FileValidationError, JsonlValidator
from service.storage import BlobWriter

MAX_FIELD_BYTES = 4096


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
    headers: dict[str, str] = field(default_factory=dict)
    header_name: bytes = b""
    header_value: bytes = b""
    part_name: str | None = None
    part_filename: str | None = None
    field_value: bytes = b""
    seen_file: bool = False
    file_bytes: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    fields: dict[str, str] = field(default_factory=dict)
    filename: str = ""


def _callbacks(st: _State) -> dict[str, object]:
    def on_part_begin() -> None:
        st.headers, st.part_name, st.part_filename, st.field_value = {}, None, None, b""

    def on_header_field(data: bytes, start: int, end: int) -> None:
        st.header_name += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        st.header_value += data[start:end]

    def on_header_end() -> None:
        st.headers[st.header_name.decode("latin-1").lower()] = st.header_value.decode("utf-8", "replace")
        st.header_name, st.header_value = b"", b""

    def on_headers_finished() -> None:
        _, params = parse_options_header(st.headers.get("content-disposition", ""))
        st.part_name = params.get(b"name", b"").decode("utf-8", "replace")
        raw_filename = params.get(b"filename")
        st.part_filename = raw_filename.decode("utf-8", "replace") if raw_filename is not None else None
        if st.part_name == "file":
            if st.seen_file:
                raise BadRequest("only one 'file' part is allowed", param="file")
            st.seen_file = True
            st.filename = (st.part_filename or "upload.jsonl").rsplit("/", 1)[-1][:500]

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

    return {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }


async def receive_upload(
    *,
    content_type: str,
    stream: AsyncIterator[bytes],
    writer: BlobWriter,
    max_bytes: int,
    min_examples: int,
) -> UploadResult:
    """Parse a multipart body into `writer`. The caller commits or aborts the writer."""
    ctype, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise BadRequest("upload must be multipart/form-data with a 'file' part", param="file")
    st = _State(validator=JsonlValidator(min_examples=min_examples), writer=writer, max_bytes=max_bytes)
    parser = MultipartParser(boundary, _callbacks(st))  # type: ignore[arg-type]
    try:
        async for chunk in stream:
            # JSON parsing is CPU work: keep it off the event loop
            await run_in_threadpool(parser.write, chunk)
        parser.finalize()
        if not st.seen_file:
            raise BadRequest("missing the 'file' part", param="file", code="missing_file")
        stats = st.validator.finish()
    except FileValidationError as exc:
        raise BadRequest(str(exc), param="file", code="invalid_file") from exc
    return UploadResult(stats=stats, sha256=st.digest.hexdigest(), filename=st.filename, fields=st.fields)
