"""`client.webhooks` (sync and async) against the real API server: endpoints, the secret shown once,
typed errors naming the field, the delivery log of a job's state changes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import tunehouse
from tests.helpers import chat_rows, jsonl

NOWHERE = "http://127.0.0.1:9/hook"


@pytest.fixture
def sdk(api_url: str, api_key: str) -> Iterator[tunehouse.Client]:
    with tunehouse.Client(base_url=api_url, api_key=api_key) as client:
        yield client


def test_webhooks_round_trip(sdk: tunehouse.Client) -> None:
    created = sdk.webhooks.create(url=NOWHERE, events=["fine_tuning.job.cancelled"], description="ops")
    assert created.secret is not None and created.secret.startswith("whsec_")
    assert sdk.webhooks.retrieve(created.id).secret is None
    assert [w.id for w in sdk.webhooks.list()] == [created.id]

    f = sdk.files.create(file=jsonl(chat_rows(3)))
    job = sdk.fine_tuning.jobs.create(model="tunehouse/tiny-llama", training_file=f.id)
    sdk.fine_tuning.jobs.cancel(job.id)
    (delivery,) = list(sdk.webhooks.list_deliveries(created.id))
    assert delivery.event_type == "fine_tuning.job.cancelled" and delivery.event["data"] == {"id": job.id}

    with pytest.raises(tunehouse.BadRequestError) as bad:
        sdk.webhooks.create(url="ftp://example.com")
    assert bad.value.param == "url"
    with pytest.raises(tunehouse.BadRequestError) as bad:
        sdk.webhooks.create(url=NOWHERE, events=["fine_tuning.job.exploded"])
    assert bad.value.param == "events[0]"

    assert sdk.webhooks.delete(created.id).deleted
    with pytest.raises(tunehouse.NotFoundError):
        sdk.webhooks.list_deliveries(created.id)


def test_async_webhooks(api_url: str, api_key: str) -> None:
    async def flow() -> None:
        async with tunehouse.AsyncClient(base_url=api_url, api_key=api_key) as client:
            created = await client.webhooks.create(url=NOWHERE)
            assert created.events is None and created.secret
            assert [w.id async for w in await client.webhooks.list()] == [created.id]
            assert (await client.webhooks.retrieve(created.id)).url == NOWHERE
            assert [d async for d in await client.webhooks.list_deliveries(created.id, status="failed")] == []
            assert (await client.webhooks.delete(created.id)).deleted
            with pytest.raises(tunehouse.NotFoundError):
                await client.webhooks.retrieve(created.id)

    asyncio.run(flow())
