"""Every response carries x-request-id, and the server logs it with the request."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import IDLE_BROKER, _stop, free_port, wait_http


def test_request_id_is_returned_and_logged(tmp_path: Path, api_key: str) -> None:
    port = free_port()
    log_path = tmp_path / "api.log"
    env = {**os.environ, "TUNEHOUSE_BROKER_URL": IDLE_BROKER, "TUNEHOUSE_LOG_LEVEL": "INFO"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.app:app", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(f"{url}/readyz", proc)
            headers = {"Authorization": f"Bearer {api_key}"}
            mine = httpx.get(f"{url}/v1/files", headers={**headers, "x-request-id": "req_from_client_42"})
            assert mine.headers["x-request-id"] == "req_from_client_42"
            missing = httpx.get(f"{url}/v1/fine_tuning/jobs/ftjob-missing", headers=headers)
            assert missing.status_code == 404
            generated = missing.headers["x-request-id"]
            assert generated.startswith("req_") and len(generated) > 20
            time.sleep(0.3)
        finally:
            _stop(proc)
    text = log_path.read_text()
    assert "GET /v1/files 200" in text and "request_id=req_from_client_42" in text
    assert "GET /v1/fine_tuning/jobs/ftjob-missing 404" in text and f"request_id={generated}" in text
