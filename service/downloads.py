"""Blob downloads over HTTP: one place that names the file (RFC 6266) and streams the bytes.

>>> content_disposition('データ "x".jsonl')
'attachment; filename="___ _x_.jsonl"; filename*=UTF-8\\'\\'%E3%83%87%E3%83%BC%E3%82%BF%20%22x%22.jsonl'
"""

from __future__ import annotations

from urllib.parse import quote

from fastapi.responses import StreamingResponse

from service.storage import get_blob_store


def content_disposition(filename: str) -> str:
    """`attachment` with an ASCII fallback name and the exact name as RFC 5987 `filename*`: a quote, a
    backslash or a control character in a stored name can neither break nor extend the header."""
    fallback = "".join(ch if 0x20 <= ord(ch) < 0x7F and ch not in '"\\' else "_" for ch in filename)
    return f"attachment; filename=\"{fallback or 'download'}\"; filename*=UTF-8''{quote(filename, safe='')}"


def blob_response(key: str, *, filename: str, media_type: str) -> StreamingResponse:
    store = get_blob_store()
    # sized before the response starts: a missing blob is then a clean 500, not a truncated 200
    size = store.size(key)
    return StreamingResponse(
        store.iter_bytes(key),
        media_type=media_type,
        headers={"content-disposition": content_disposition(filename), "content-length": str(size)},
    )
