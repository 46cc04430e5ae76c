"""The rows of a JSONL file on disk, parsed one at a time when read: a ``Sequence`` of mappings that the
methods' tokenizers walk once, without the whole file ever being parsed into memory.

Opening the file scans it once for where each non-blank line starts (8 bytes per row stay in memory);
``rows[i]`` seeks there and parses that line. Blank lines are not rows, so "line N" in an error counts
rows, as the upload validation does.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
    ...     _ = f.write('{"text": "a"}\\n\\n{"text": "b"}\\n'); f.flush()
    ...     rows = JsonlRows(f.name, param="training_file")
    ...     len(rows), rows[1], rows[-1] == rows[1]
    (2, {'text': 'b'}, True)
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from trainers.core.errors import DataError


class JsonlRows(Sequence[Mapping[str, Any]]):
    def __init__(self, path: str | Path, *, param: str) -> None:
        self._path, self._param = Path(path), param
        starts: list[int] = []
        with self._path.open("rb") as fh:
            position = 0
            for raw in fh:
                if raw.strip():
                    starts.append(position)
                position += len(raw)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._fh = self._path.open("rb")
        weakref.finalize(self, self._fh.close)

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> Mapping[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[Mapping[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> Mapping[str, Any] | list[Mapping[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        self._fh.seek(int(self._starts[index]))
        raw = self._fh.readline()
        try:
            row: Mapping[str, Any] = json.loads(raw)
        except ValueError as exc:  # the upload validated the file: only a file changed since gets here
            raise DataError(f"line {index + 1}: not valid JSON ({exc})", param=self._param) from exc
        return row
