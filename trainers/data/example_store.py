"""Tokenized examples kept on disk, read back by index: the training data never lives in RAM.

A method's tokenizer writes its examples (frozen dataclasses such as ``TokenizedExample`` or
``PreferenceExample``) one at a time into an ``ExampleWriter``; ``finish()`` returns an ``ExampleStore``,
a ``Sequence`` of the same dataclass that the loop indexes (``store[i]``, ``store[a:b]``, ``len``).

Layout: each ``list[int]`` (``list[bool]``) field is one flat int32 (uint8) file of every example's
values end to end, with the examples' start offsets in memory (8 bytes per example); a ``str`` field
is such a file of UTF-8 bytes, a ``dict[str, Any]`` field one of JSON text (an RL row's columns); each
scalar field (``bool``, ``int``, ``float``, ``float | None``) is an in-memory column of 8 bytes per
example. The flat files are anonymous temporary files (unlinked when created, so a crashed process
leaves nothing behind) in ``tempfile``'s directory, which the worker points at the job's work folder. They are
memory-mapped: the pages a step reads come from the page cache, and the resident size stays flat as
the training file grows (docs/benchmarks.md).

    >>> from trainers.data.sft import TokenizedExample
    >>> writer = ExampleWriter(TokenizedExample)
    >>> writer.append(TokenizedExample([5, 6, 7], [False, True, True]))
    >>> writer.append(TokenizedExample([8], [False]))
    >>> store = writer.finish()
    >>> len(store), store[0]
    (2, TokenizedExample(input_ids=[5, 6, 7], loss_mask=[False, True, True]))
    >>> store[1:]
    [TokenizedExample(input_ids=[8], loss_mask=[False])]
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import types
import typing
import weakref
from array import array
from collections.abc import Sequence
from typing import IO, Any, Generic, TypeVar, overload

import numpy as np

E = TypeVar("E")

# how a field is stored, from its annotation: lists on disk (ids as int32, masks as one byte per
# flag), scalars as 8-byte columns in memory
_IDS, _MASK, _BOOL, _INT, _FLOAT, _OPTIONAL_FLOAT = "ids", "mask", "bool", "int", "float", "float | None"
_TEXT, _JSON = "text", "json"
# vocabularies stay far below 2**31 ids; text and JSON are stored as their UTF-8 bytes
_ON_DISK = {_IDS: np.int32, _MASK: np.uint8, _TEXT: np.uint8, _JSON: np.uint8}
_ANNOTATIONS: dict[Any, str] = {
    list[int]: _IDS,
    list[bool]: _MASK,
    str: _TEXT,
    dict[str, Any]: _JSON,
    bool: _BOOL,
    int: _INT,
    float: _FLOAT,
    float | None: _OPTIONAL_FLOAT,
}
_MAX_TOKEN_ID = int(np.iinfo(np.int32).max)


def _field_kinds(cls: type) -> dict[str, str]:
    hints = typing.get_type_hints(cls)
    kinds = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if isinstance(hint, types.UnionType):  # X | None and Optional[X] compare equal once normalised
            hint = typing.Union[hint.__args__]  # noqa: UP007
        kind = _ANNOTATIONS.get(hint)
        if kind is None:
            raise TypeError(f"{cls.__name__}.{field.name}: an ExampleStore cannot hold {hint}")
        kinds[field.name] = kind
    return kinds


class ExampleWriter(Generic[E]):
    """Appends examples of the dataclass ``cls`` to disk; ``finish()`` hands them back as a store."""

    def __init__(self, cls: type[E]) -> None:
        self._cls = cls
        self._kinds = _field_kinds(cls)
        self._ids: dict[str, tuple[IO[bytes], array[int]]] = {
            # closed by finish(), or when an abandoned writer is collected (below)
            name: (tempfile.TemporaryFile(), array("q", [0]))  # noqa: SIM115
            for name, k in self._kinds.items()
            if k in _ON_DISK
        }
        self._scalars: dict[str, array[Any]] = {
            name: array("d" if k in (_FLOAT, _OPTIONAL_FLOAT) else "q")
            for name, k in self._kinds.items()
            if k not in _ON_DISK
        }
        self._n = 0
        # an abandoned writer (the data was refused half way) closes its files when collected
        for fh, _ in self._ids.values():
            weakref.finalize(self, fh.close)

    def __len__(self) -> int:
        return self._n

    def append(self, example: E) -> None:
        for name, (fh, offsets) in self._ids.items():
            values = _encode(getattr(example, name), self._kinds[name], name)
            fh.write(values.tobytes())
            offsets.append(offsets[-1] + values.size)
        for name, column in self._scalars.items():
            value = getattr(example, name)
            column.append(float("nan") if value is None else value)
        self._n += 1

    def finish(self) -> ExampleStore[E]:
        ids = {}
        for name, (fh, offsets) in self._ids.items():
            fh.flush()
            # mmap cannot map an empty file; an empty column needs no file
            dtype = _ON_DISK[self._kinds[name]]
            values = (
                np.memmap(fh, dtype=dtype, mode="r", shape=(offsets[-1],))
                if offsets[-1]
                else np.empty(0, dtype=dtype)
            )
            fh.close()  # the map holds its own reference to the (already unlinked) file
            ids[name] = (values, np.frombuffer(offsets, dtype=np.int64))
        scalars = {
            name: np.frombuffer(column, dtype=column.typecode) for name, column in self._scalars.items()
        }
        return ExampleStore(self._cls, self._kinds, self._n, ids, scalars)


class ExampleStore(Sequence[E]):
    """Read-only examples of one dataclass, built by ``ExampleWriter``; each access builds a fresh example."""

    def __init__(
        self,
        cls: type[E],
        kinds: dict[str, str],
        n: int,
        ids: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]],
        scalars: dict[str, np.ndarray[Any, Any]],
    ) -> None:
        self._cls, self._kinds, self._n = cls, kinds, n
        self._ids, self._scalars = ids, scalars

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> E: ...
    @overload
    def __getitem__(self, index: slice) -> list[E]: ...
    def __getitem__(self, index: int | slice) -> E | list[E]:
        if isinstance(index, slice):
            return [self._example(i) for i in range(*index.indices(self._n))]
        if not -self._n <= index < self._n:
            raise IndexError(f"example {index} of {self._n}")
        return self._example(index % self._n)

    def _example(self, i: int) -> E:
        values: dict[str, Any] = {}
        for name, kind in self._kinds.items():
            if kind in _ON_DISK:
                flat, offsets = self._ids[name]
                values[name] = _decode(flat[offsets[i] : offsets[i + 1]], kind)
            else:
                values[name] = _scalar(self._scalars[name][i], kind)
        return self._cls(**values)

    @property
    def n_tokens(self) -> int:
        """Ids stored over every ``list[int]`` field."""
        return sum(int(self._ids[name][1][-1]) for name, kind in self._kinds.items() if kind == _IDS)


def _encode(value: Any, kind: str, name: str) -> np.ndarray[Any, Any]:
    """A field's value as the flat array its file holds."""
    if kind == _TEXT:
        return np.frombuffer(value.encode("utf-8"), dtype=np.uint8)
    if kind == _JSON:
        return np.frombuffer(json.dumps(value, ensure_ascii=False).encode("utf-8"), dtype=np.uint8)
    ids = np.asarray(value, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > _MAX_TOKEN_ID):
        raise ValueError(f"{name}: values must lie in [0, {_MAX_TOKEN_ID}]")
    return ids.astype(_ON_DISK[kind])


def _decode(column: np.ndarray[Any, Any], kind: str) -> Any:
    if kind == _TEXT:
        return column.tobytes().decode("utf-8")
    if kind == _JSON:
        return json.loads(column.tobytes().decode("utf-8"))
    return column.astype(bool).tolist() if kind == _MASK else column.tolist()


def _scalar(value: Any, kind: str) -> Any:
    if kind == _BOOL:
        return bool(value)
    if kind == _INT:
        return int(value)
    if kind == _OPTIONAL_FLOAT and np.isnan(value):
        return None
    return float(value)
