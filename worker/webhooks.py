"""Each worker's webhook delivery loop: sends what the outbox holds (service/webhooks/events.py).

A thread in the worker's main process, next to the reconciler (worker/reaper.py): the trainer runs in
its own child process, so a slow or dead receiver never slows training. Every `webhook_poll_seconds`
it takes the due deliveries and, for each,
- claims it with a compare-and-set on its row (pending, due, and unclaimed or claimed past its hold),
  so several workers never send the same delivery at the same time;
- POSTs the event signed per Standard Webhooks (service/webhooks/signing.py), outside any transaction;
- logs the attempt (status code or error, duration) and moves the row: `delivered` on a 2xx; else
  retried after `webhook_backoff_seconds` x 2^(attempts-1) (capped), and `failed` after
  `webhook_max_attempts` attempts.
A worker that dies mid-send leaves its claim to expire; another worker sends the delivery again, with
the same `webhook-id`, so receivers dedupe by that id (at-least-once, as Standard Webhooks expects).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import httpx
from sqlalchemy import or_, select, update

from service.config import Settings, get_settings
from service.db import session_scope
from service.ids import now
from service.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from service.webhooks.signing import headers
from worker.outage import is_outage

log = logging.getLogger("tunehouse.worker")

# deliveries taken per pass; the rest wait for the next pass (a pass ends early only if none are due)
BATCH = 50
# a claim outlives the attempt's timeout by this much before another worker may take the delivery over
CLAIM_MARGIN_SECONDS = 30.0
# how much of a failing receiver's answer the log keeps
ERROR_EXCERPT_CHARS = 300


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def backoff_seconds(attempts: int, settings: Settings) -> float:
    """Wait before the next try after `attempts` failed ones: backoff, 2x, 4x, ... capped."""
    return float(
        min(settings.webhook_backoff_seconds * 2 ** (attempts - 1), settings.webhook_backoff_max_seconds)
    )


def _due(t: float) -> object:
    return (
        (WebhookDelivery.status == "pending")
        & (WebhookDelivery.next_attempt_at <= t)
        & or_(WebhookDelivery.claimed_until.is_(None), WebhookDelivery.claimed_until < t)
    )


def claim(delivery_id: str, *, worker_id: str, hold_seconds: float) -> bool:
    """Compare-and-set: True if this worker now holds the delivery."""
    t = time.time()
    with session_scope() as session:
        result = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, _due(t))  # type: ignore[arg-type]
            .values(claimed_by=worker_id, claimed_until=t + hold_seconds)
            .execution_options(synchronize_session=False)
        )
        return bool(getattr(result, "rowcount", 0) == 1)


def post(client: httpx.Client, *, url: str, secret: str, msg_id: str, body: bytes) -> Outcome:
    try:
        response = client.post(
            url, content=body, headers=headers(secret, msg_id=msg_id, timestamp=now(), body=body)
        )
    except httpx.HTTPError as exc:
        return Outcome(None, f"{type(exc).__name__}: {exc}"[:ERROR_EXCERPT_CHARS])
    if 200 <= response.status_code < 300:
        return Outcome(response.status_code, None)
    text = response.text[:ERROR_EXCERPT_CHARS]
    return Outcome(response.status_code, f"HTTP {response.status_code}" + (f": {text}" if text else ""))


def deliver(delivery_id: str, *, worker_id: str, client: httpx.Client, settings: Settings) -> Outcome | None:
    """Claim, send and record one delivery; None if another worker holds it or it is no longer due."""
    if not claim(
        delivery_id, worker_id=worker_id, hold_seconds=settings.webhook_timeout_seconds + CLAIM_MARGIN_SECONDS
    ):
        return None
    with session_scope() as session:
        found = session.execute(
            select(WebhookDelivery, WebhookEndpoint.url, WebhookEndpoint.secret)
            .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
            .where(WebhookDelivery.id == delivery_id)
        ).one_or_none()
        if found is None:
            return None  # its endpoint was deleted meanwhile
        row, url, secret = found
        event_id, payload, attempt = row.event_id, row.payload, row.attempts + 1
    body = json.dumps(payload, separators=(",", ":")).encode()
    started = time.time()
    outcome = post(client, url=url, secret=secret, msg_id=event_id, body=body)
    finished = time.time()
    with session_scope() as session:
        values: dict[str, object] = {
            "attempts": attempt,
            "last_status_code": outcome.status_code,
            "last_error": outcome.error,
            "claimed_by": None,
            "claimed_until": None,
        }
        if outcome.ok:
            values.update(status="delivered", delivered_at=now())
        elif attempt >= settings.webhook_max_attempts:
            values.update(status="failed")
        else:
            values.update(next_attempt_at=finished + backoff_seconds(attempt, settings))
        moved = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, WebhookDelivery.claimed_by == worker_id)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if getattr(moved, "rowcount", 0) == 1:  # else: deleted with its endpoint, or our claim expired
            session.add(
                WebhookAttempt(
                    delivery_id=delivery_id,
                    attempt=attempt,
                    started_at=started,
                    duration_ms=(finished - started) * 1000,
                    status_code=outcome.status_code,
                    error=outcome.error,
                    worker_id=worker_id,
                )
            )
    return outcome


def deliver_due(*, worker_id: str, client: httpx.Client, settings: Settings) -> int:
    """One pass over the due deliveries, oldest first; returns how many this worker sent."""
    with session_scope() as session:
        due = list(
            session.scalars(
                select(WebhookDelivery.id)
                .where(_due(time.time()))  # type: ignore[arg-type]
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(BATCH)
            )
        )
    return sum(deliver(d, worker_id=worker_id, client=client, settings=settings) is not None for d in due)


def start_delivery_loop(stop: threading.Event, *, worker_id: str) -> threading.Thread:
    settings = get_settings()

    def loop() -> None:
        # no redirects: a signed event goes to the URL the tenant registered, nowhere else
        with httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False) as client:
            while not stop.wait(settings.webhook_poll_seconds):
                try:
                    deliver_due(worker_id=worker_id, client=client, settings=settings)
                except Exception as exc:  # the loop must outlive anything a pass meets
                    if is_outage(exc):
                        log.warning("webhook delivery pass skipped: database unavailable")
                    else:
                        log.exception("webhook delivery pass failed")

    thread = threading.Thread(target=loop, name="tunehouse-webhooks", daemon=True)
    thread.start()
    return thread
