"""Reads what a job's experiment trackers wrote: a W&B offline run file and TensorBoard event files.

A W&B offline run file (``run-<id>.wandb``) is W&B's record log (the LevelDB log layout): a 7-byte
header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC32C,
little-endian length, type: 1 full, 2 first, 3 middle, 4 last) holding a protobuf ``Record``. wandb 0.31
ships no reader for it, so this is ours; the layout is pinned with the `wandb` version in pyproject.toml.
TensorBoard event files are TFRecords of ``Event`` protobufs (tensorboardX's generated classes).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK, _HEADER = 32 * 1024, 7


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunks = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunks += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


@dataclass
class OfflineRun:
    run_id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> the values logged at it
    exit_code: int | None = None


def read_offline_run(path: Path) -> OfflineRun:
    run = OfflineRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.project, run.name, run.tags = r.run_id, r.project, r.display_name, list(r.tags)
            run.config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "config":
            run.config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = int(values["_step"])
            run.history.setdefault(step, {}).update(values)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def tensorboard_events(folder: Path) -> Iterator[Any]:
    """The events of a TensorBoard log folder (TFRecord: u64 length, u32 CRC, data, u32 CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            yield event


def tensorboard_scalars(folder: Path) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of every scalar in a TensorBoard log folder."""
    return {
        (v.tag, e.step): v.simple_value
        for e in tensorboard_events(folder)
        for v in e.summary.value
        if v.WhichOneof("value") == "simple_value"
    }
