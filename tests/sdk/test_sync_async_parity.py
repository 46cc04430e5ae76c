"""`Client` and `AsyncClient` offer the same API: the same resources, the same public methods with the same
parameters (keyword-only after the ids, each with a per-call `timeout`) and the same return types (async
ones awaited, or iterated for streams). Compared by `inspect.signature`, so the two cannot drift again."""

from __future__ import annotations

import inspect
import typing
from collections.abc import AsyncIterator, Iterator

import pytest

import tunehouse
from tunehouse._pagination import AsyncPage, SyncPage
from tunehouse._resource import AsyncAPIResource, SyncAPIResource


def _resources(root: object, path: str = "client") -> dict[str, object]:
    """Every resource reachable from a client, by attribute path (`client.fine_tuning.jobs`, ...)."""
    found: dict[str, object] = {}
    for name, value in vars(root).items():
        if name.startswith("_") or not hasattr(value, "__dict__") or isinstance(value, type):
            continue
        if type(value).__module__.startswith("tunehouse"):
            here = f"{path}.{name}"
            if isinstance(value, SyncAPIResource | AsyncAPIResource):
                found[here] = value
            found.update(_resources(value, here))
    return found


def _public_methods(resource: object) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(resource, name))
        for name in dir(resource)
        if not name.startswith("_") and callable(getattr(resource, name))
    }


def _as_sync(annotation: object) -> object:
    """What the async return annotation is on the sync side: AsyncPage[X] -> SyncPage[X], and so on."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is AsyncPage:
        return SyncPage[args[0]]  # type: ignore[valid-type]
    if origin is AsyncIterator:
        return Iterator[args[0]]  # type: ignore[valid-type]
    return annotation


@pytest.fixture
def clients() -> Iterator[tuple[tunehouse.Client, tunehouse.AsyncClient]]:
    sync = tunehouse.Client(base_url="http://127.0.0.1:9", api_key="k")
    async_ = tunehouse.AsyncClient(base_url="http://127.0.0.1:9", api_key="k")
    yield sync, async_
    sync.close()  # the async one opened no connection: nothing to close


def test_the_same_resources_and_methods(clients: tuple[tunehouse.Client, tunehouse.AsyncClient]) -> None:
    sync, async_ = clients
    sync_resources, async_resources = _resources(sync), _resources(async_)
    assert sorted(sync_resources) == sorted(async_resources)
    # the walk found the whole tree (a resource attached under another name would show up here)
    assert sorted(sync_resources) == [
        "client.chat.completions",
        "client.files",
        "client.fine_tuning.jobs",
        "client.fine_tuning.jobs.checkpoints",
        "client.models",
        "client.webhooks",
    ]
    for path, resource in sync_resources.items():
        assert isinstance(resource, SyncAPIResource), path
        assert isinstance(async_resources[path], AsyncAPIResource), path
        assert sorted(_public_methods(resource)) == sorted(_public_methods(async_resources[path])), path


def test_each_method_has_its_twins_signature(clients: tuple[tunehouse.Client, tunehouse.AsyncClient]) -> None:
    sync, async_ = clients
    async_resources = _resources(async_)
    checked = 0
    for path, resource in _resources(sync).items():
        twin = async_resources[path]
        for name, sig in _public_methods(resource).items():
            where = f"{path}.{name}"
            async_sig = inspect.signature(getattr(twin, name))
            assert list(sig.parameters.values()) == list(async_sig.parameters.values()), where
            assert _as_sync(async_sig.return_annotation) == sig.return_annotation, where
            assert sig.return_annotation is not inspect.Signature.empty, where
            # awaited, except a stream, which is iterated with `async for`
            is_stream = typing.get_origin(async_sig.return_annotation) is AsyncIterator
            assert inspect.iscoroutinefunction(getattr(twin, name)) is not is_stream, where
            assert not inspect.iscoroutinefunction(getattr(resource, name)), where
            # ids positional, everything else keyword-only; a per-call timeout everywhere
            kinds = [p.kind for p in sig.parameters.values()]
            assert kinds == sorted(kinds), where  # no keyword-only parameter before a positional one
            for param in sig.parameters.values():
                if param.kind is not param.KEYWORD_ONLY:
                    assert param.kind is param.POSITIONAL_OR_KEYWORD and param.default is param.empty, where
            assert sig.parameters["timeout"].kind is inspect.Parameter.KEYWORD_ONLY, where
            assert sig.parameters["timeout"].default is None, where
            checked += 1
    assert checked == 28  # files 5, jobs 11, checkpoints 2, webhooks 5, models 3, chat 2


def test_creates_take_an_idempotency_key(clients: tuple[tunehouse.Client, tunehouse.AsyncClient]) -> None:
    sync, async_ = clients
    for client in (sync, async_):
        for create in (client.files.create, client.fine_tuning.jobs.create, client.webhooks.create):
            param = inspect.signature(create).parameters["idempotency_key"]
            assert param.kind is param.KEYWORD_ONLY and param.default is None
