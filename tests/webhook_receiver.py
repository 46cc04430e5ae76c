"""A real HTTP receiver for webhook tests: a threaded http.server on a free port that checks every
request's Standard Webhooks signature three times (our `verify`, the reference `standardwebhooks`
library and the official `openai` client's `webhooks.verify_signature`, so a bug shared by our signer
and our verifier still fails), answers 500 on purpose to the
first attempt of each event on the paths told to, and records everything it saw."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from openai import InvalidWebhookSignatureError, OpenAI
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from service.webhooks.signing import verify


@dataclass
class Received:
    path: str
    msg_id: str
    body: dict[str, Any]
    signed_ok: bool
    answered: int


@dataclass
class Receiver:
    base_url: str = ""
    # path -> the endpoint's secret, set once the endpoint exists
    secrets: dict[str, str] = field(default_factory=dict)
    # paths whose first attempt at each event is answered 500
    fail_first: set[str] = field(default_factory=set)
    seen: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # only its signature check is used: it never connects anywhere
    official: OpenAI = field(default_factory=lambda: OpenAI(api_key="unused", base_url="http://127.0.0.1:9"))

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def handle(self, path: str, headers: dict[str, str], raw: bytes) -> int:
        secret = self.secrets.get(path)
        ours = secret is not None and verify(secret, headers=headers, body=raw, now=time.time())
        try:
            Webhook(secret or "whsec_AAAA").verify(raw, headers)
            reference = secret is not None
        except WebhookVerificationError:
            reference = False
        try:
            self.official.webhooks.verify_signature(raw, headers, secret=secret or "whsec_AAAA")
            official = secret is not None
        except InvalidWebhookSignatureError:
            official = False
        signed_ok = ours and reference and official
        msg_id = headers.get("webhook-id", "")
        with self.lock:
            earlier = sum(1 for r in self.seen if r.path == path and r.msg_id == msg_id)
            answered = 401 if not signed_ok else 500 if path in self.fail_first and earlier == 0 else 200
            self.seen.append(Received(path, msg_id, json.loads(raw), signed_ok, answered))
        return answered

    def delivered(self, path: str) -> list[dict[str, Any]]:
        """The events accepted on a path, in arrival order."""
        with self.lock:
            return [r.body for r in self.seen if r.path == path and r.answered == 200]

    def figures(self) -> dict[str, int]:
        """sent: requests received; retried: requests after the first for an event; delivered: events
        answered 200; signature_failures: requests whose signature did not verify."""
        with self.lock:
            per_event = Counter((r.path, r.msg_id) for r in self.seen)
            return {
                "sent": len(self.seen),
                "retried": sum(n - 1 for n in per_event.values()),
                "delivered": sum(1 for r in self.seen if r.answered == 200),
                "signature_failures": sum(1 for r in self.seen if not r.signed_ok),
            }


def start_receiver() -> tuple[Receiver, ThreadingHTTPServer]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", "0")))
            status = receiver.handle(self.path, {k.lower(): v for k, v in self.headers.items()}, raw)
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest shows failures
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver, server
