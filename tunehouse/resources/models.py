"""`client.models`: the base models this deployment can train (with what each is) and the organization's
fine-tuned models; delete a fine-tuned one. Each method is written once, for both clients."""

from __future__ import annotations

from urllib.parse import quote

import httpx

from tunehouse._base_client import APIRequest
from tunehouse._resource import AsyncAPIResource, SyncAPIResource, endpoint, parse_as
from tunehouse.types import Model, ModelDeleted

MODELS = "/v1/models"


def _models(response: httpx.Response) -> list[Model]:
    return [Model.model_validate(item) for item in response.json()["data"]]


class _Models:
    @endpoint
    def list(self, *, timeout: float | None = None) -> APIRequest[list[Model]]:
        """Base models first, then the organization's fine-tuned models (one list: it is not paged)."""
        return APIRequest("GET", MODELS, _models, timeout=timeout)

    @endpoint
    def retrieve(self, model: str, *, timeout: float | None = None) -> APIRequest[Model]:
        return APIRequest("GET", f"{MODELS}/{quote(model, safe='/:')}", parse_as(Model), timeout=timeout)

    @endpoint
    def delete(self, model: str, *, timeout: float | None = None) -> APIRequest[ModelDeleted]:
        """Delete a fine-tuned model (`ft:...`); its job keeps its history."""
        path = f"{MODELS}/{quote(model, safe='/:')}"
        return APIRequest("DELETE", path, parse_as(ModelDeleted), timeout=timeout)


class Models(_Models, SyncAPIResource):
    pass


class AsyncModels(_Models, AsyncAPIResource):
    pass
