"""How a worker that answers one request on a reply channel (an inference or an estimate) reports what
went wrong: the client's own mistakes as a 400, a blob store it may retry as a 503, anything else as a
500 that names the request (the traceback goes to the worker's log, not to the client)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from service.inference.replies import ReplyWriter
from service.storage.base import BlobStoreUnavailable
from worker.models import ModelNotAvailable


class RequestRefused(Exception):
    """The request cannot be served as asked (the client's fault): answered as a 400 naming ``param``."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@contextmanager
def errors_replied(
    replies: ReplyWriter, *, request_id: str, log: logging.Logger, failed: str, code: str
) -> Iterator[None]:
    """Run the block; send its refusal or failure on ``replies`` instead of raising, and close them.
    ``failed``: the 500's message, ``code`` its code."""
    try:
        yield
    except (RequestRefused, ModelNotAvailable) as exc:
        replies.send({"type": "error", "status": 400, "message": exc.message, "param": exc.param})
    except BlobStoreUnavailable as exc:  # the checkpoint or file could not be fetched: the client may retry
        replies.send({"type": "error", "status": 503, "message": exc.message, "code": exc.code})
    except Exception:
        log.exception("%s failed", request_id)
        replies.send({"type": "error", "status": 500, "message": failed, "param": None, "code": code})
    finally:
        replies.close()
