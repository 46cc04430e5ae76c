"""Logging for the API process: our handler, and no secret in any access log line.

uvicorn's access log writes the request line, query string included. Keys travel in the
`Authorization` header, which no log line here records; but a client that puts one in the URL
(`?api_key=...`, as some tools do) must not leave it in the operator's log files, so every query
parameter whose name looks like a credential is masked in the log record before any handler sees it.

    >>> redact("/v1/files?api_key=th-abc-secret&limit=2")
    '/v1/files?api_key=[redacted]&limit=2'
"""

from __future__ import annotations

import logging
import re

from service.config import get_settings

_SECRET_PARAM = re.compile(
    r"(?i)([?&;](?:api[_-]?key|key|token|access[_-]?token|auth|authorization|password|secret)=)[^&;\s\"]*"
)


def redact(text: str) -> str:
    return _SECRET_PARAM.sub(r"\1[redacted]", text)


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def configure_logging() -> None:
    # uvicorn configures its loggers before it imports the app, so the filter added here stays on
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
    # uvicorn configures only its own loggers; ours need a handler to reach the server's log
    logger = logging.getLogger("tunehouse")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(get_settings().log_level.upper())
