"""/v1/webhooks on the real API server: endpoints (secret shown once), bad input named, tenancy, and the
outbox rows that a job's state changes write for each subscribed endpoint (sending them is the workers'
job: tests/worker/test_webhook_delivery.py, tests/e2e/test_webhooks.py)."""

from __future__ import annotations

import base64

import httpx
import pytest

from service.webhooks.events import EVENT_TYPES
from service.webhooks.signing import sign
from tests.conftest import new_key
from tests.helpers import all_pages, chat_rows, upload_ok

# nothing listens on port 9 (discard): if the e2e worker of this session sends these, it logs a failure
NOWHERE = "http://127.0.0.1:9/hook"


def _create(client: httpx.Client, **body: object) -> httpx.Response:
    return client.post("/v1/webhooks", json={"url": NOWHERE, **body})


def test_create_shows_the_secret_once_then_list_get_delete(client: httpx.Client) -> None:
    created = _create(client, events=["fine_tuning.job.succeeded"], description="ci")
    assert created.status_code == 200, created.text
    body = created.json()
    assert body["object"] == "webhook_endpoint" and body["id"].startswith("wh-")
    assert body["url"] == NOWHERE and body["events"] == ["fine_tuning.job.succeeded"]
    assert body["secret"].startswith("whsec_") and len(base64.b64decode(body["secret"][6:])) == 32
    webhook_id = body["id"]

    one = client.get(f"/v1/webhooks/{webhook_id}").json()
    listed = client.get("/v1/webhooks").json()
    assert "secret" not in one and all("secret" not in w for w in listed["data"])
    assert one == {k: v for k, v in body.items() if k != "secret"}
    assert [w["id"] for w in listed["data"]] == [webhook_id]

    everything = _create(client).json()
    assert everything["events"] is None  # no filter: every event type
    assert [w["id"] for w in client.get("/v1/webhooks").json()["data"]] == [everything["id"], webhook_id]

    deleted = client.delete(f"/v1/webhooks/{webhook_id}")
    assert deleted.json() == {"id": webhook_id, "object": "webhook_endpoint", "deleted": True}
    assert client.get(f"/v1/webhooks/{webhook_id}").status_code == 404
    assert client.delete(f"/v1/webhooks/{webhook_id}").status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"url": "ftp://example.com/hook"}, "url"),
        ({"url": "file:///etc/passwd"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": "example.com/hook"}, "url"),
        ({}, "url"),
        ({"url": NOWHERE, "events": ["fine_tuning.job.succeeded", "fine_tuning.job.exploded"]}, "events[1]"),
        ({"url": NOWHERE, "events": []}, "events"),
        ({"url": NOWHERE, "events": "fine_tuning.job.succeeded"}, "events"),
        ({"url": NOWHERE, "secret": "whsec_mine"}, "secret"),
        ({"url": "http://h/" + "a" * 2048}, "url"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: httpx.Client, body: dict[str, object], param: str
) -> None:
    response = client.post("/v1/webhooks", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert client.get("/v1/webhooks").json()["data"] == []  # nothing half-stored


def test_unknown_event_type_error_lists_the_known_ones(client: httpx.Client) -> None:
    error = _create(client, events=["fine_tuning.job.exploded"]).json()["error"]
    assert all(t in error["message"] for t in EVENT_TYPES), error


def test_another_tenants_endpoints_are_404(api_url: str, client: httpx.Client) -> None:
    webhook_id = _create(client).json()["id"]
    other = {"Authorization": f"Bearer {new_key()}"}
    for path in (f"/v1/webhooks/{webhook_id}", f"/v1/webhooks/{webhook_id}/deliveries"):
        response = httpx.get(f"{api_url}{path}", headers=other)
        assert response.status_code == 404 and response.json()["error"]["param"] == "webhook_id"
    assert httpx.delete(f"{api_url}/v1/webhooks/{webhook_id}", headers=other).status_code == 404
    assert httpx.get(f"{api_url}/v1/webhooks", headers=other).json()["data"] == []
    assert client.get(f"/v1/webhooks/{webhook_id}").status_code == 200  # still there for its owner


def _types(client: httpx.Client, webhook_id: str) -> list[str]:
    rows = all_pages(client, f"/v1/webhooks/{webhook_id}/deliveries")[::-1]  # oldest first
    return [r["event_type"] for r in rows]


def test_state_changes_queue_one_delivery_per_subscribed_endpoint(api_url: str, client: httpx.Client) -> None:
    """On the API-only server (no worker trains): create, pause, resume, cancel a queued job."""
    everything = _create(client).json()["id"]
    cancels = _create(client, events=["fine_tuning.job.cancelled"]).json()["id"]
    other_key = new_key()
    other = httpx.post(
        f"{api_url}/v1/webhooks", json={"url": NOWHERE}, headers={"Authorization": f"Bearer {other_key}"}
    )
    train = upload_ok(client, chat_rows(8))
    job_id = client.post(
        "/v1/fine_tuning/jobs", json={"model": "tunehouse/tiny-llama", "training_file": train}
    ).json()["id"]
    for action in ("pause", "resume", "cancel"):
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/{action}").status_code == 200

    assert _types(client, everything) == [
        f"fine_tuning.job.{s}" for s in ("queued", "paused", "queued", "cancelled")
    ]
    assert _types(client, cancels) == ["fine_tuning.job.cancelled"]
    other_deliveries = httpx.get(
        f"{api_url}/v1/webhooks/{other.json()['id']}/deliveries",
        headers={"Authorization": f"Bearer {other_key}"},
    )
    assert other_deliveries.json()["data"] == []  # another tenant's endpoint hears nothing of this job

    (delivery,) = all_pages(client, f"/v1/webhooks/{cancels}/deliveries")
    event = delivery["event"]
    assert delivery["object"] == "webhook.delivery" and delivery["event_id"] == event["id"]
    assert event["object"] == "event" and event["type"] == "fine_tuning.job.cancelled"
    assert event["data"] == {"id": job_id} and isinstance(event["created_at"], int)
    # the same event, one id, for every endpoint it goes to
    events = {
        r["event_type"]: r["event_id"] for r in all_pages(client, f"/v1/webhooks/{everything}/deliveries")
    }
    assert events["fine_tuning.job.cancelled"] == delivery["event_id"]
    assert client.get(f"/v1/webhooks/{cancels}/deliveries", params={"status": "lost"}).status_code == 400


def test_signature_matches_the_standard_webhooks_reference_vector() -> None:
    # the test vector of the Standard Webhooks reference libraries (standard-webhooks/libraries)
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    signature = sign(secret, msg_id="msg_p5jXN8AQM9LWM0D4loKWxJek", timestamp=1614265330, body=body)
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
