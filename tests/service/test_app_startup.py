"""The API's startup leaves its imported heap out of later garbage collections (service/app.py
`_freeze_startup_heap`): a full collection walking it stalled every request on the event loop, and
that stall was the read's p99 at 50 connections (git log -p docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import gc
import threading

from service.app import app


def test_the_apis_startup_freezes_the_heap_its_imports_built() -> None:
    frozen: list[int] = []

    async def start_and_stop() -> None:
        async with app.router.lifespan_context(app):
            frozen.append(gc.get_freeze_count())

    gc.unfreeze()
    # in a thread of its own, as under a test client: the startup installs no signal handler there
    thread = threading.Thread(target=lambda: asyncio.run(start_and_stop()))
    thread.start()
    thread.join()
    gc.unfreeze()  # the rest of this test process collects as before
    assert frozen and frozen[0] > 10_000  # the app's modules, routes and models: ~145,000 objects
