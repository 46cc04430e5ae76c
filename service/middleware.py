"""The two ASGI middlewares around every request (pure ASGI, so streamed responses pass untouched).

RequestContext (outermost): a request id for every request, returned as `x-request-id` and logged with
  one line per request; an exception that escaped every handler becomes a 500 in the error envelope
  *here*, so the connection stays usable (Starlette's last-resort handler re-raises after answering,
  and uvicorn then drops a keep-alive connection without `Connection: close`).
BodyGuard: request bodies are bounded (413) and JSON bodies are checked once for values no column can
  hold (service.input_guard), before FastAPI parses them; only the streamed upload is exempt, and
  bounds itself while streaming (service/files/upload.py). A Content-Length over a route's bound, the
  upload's included, is answered 413 from the headers, before any of the body is read.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Mapping

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import BadRequest, PayloadTooLarge, internal_error
from service.input_guard import unsafe_value

log = logging.getLogger("tunehouse.api")

# a client's own request id is echoed and logged, so it must be short and plain
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(scope: Scope) -> str | None:
    rid = scope.get("state", {}).get("request_id")
    return str(rid) if rid else None


class RequestContext:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        rid = given if _CLIENT_REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                MutableHeaders(scope=message)["x-request-id"] = rid
                # logged when the response starts: a stream's line must not wait for its end
                log.info(
                    "%s %s %s %.1fms request_id=%s",
                    scope["method"],
                    scope["path"],
                    message["status"],
                    (time.perf_counter() - started) * 1000,
                    rid,
                )
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            return  # nobody is left to answer
        except Exception:
            log.exception("unhandled error in %s %s request_id=%s", scope["method"], scope["path"], rid)
            if response_started:
                raise  # half a body is out: only dropping the connection tells the client
            await internal_error(rid)(scope, receive, send_with_id)


def _parsed_as_json(content_type: str) -> bool:
    # the content types FastAPI decodes as JSON for a body parameter (fastapi/routing.py)
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BodyGuard:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, streamed: Mapping[tuple[str, str], int]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # (method, path) of the routes that stream and bound their own bodies: the most each may be
        self.streamed = dict(streamed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        streamed = self.streamed.get((scope["method"], scope["path"]))
        limit = self.max_body_bytes if streamed is None else streamed
        if length is not None and length.isdigit() and int(length) > limit:
            await self._too_large(limit, announced=int(length)).response()(scope, receive, send)
            return
        if streamed is not None:
            await self.app(scope, receive, send)
            return
        if length is None and "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)  # no body
            return

        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await self._too_large(self.max_body_bytes).response()(scope, receive, send)
                return

        if body and _parsed_as_json(headers.get("content-type", "")):
            error = _json_problem(bytes(body))
            if error is not None:
                await error.response()(scope, receive, send)
                return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: disconnect notices for streaming responses

        await self.app(scope, replay, send)

    @staticmethod
    def _too_large(limit: int, *, announced: int | None = None) -> PayloadTooLarge:
        size = "" if announced is None else f" ({announced} bytes by its Content-Length)"
        return PayloadTooLarge(
            f"request body{size} is larger than the limit of {limit} bytes", code="request_too_large"
        )


def _json_problem(body: bytes) -> BadRequest | None:
    try:
        value = json.loads(body)
    except RecursionError:
        return BadRequest("request body: JSON is nested too deeply", code="invalid_json")
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        return BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json")
    found = unsafe_value(value)
    if found is None:
        return None
    param, problem = found
    return BadRequest(f"{param or 'request body'}: {problem}", param=param or None, code="invalid_value")
