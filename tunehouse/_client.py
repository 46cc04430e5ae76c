"""`Client` and `AsyncClient`: the entry points of the SDK.

from tunehouse import Client
client = Client()  # TUNEHOUSE_BASE_URL, TUNEHOUSE_API_KEY
f = client.files.create(file="train.jsonl")
job = client.fine_tuning.jobs.create(model="tunehouse/tiny-llama", training_file=f.id)
job = client.fine_tuning.jobs.wait(job.id)
for chunk in client.chat.completions.stream(model=job.fine_tuned_model, messages=[...]): ...
"""

from __future__ import annotations

from types import TracebackType

from tunehouse._base_client import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    AsyncTransport,
    SyncTransport,
    resolve_config,
)
from tunehouse.resources.chat import AsyncChat, Chat
from tunehouse.resources.files import AsyncFiles, Files
from tunehouse.resources.jobs import AsyncJobs, Jobs
from tunehouse.resources.models import AsyncModels, Models
from tunehouse.resources.webhooks import AsyncWebhooks, Webhooks


class FineTuning:
    def __init__(self, transport: SyncTransport) -> None:
        self.jobs = Jobs(transport)


class AsyncFineTuning:
    def __init__(self, transport: AsyncTransport) -> None:
        self.jobs = AsyncJobs(transport)


class Client:
    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        self.base_url, api_key = resolve_config(base_url, api_key)
        self._transport = SyncTransport(self.base_url, api_key, timeout, max_retries)
        self.files = Files(self._transport)
        self.fine_tuning = FineTuning(self._transport)
        self.models = Models(self._transport)
        self.chat = Chat(self._transport)
        self.webhooks = Webhooks(self._transport)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient:
    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        self.base_url, api_key = resolve_config(base_url, api_key)
        self._transport = AsyncTransport(self.base_url, api_key, timeout, max_retries)
        self.files = AsyncFiles(self._transport)
        self.fine_tuning = AsyncFineTuning(self._transport)
        self.models = AsyncModels(self._transport)
        self.chat = AsyncChat(self._transport)
        self.webhooks = AsyncWebhooks(self._transport)

    async def close(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
