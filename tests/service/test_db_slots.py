"""Admission to the database pool (service/db_slots.py) on its own: a request that stops waiting for a
slot, because its client hung up or its time ran out, leaves every slot as it found it."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from service import db_slots
from service.config import get_settings
from service.errors import ServiceUnavailable


@pytest.fixture
def one_slot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TUNEHOUSE_DB_POOL_SIZE", "1")
    monkeypatch.setenv("TUNEHOUSE_DB_POOL_TIMEOUT_SECONDS", "0.3")
    monkeypatch.setattr(db_slots, "_slots", None)  # made again, of the size set here
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_a_waiter_cancelled_or_timed_out_takes_no_slot_and_the_next_gets_one_at_once(one_slot: None) -> None:
    async def main() -> None:
        holder_in, holder_out = anyio.Event(), anyio.Event()

        async def hold() -> None:
            async with db_slots.db_slot():
                holder_in.set()
                await holder_out.wait()

        async def wait_for_a_slot() -> None:
            async with db_slots.db_slot():
                raise AssertionError("admitted while the only slot was held")

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await holder_in.wait()
            with anyio.move_on_after(0.1) as hung_up:  # the client goes away while its request waits
                await wait_for_a_slot()
            assert hung_up.cancelled_caught
            with pytest.raises(ServiceUnavailable) as busy:  # nobody releases within the timeout
                await wait_for_a_slot()
            assert busy.value.code == "database_busy"
            holder_out.set()
        with anyio.fail_after(0.1):  # the slot is free again: neither waiter kept it
            async with db_slots.db_slot():
                pass
        assert db_slots._semaphore().value == 1

    anyio.run(main)
