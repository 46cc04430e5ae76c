"""API keys: bearer auth, hashed at rest, and every object scoped to its tenant."""

from __future__ import annotations

import httpx
from sqlalchemy import select

from service.db import session_scope
from service.models import ApiKey
from tests.conftest import new_key
from tests.helpers import chat_rows, upload_ok


def test_missing_key_is_401_in_openai_envelope(api_url: str) -> None:
    response = httpx.get(f"{api_url}/v1/files")
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "missing_api_key"
    assert set(error) == {"message", "type", "param", "code"}


def test_invalid_key_is_401(api_url: str, api_key: str) -> None:
    for bad in ("nonsense", api_key[:-2] + "xx", "th-0000000000000000-abc"):
        response = httpx.get(f"{api_url}/v1/files", headers={"Authorization": f"Bearer {bad}"})
        assert response.status_code == 401, bad
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_keys_are_stored_hashed(api_key: str) -> None:
    lookup = api_key.split("-")[1]
    with session_scope() as session:
        row = session.scalar(select(ApiKey).where(ApiKey.lookup == lookup))
        assert row is not None
        assert api_key not in row.key_hash and api_key.split("-", 2)[2] not in row.key_hash
        assert len(row.key_hash) == 64


def test_other_tenants_objects_are_404(api_url: str, client: httpx.Client) -> None:
    file_id = upload_ok(client, chat_rows(4))
    job = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tunehouse/tiny-llama", "training_file": file_id}
    )
    assert job.status_code == 200, job.text
    job_id = job.json()["id"]

    other = {"Authorization": f"Bearer {new_key()}"}
    for path in (
        f"/v1/files/{file_id}",
        f"/v1/files/{file_id}/content",
        f"/v1/fine_tuning/jobs/{job_id}",
        f"/v1/fine_tuning/jobs/{job_id}/events",
        f"/v1/fine_tuning/jobs/{job_id}/checkpoints",
    ):
        response = httpx.get(f"{api_url}{path}", headers=other)
        assert response.status_code == 404, path
    assert httpx.post(f"{api_url}/v1/fine_tuning/jobs/{job_id}/cancel", headers=other).status_code == 404
    assert httpx.delete(f"{api_url}/v1/files/{file_id}", headers=other).status_code == 404
    # and they do not show up in the other tenant's lists
    assert httpx.get(f"{api_url}/v1/files", headers=other).json()["data"] == []
    assert httpx.get(f"{api_url}/v1/fine_tuning/jobs", headers=other).json()["data"] == []
    # nor can the other tenant train on the file
    stolen = httpx.post(
        f"{api_url}/v1/fine_tuning/jobs",
        headers=other,
        json={"model": "tunehouse/tiny-llama", "training_file": file_id},
    )
    assert stolen.status_code == 400
    assert stolen.json()["error"]["param"] == "training_file"
