"""Draining: on SIGTERM/SIGINT the API ends its live streams so the server can exit within seconds.

uvicorn stops accepting connections on SIGTERM and then waits for every open response to finish; an
SSE stream follows a job that may train for hours, so without help the server would hang that long
while the port stays taken. At startup we chain onto uvicorn's signal handlers: the signal raises a
flag that each stream checks at least once a second, sends a `retry:` hint and ends; the SDK (and any
EventSource) reconnects with `Last-Event-ID` to the next instance. Plain requests are not affected:
uvicorn lets them finish.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("tunehouse.api")

_draining = threading.Event()
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def draining() -> bool:
    return _draining.is_set()


def install_drain_on_signals() -> None:
    """Chain onto the server's SIGTERM/SIGINT handlers; a no-op outside the main thread (TestClient)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        previous: Any = signal.getsignal(sig)
        if getattr(previous, "_tunehouse_drain", False):
            continue  # installed already (a second app in the same process)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            if not _draining.is_set():
                log.warning("signal %d: draining; open streams are being closed", signum)
            _draining.set()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # nobody else handles it: behave as without us
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        handler._tunehouse_drain = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)
