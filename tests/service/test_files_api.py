"""Files API: streamed, validated uploads; OpenAI shapes; nothing stored on rejection."""

from __future__ import annotations

import email.message
import email.utils
import hashlib
import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import func, select

from service.config import get_settings
from service.db import session_scope
from service.models import File
from tests.conftest import MAX_UPLOAD_BYTES
from tests.helpers import chat_rows, jsonl, upload


def _blob_count() -> int:
    root = get_settings().data_dir / "blobs" / "files"
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _file_rows() -> int:
    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(File)) or 0)


def test_upload_list_retrieve_content_delete(client: httpx.Client) -> None:
    data = jsonl(chat_rows(5))
    response = upload(client, data, name="chat.jsonl")
    assert response.status_code == 200, response.text
    obj = response.json()
    assert obj["object"] == "file" and obj["id"].startswith("file-")
    assert obj["bytes"] == len(data) and obj["filename"] == "chat.jsonl" and obj["purpose"] == "fine-tune"
    assert obj["status"] == "processed" and obj["format"] == "chat" and obj["line_count"] == 5
    assert obj["sha256"] == hashlib.sha256(data).hexdigest()
    # OpenAI's file object has expires_at an integer, status_details a string, neither required: a file
    # that does not expire and has no details leaves them out rather than send a null (issue 56)
    assert "expires_at" not in obj and "status_details" not in obj

    assert client.get(f"/v1/files/{obj['id']}").json() == obj
    assert client.get(f"/v1/files/{obj['id']}/content").content == data
    listing = client.get("/v1/files").json()
    assert listing["object"] == "list" and listing["data"] == [obj]

    deleted = client.delete(f"/v1/files/{obj['id']}")
    assert deleted.json() == {"id": obj["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{obj['id']}").status_code == 404


def test_every_format_is_detected(client: httpx.Client) -> None:
    cases = {
        "prompt_completion": [{"prompt": "a", "completion": "b"}],
        "text": [{"text": "plain text for continued pre-training"}],
        "preference": [{"prompt": "q", "chosen": "good", "rejected": "bad"}],
        "prompt_only": [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}],
    }
    for expected, rows in cases.items():
        response = upload(client, jsonl(rows))
        assert response.status_code == 200, response.text
        assert response.json()["format"] == expected


def _chat_line(first: str, *messages: dict[str, str]) -> bytes:
    return f"{first}\n{json.dumps({'messages': list(messages)})}\n".encode()


def test_rejections_name_line_and_field_and_store_nothing(client: httpx.Client) -> None:
    good = json.dumps(chat_rows(1)[0])
    cases = [
        (b"\xff\xfe not utf-8\n", "line 1"),
        (f"{good}\n{{not json\n".encode(), "line 2"),
        (f"{good}\n[1, 2]\n".encode(), "line 2"),
        (
            _chat_line(good, {"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}),
            "messages[1].role",
        ),
        (
            _chat_line(good, {"role": "user", "content": ""}, {"role": "assistant", "content": "x"}),
            "messages[0].content",
        ),
        (f'{good}\n{{"text": "mixed formats"}}\n'.encode(), "line 2"),
        (b"", "empty"),
    ]
    rows_before, blobs_before = _file_rows(), _blob_count()
    for data, needle in cases:
        response = upload(client, data)
        assert response.status_code == 400, (data, response.text)
        error = response.json()["error"]
        assert needle in error["message"], (needle, error)
        assert error["param"] == "file" and error["code"] == "invalid_file"
    assert _file_rows() == rows_before
    assert _blob_count() == blobs_before


def test_size_limit_is_enforced_while_streaming(client: httpx.Client) -> None:
    line = (json.dumps({"text": "x" * 1000}) + "\n").encode()
    data = line * (MAX_UPLOAD_BYTES // len(line) + 10)
    blobs_before = _blob_count()
    response = upload(client, data)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "file_too_large"
    assert _blob_count() == blobs_before


@pytest.mark.parametrize("path", ["/v1/files", "/v1/fine_tuning/jobs"])
def test_a_body_announced_over_the_limit_is_refused_before_it_is_sent(
    api_url: str, api_key: str, path: str
) -> None:
    """A request whose Content-Length announces 10 GB is answered 413 at once, from its headers: the
    server does not wait for a body it would refuse (issue 56: the client timed out on the upload)."""
    host, port = urlsplit(api_url).hostname, urlsplit(api_url).port
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 10737418240\r\n\r\n".encode()
        )
        answer = b""
        while not answer.endswith(b"}}"):  # no body sent: a server waiting for it times this out
            answer += sock.recv(65536)
    status, _, rest = answer.decode().partition("\r\n")
    assert status.startswith("HTTP/1.1 413 "), answer
    error = json.loads(rest.split("\r\n\r\n", 1)[1])["error"]
    assert error["code"] in ("file_too_large", "request_too_large") and "10737418240" in error["message"]


def test_an_upload_streaming_past_its_bound_is_refused(client: httpx.Client) -> None:
    """Without a Content-Length, the upload counts what streams in: past its file's limit and the most
    multipart framing can add (padding after the closing boundary, here), it is a 413 and stores nothing."""
    boundary = "b0undary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="t.jsonl"\r\n\r\n'
        ).encode()
        + jsonl(chat_rows(1))
        + f"\r\n--{boundary}--\r\n".encode()
    )
    blobs_before = _blob_count()
    response = client.post(
        "/v1/files",
        content=iter([body, *[b"\r\n" * (512 * 1024)] * 8]),  # 8 MiB after the end
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert _blob_count() == blobs_before


def test_purpose_is_required_and_checked(client: httpx.Client) -> None:
    data = jsonl(chat_rows(1))
    response = client.post("/v1/files", files={"file": ("a.jsonl", data)})
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    response = upload(client, data, purpose="assistants")
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"


def test_missing_file_part(client: httpx.Client) -> None:
    response = client.post("/v1/files", data={"purpose": "fine-tune"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "file"


def test_list_pagination(client: httpx.Client) -> None:
    ids = [upload(client, jsonl(chat_rows(1))).json()["id"] for _ in range(5)]
    first = client.get("/v1/files", params={"limit": 2}).json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = client.get("/v1/files", params={"limit": 10, "after": first["last_id"]}).json()
    assert [f["id"] for f in rest["data"]] == ids[::-1][2:] and rest["has_more"] is False
    assert client.get("/v1/files", params={"limit": 0}).status_code == 400


def _raw_upload(client: httpx.Client, filename: bytes, data: bytes) -> httpx.Response:
    # written by hand: httpx would percent-encode a quote, and never sends Latin-1
    body = (
        b'--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="'
        + filename
        + b'"\r\n\r\n'
        + data
        + b"\r\n--b0undary--\r\n"
    )
    return client.post(
        "/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=b0undary"}
    )


@pytest.mark.parametrize(
    ("raw_name", "stored"),
    [
        ("データ.jsonl".encode(), "データ.jsonl"),  # UTF-8, as browsers and httpx send it
        ("café ü.jsonl".encode("latin-1"), "café ü.jsonl"),  # Latin-1, as older clients send it
        (b'a\\"; filename=evil.sh; x=\\".jsonl', 'a"; filename=evil.sh; x=".jsonl'),  # an escaped quote
        (b"100% \\\\ sure;.jsonl", "100% \\ sure;.jsonl"),
    ],
)
def test_filenames_are_stored_as_given_and_served_with_rfc6266(
    client: httpx.Client, raw_name: bytes, stored: str
) -> None:
    data = jsonl(chat_rows(1))
    response = _raw_upload(client, raw_name, data)
    assert response.status_code == 200, response.text
    file_id = response.json()["id"]
    assert client.get(f"/v1/files/{file_id}").json()["filename"] == stored

    content = client.get(f"/v1/files/{file_id}/content")
    assert content.status_code == 200 and content.content == data
    message = email.message.Message()
    message["content-disposition"] = content.headers["content-disposition"]
    params = message.get_params(header="content-disposition")
    assert params is not None
    # exactly: attachment, an ASCII fallback, and filename* — a quote in the name added no parameter
    assert [name for name, _ in params] == ["attachment", "filename", "filename"], params
    fallback, extended = params[1][1], params[2][1]
    assert isinstance(fallback, str) and fallback.isascii() and '"' not in fallback
    assert email.utils.collapse_rfc2231_value(extended) == stored


@pytest.mark.parametrize("chars", [501, 4_000, 10_000])
def test_a_long_filename_is_a_400_saying_the_limit(client: httpx.Client, chars: int) -> None:
    """Issue 46: a 10,000-character name got "malformed multipart body: Maximum header size exceeded"
    (python-multipart's bound on a part's header line), a limit documented nowhere."""
    response = _raw_upload(client, b"f" * chars, b'{"text": "x"}\n')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("file", "invalid_filename"), error
    assert "at most 500 characters" in error["message"] or "longer than 500 characters" in error["message"]
