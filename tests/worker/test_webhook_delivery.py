"""The workers' webhook delivery loop, one pass at a time, on real PostgreSQL and a real HTTP receiver
(tests/webhook_receiver.py): the outbox row commits with the state change or not at all, a failed
attempt is retried after backoff and logged, delivery gives up after the attempt limit, a dead worker's
claim is taken over, and concurrent workers never send a delivery twice.

These rows live in a PostgreSQL database of this module's own: the e2e tests' worker stays alive for the
whole session, and its delivery loop would otherwise race these tests for every due delivery.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text, update
from sqlalchemy.orm import sessionmaker

from service.config import Settings
from service.db import session_scope
from service.ids import new_id
from service.jobs.events import add_event
from service.models import Tenant, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from service.webhooks.signing import new_secret
from tests.conftest import free_port
from tests.helpers import job_row
from tests.webhook_receiver import Receiver, start_receiver
from worker.webhooks import backoff_seconds, deliver_due

# retries are made due by hand (below), never by sleeping: a long backoff keeps them out of the way
SETTINGS = Settings(webhook_backoff_seconds=60, webhook_max_attempts=3, webhook_timeout_seconds=5)


@pytest.fixture(autouse=True)
def _empty_outbox(use_module_database: sessionmaker[Any]) -> Iterator[None]:
    yield
    with session_scope() as session:  # each test starts with an empty outbox
        session.execute(text("DELETE FROM webhook_attempts; DELETE FROM webhook_deliveries"))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec, server = start_receiver()
    yield rec
    server.shutdown()
    server.server_close()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=SETTINGS.webhook_timeout_seconds) as client:
        yield client


def _job_and_endpoint(url: str, events: list[str] | None = None) -> tuple[str, str, str]:
    """(job id, endpoint id, secret) of a fresh tenant."""
    job_id, secret = new_id("ftjob"), new_secret()
    with session_scope() as session:
        tenant = Tenant(id=new_id("tenant"), name=f"hooks-{job_id}")
        session.add(tenant)
        session.flush()
        endpoint = WebhookEndpoint(
            id=new_id("wh"), tenant_id=tenant.id, url=url, events=events, secret=secret
        )
        session.add(endpoint)
        session.add(job_row(tenant.id, id=job_id))
    return job_id, endpoint.id, secret


def _event(job_id: str, status: str = "cancelled") -> None:
    with session_scope() as session:
        add_event(session, job_id, f"Job {status}", data={"kind": f"job.{status}", "status": status})


def _deliveries(endpoint_id: str) -> list[WebhookDelivery]:
    with session_scope() as session:
        return list(
            session.scalars(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id))
        )


def _attempts(delivery_id: str) -> list[tuple[int, int | None]]:
    with session_scope() as session:
        rows = session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id == delivery_id)
            .order_by(WebhookAttempt.attempt)
        )
        return [(a.attempt, a.status_code) for a in rows]


def _make_due(endpoint_id: str) -> None:
    """What waiting out the backoff does, without the wait."""
    with session_scope() as session:
        session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.endpoint_id == endpoint_id)
            .values(next_attempt_at=time.time())
        )


def _pass(http: httpx.Client, worker: str = "w1") -> int:
    return deliver_due(worker_id=worker, client=http, settings=SETTINGS)


def test_the_outbox_row_commits_with_the_state_change_or_not_at_all(receiver: Receiver) -> None:
    job_id, endpoint_id, _ = _job_and_endpoint(receiver.url("/a"))
    with pytest.raises(RuntimeError), session_scope() as session:
        add_event(session, job_id, "Job cancelled", data={"kind": "job.cancelled", "status": "cancelled"})
        raise RuntimeError("the process dies before the commit")
    assert _deliveries(endpoint_id) == []
    _event(job_id)
    (row,) = _deliveries(endpoint_id)
    assert (row.status, row.event_type, row.payload["data"]) == (
        "pending",
        "fine_tuning.job.cancelled",
        {"id": job_id},
    )
    # a pause request is no transition; a step's metrics event is no webhook event
    with session_scope() as session:
        add_event(
            session, job_id, "Pause requested", data={"kind": "job.pause_requested", "status": "running"}
        )
        add_event(session, job_id, "Step 1/2", type="metrics", data={"step": 1, "loss": 1.0})
    assert len(_deliveries(endpoint_id)) == 1


def test_a_failed_attempt_is_retried_after_backoff_and_logged(receiver: Receiver, http: httpx.Client) -> None:
    receiver.fail_first.add("/flaky")
    job_id, endpoint_id, secret = _job_and_endpoint(receiver.url("/flaky"))
    receiver.secrets["/flaky"] = secret
    _event(job_id)
    before = time.time()
    assert _pass(http) == 1  # answered 500
    (row,) = _deliveries(endpoint_id)
    assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, 500)
    assert row.last_error is not None and row.last_error.startswith("HTTP 500")
    assert before + 60 <= row.next_attempt_at <= time.time() + 60  # the backoff
    assert _pass(http) == 0  # not due yet
    _make_due(endpoint_id)
    assert _pass(http) == 1
    (row,) = _deliveries(endpoint_id)
    assert (row.status, row.attempts, row.last_status_code, row.last_error) == ("delivered", 2, 200, None)
    assert row.delivered_at is not None
    assert _attempts(row.id) == [(1, 500), (2, 200)]
    assert receiver.figures() == {"sent": 2, "retried": 1, "delivered": 1, "signature_failures": 0}
    assert [r.msg_id for r in receiver.seen] == [row.event_id] * 2  # one webhook-id across retries
    assert _pass(http) == 0  # delivered: never sent again


def test_delivery_gives_up_after_the_attempt_limit(http: httpx.Client) -> None:
    closed = f"http://127.0.0.1:{free_port()}/gone"  # nothing listens there: connection refused
    job_id, endpoint_id, _ = _job_and_endpoint(closed)
    _event(job_id)
    for _ in range(SETTINGS.webhook_max_attempts):
        assert _pass(http) == 1
        _make_due(endpoint_id)
    (row,) = _deliveries(endpoint_id)
    assert (row.status, row.attempts, row.last_status_code) == ("failed", 3, None)
    assert row.last_error is not None and "ConnectError" in row.last_error
    assert _attempts(row.id) == [(1, None), (2, None), (3, None)]
    assert _pass(http) == 0


def test_a_dead_workers_claim_is_taken_over_a_live_one_is_not(receiver: Receiver, http: httpx.Client) -> None:
    job_id, endpoint_id, secret = _job_and_endpoint(receiver.url("/claims"))
    receiver.secrets["/claims"] = secret
    _event(job_id)
    with session_scope() as session:
        session.execute(update(WebhookDelivery).values(claimed_by="alive", claimed_until=time.time() + 600))
    assert _pass(http) == 0
    with session_scope() as session:
        session.execute(update(WebhookDelivery).values(claimed_by="dead", claimed_until=time.time() - 1))
    assert _pass(http) == 1
    assert [d.status for d in _deliveries(endpoint_id)] == ["delivered"]


def test_concurrent_workers_never_send_a_delivery_twice(receiver: Receiver) -> None:
    job_id, endpoint_id, secret = _job_and_endpoint(receiver.url("/many"))
    receiver.secrets["/many"] = secret
    for _ in range(30):
        _event(job_id)
    start = threading.Barrier(4)

    def work(name: str) -> None:
        with httpx.Client(timeout=5) as client:
            start.wait()
            deliver_due(worker_id=name, client=client, settings=SETTINGS)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = Counter(r.msg_id for r in receiver.seen)
    assert len(counts) == 30 and set(counts.values()) == {1}, counts
    assert {d.status for d in _deliveries(endpoint_id)} == {"delivered"}
    assert receiver.figures()["signature_failures"] == 0


def test_backoff_doubles_up_to_the_cap() -> None:
    settings = Settings(webhook_backoff_seconds=5, webhook_backoff_max_seconds=30)
    assert [backoff_seconds(n, settings) for n in range(1, 6)] == [5, 10, 20, 30, 30]


def test_filtered_endpoint_gets_only_its_types(receiver: Receiver) -> None:
    job_id, endpoint_id, _ = _job_and_endpoint(receiver.url("/f"), events=["fine_tuning.job.succeeded"])
    _event(job_id, "cancelled")
    _event(job_id, "succeeded")
    assert [d.event_type for d in _deliveries(endpoint_id)] == ["fine_tuning.job.succeeded"]
