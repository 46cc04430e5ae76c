"""Resource methods written once for both clients.

A resource method is written once, on a class shared by the sync and the async resource, as a function
that *describes* the call: it returns an operation (an `APIRequest`, a page request, a stream, a
download) and does no I/O. The decorators below turn it into the public method:

    class _Jobs:
        @endpoint
        def retrieve(self, job_id: str, *, timeout: float | None = None) -> APIRequest[FineTuningJob]:
            return APIRequest("GET", f"{JOBS}/{job_id}", parse_as(FineTuningJob), timeout=timeout)

    class Jobs(_Jobs, SyncAPIResource): ...       # jobs.retrieve(id) -> FineTuningJob
    class AsyncJobs(_Jobs, AsyncAPIResource): ...  # await jobs.retrieve(id) -> FineTuningJob

so the two clients cannot drift: one parameter list, one docstring, one request. Each operation runs
itself on a `SyncTransport` (`run_sync`) or an `AsyncTransport` (`run_async`); those and the transports
are the only code written twice. mypy sees the right type on each side (the descriptors' `__get__` is
overloaded on the resource's flavour) and `inspect.signature` shows the public signature.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

import httpx
from pydantic import BaseModel

from tunehouse._base_client import AsyncTransport, SyncTransport
from tunehouse._pagination import AsyncPage, PageRequest, SyncPage

P = ParamSpec("P")
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
Y_co = TypeVar("Y_co", covariant=True)
M = TypeVar("M", bound=BaseModel)


class Operation(Protocol[T_co]):
    """What a resource method returns: a call that can run on either transport with the same result."""

    def run_sync(self, transport: SyncTransport) -> T_co: ...

    async def run_async(self, transport: AsyncTransport) -> T_co: ...


class StreamOperation(Protocol[Y_co]):
    """A call whose answer is a stream of items: an iterator on one side, an async iterator on the other."""

    def run_sync(self, transport: SyncTransport) -> Iterator[Y_co]: ...

    def run_async(self, transport: AsyncTransport) -> AsyncIterator[Y_co]: ...


class SyncAPIResource:
    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport


class AsyncAPIResource:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport


def parse_as(model: type[M]) -> Callable[[httpx.Response], M]:
    """An answer's JSON body as `model`."""

    def parse(response: httpx.Response) -> M:
        return model.model_validate(response.json())

    return parse


class _Method(Generic[P]):
    """The shared part of the decorators: binding to a resource, and the public signature."""

    def __init__(self, build: Callable[Concatenate[Any, P], Any]) -> None:
        self._build = build
        self.__doc__ = build.__doc__
        self._signatures: dict[bool, inspect.Signature] = {}

    def _result(self, is_async: bool, built: Any) -> Any:
        """The public return annotation, from the builder's (e.g. `APIRequest[X]` -> `X`)."""
        raise NotImplementedError

    def signature(self, *, is_async: bool) -> inspect.Signature:
        """The public method's signature: the builder's without `self`, returning what the caller gets."""
        if is_async not in self._signatures:
            built = typing.get_type_hints(self._build)["return"]
            sig = inspect.signature(self._build)
            params = list(sig.parameters.values())[1:]
            self._signatures[is_async] = sig.replace(
                parameters=params, return_annotation=self._result(is_async, built)
            )
        return self._signatures[is_async]

    # an async method's result is awaited (a coroutine function); a stream's is iterated instead
    _awaited = True

    def _bind(self, obj: object) -> Any:
        """The public method on `obj`: build the operation, run it on `obj`'s transport."""
        build = self._build
        if isinstance(obj, SyncAPIResource):
            sync_transport = obj._transport

            def call(*args: Any, **kwargs: Any) -> Any:
                return build(obj, *args, **kwargs).run_sync(sync_transport)

            return self._bound(call, is_async=False)
        if isinstance(obj, AsyncAPIResource):
            async_transport = obj._transport
            if not self._awaited:

                def iterate(*args: Any, **kwargs: Any) -> Any:
                    return build(obj, *args, **kwargs).run_async(async_transport)

                return self._bound(iterate, is_async=True)

            async def acall(*args: Any, **kwargs: Any) -> Any:
                return await build(obj, *args, **kwargs).run_async(async_transport)

            return self._bound(acall, is_async=True)
        return self  # looked up on the class (help(), the docs)

    def _bound(self, function: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
        functools.update_wrapper(function, self._build)
        del function.__wrapped__  # type: ignore[attr-defined]  # else inspect shows the builder's
        function.__signature__ = self.signature(is_async=is_async)  # type: ignore[attr-defined]
        return function


class endpoint(_Method[P], Generic[P, T]):  # used as a decorator, named as one
    """A method that returns one result: `T` on the sync client, an awaitable `T` on the async one."""

    def __init__(self, build: Callable[Concatenate[Any, P], Operation[T]]) -> None:
        super().__init__(build)

    def _result(self, is_async: bool, built: Any) -> Any:
        args = typing.get_args(built)
        if args:  # APIRequest[X]
            return args[0]
        return typing.get_type_hints(built.run_sync)["return"]  # a non-generic operation

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: SyncAPIResource, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncAPIResource, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, obj: object, owner: type[Any]) -> Any:
        return self._bind(obj)


class paged(_Method[P], Generic[P, M]):
    """A list method: a `SyncPage` on the sync client, an awaitable `AsyncPage` on the async one."""

    def __init__(self, build: Callable[Concatenate[Any, P], PageRequest[M]]) -> None:
        super().__init__(build)

    def _result(self, is_async: bool, built: Any) -> Any:
        (item,) = typing.get_args(built)
        return AsyncPage[item] if is_async else SyncPage[item]  # type: ignore[valid-type]

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: SyncAPIResource, owner: type[Any]) -> Callable[P, SyncPage[M]]: ...
    @overload
    def __get__(
        self, obj: AsyncAPIResource, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, AsyncPage[M]]]: ...
    def __get__(self, obj: object, owner: type[Any]) -> Any:
        return self._bind(obj)


class streamed(_Method[P], Generic[P, T]):
    """A method whose answer is a stream: an `Iterator` on the sync client, an `AsyncIterator` on the
    async one (iterated with `async for`, not awaited)."""

    _awaited = False

    def __init__(self, build: Callable[Concatenate[Any, P], StreamOperation[T]]) -> None:
        super().__init__(build)

    def _result(self, is_async: bool, built: Any) -> Any:
        item = typing.get_type_hints(built.run_sync)["return"].__args__[0]
        return AsyncIterator[item] if is_async else Iterator[item]  # type: ignore[valid-type]

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: SyncAPIResource, owner: type[Any]) -> Callable[P, Iterator[T]]: ...
    @overload
    def __get__(self, obj: AsyncAPIResource, owner: type[Any]) -> Callable[P, AsyncIterator[T]]: ...
    def __get__(self, obj: object, owner: type[Any]) -> Any:
        return self._bind(obj)
