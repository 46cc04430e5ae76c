"""A real S3-compatible server for tests: moto's standalone server (`moto_server`, pinned in
pyproject's dev extra) in a subprocess on a free port, stopped by its pid. Nothing is mocked in-process:
boto3 talks HTTP to it exactly as to AWS S3 or MinIO."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tests.conftest import free_port

REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen[bytes]
    part_min_bytes: int

    def env(self) -> dict[str, str]:
        """The standard AWS variables a tunehouse process reads (through boto3) to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
        }

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_s3_server(*, part_min_bytes: int = 5 * 1024 * 1024) -> S3Server:
    """moto enforces S3's minimum part size (all parts but the last); tests that want small multipart
    checkpoints lower it here and in TUNEHOUSE_BLOB_PART_BYTES alike."""
    port = free_port()
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(part_min_bytes)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"moto_server exited with {proc.returncode}"
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=2)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "moto_server did not start"
            time.sleep(0.2)
    return S3Server(endpoint=endpoint, proc=proc, part_min_bytes=part_min_bytes)
