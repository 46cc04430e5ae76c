"""What a server logs and answers around a request: the request id (returned and logged), a 500 that
stays in the envelope and keeps the connection, and no secret in the access log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import DATA_DIR, IDLE, _stop, free_port, wait_http
from tests.helpers import chat_rows, upload_ok


@dataclass
class LoggedServer:
    url: str
    port: int
    log_path: Path

    def log(self) -> str:
        time.sleep(0.3)  # the server writes its lines asynchronously
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    """uvicorn as an operator runs it: INFO level, access log on, output kept."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("logs") / "api.log"
    env = {**os.environ, **IDLE, "TUNEHOUSE_LOG_LEVEL": "INFO"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.app:app", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{url}/readyz", proc)
            yield LoggedServer(url=url, port=port, log_path=log_path)
        finally:
            _stop(proc)


def test_request_id_is_returned_and_logged(logged_server: LoggedServer, api_key: str) -> None:
    url = logged_server.url
    headers = {"Authorization": f"Bearer {api_key}"}
    mine = httpx.get(f"{url}/v1/files", headers={**headers, "x-request-id": "req_from_client_42"})
    assert mine.headers["x-request-id"] == "req_from_client_42"
    missing = httpx.get(f"{url}/v1/fine_tuning/jobs/ftjob-missing", headers=headers)
    assert missing.status_code == 404
    generated = missing.headers["x-request-id"]
    assert generated.startswith("req_") and len(generated) > 20
    # a client's id that could not be logged safely is replaced, not echoed
    odd = httpx.get(f"{url}/v1/files", headers={**headers, "x-request-id": "a b\t<script>" + "x" * 300})
    assert odd.headers["x-request-id"].startswith("req_")
    text = logged_server.log()
    assert "GET /v1/files 200" in text and "request_id=req_from_client_42" in text
    assert "GET /v1/fine_tuning/jobs/ftjob-missing 404" in text and f"request_id={generated}" in text


def _http_exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request/response on an open socket (Content-Length bodies only)."""
    sock.sendall(request)
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_unexpected_error_is_a_500_envelope_and_the_connection_stays(
    logged_server: LoggedServer, api_key: str
) -> None:
    with httpx.Client(base_url=logged_server.url, headers={"Authorization": f"Bearer {api_key}"}) as client:
        file_id = upload_ok(client, chat_rows(2))
    # a real fault the API cannot anticipate: the blob vanished from under its row
    (blob,) = (DATA_DIR / "blobs" / "files").glob(f"*/{file_id}.jsonl")
    blob.unlink()

    auth = f"Authorization: Bearer {api_key}\r\n".encode()
    with socket.create_connection(("127.0.0.1", logged_server.port), timeout=30) as sock:
        status, headers, body = _http_exchange(
            sock, b"GET /v1/files/" + file_id.encode() + b"/content HTTP/1.1\r\nHost: t\r\n" + auth + b"\r\n"
        )
        assert status == 500
        rid = headers["x-request-id"]
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and rid in error["message"]
        assert "No such file" not in error["message"]  # no internals leak to the client
        assert headers.get("connection", "").lower() != "close"
        # the same connection answers the next request
        status, _, body = _http_exchange(
            sock, b"GET /v1/files/" + file_id.encode() + b" HTTP/1.1\r\nHost: t\r\n" + auth + b"\r\n"
        )
        assert status == 200 and json.loads(body)["id"] == file_id
    text = logged_server.log()
    assert f"request_id={rid}" in text and "Traceback" in text  # the operator finds it by its id


def test_access_log_records_no_key(logged_server: LoggedServer, api_key: str) -> None:
    secret = api_key.split("-", 2)[2]
    httpx.get(f"{logged_server.url}/v1/files", headers={"Authorization": f"Bearer {api_key}"})
    # a client that puts its key in the URL, as some tools do
    httpx.get(f"{logged_server.url}/v1/files", params={"api_key": api_key, "limit": "3"})
    httpx.get(f"{logged_server.url}/v1/models?key={api_key}&access_token={api_key}")
    text = logged_server.log()
    assert "/v1/files?api_key=[redacted]&limit=3" in text  # the access log is on, and masked
    assert secret not in text and api_key not in text
