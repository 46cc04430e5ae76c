"""The protobuf bodies of the Tinker protocol, read and written by hand (torch-free, no generated code).

The official SDK sends `forward_backward` as a protobuf `ForwardBackwardRequest` and expects
`ForwardBackwardOutput` and `SampleResponse` results as protobuf (`Accept: application/x-protobuf`);
every other call is JSON. Only the fields tunehouse serves are read or written; the field numbers are
the public wire format's (package `tinker_public`, proto3). A protobuf message is a sequence of
`(field number << 3 | wire type)` keys, each followed by a varint (type 0), 8 bytes (type 1), a
length-prefixed payload (type 2) or 4 bytes (type 5); unknown fields are skipped.

Token ids travel as packed little-endian int32 bytes, tensors as `Tensor{dense bytes, dtype, shape}`
(dtype 1 = float32, 2 = int64, 3 = int32).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from sys import byteorder

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_ARRAY_CODE = {DTYPE_FLOAT32: "f", DTYPE_INT64: "q", DTYPE_INT32: "i"}
STOP_REASON = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A protobuf body that cannot be read: the client's fault (400)."""


# --- reading ------------------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of one message: an int for varint/fixed fields, bytes for
    length-delimited ones (sub-messages, strings, packed arrays)."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == 0:
            value, pos = _varint(buf, pos)
        elif wire_type == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire_type == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise WireError("truncated field")
            value, pos = buf[pos : pos + length], pos + length
        elif wire_type == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        yield number, value


def _bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise WireError("expected a length-delimited field")
    return value


def _int(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise WireError("expected a varint field")
    return value


def _numbers(raw: bytes, code: str) -> list[float] | list[int]:
    values = array(code)
    if len(raw) % values.itemsize:
        raise WireError("tensor bytes are not a whole number of elements")
    values.frombytes(raw)
    if byteorder != "little":
        values.byteswap()
    return values.tolist()


def _tensor(buf: bytes) -> list[float] | list[int]:
    dense, dtype = b"", DTYPE_FLOAT32
    for number, value in fields(buf):
        if number == 1:
            dense = _bytes(value)
        elif number == 2:
            raise WireError("sparse tensors are not supported by this server")
        elif number == 3:
            dtype = _int(value)
    if dtype not in _ARRAY_CODE:
        raise WireError(f"unsupported tensor dtype {dtype}")
    return _numbers(dense, _ARRAY_CODE[dtype])


def _map_entry(buf: bytes) -> tuple[str, bytes | int]:
    key = ""
    value: bytes | int = b""
    for number, entry_value in fields(buf):
        if number == 1:
            key = _bytes(entry_value).decode()
        elif number == 2:
            value = entry_value
    return key, value


@dataclass(frozen=True)
class Span:
    """One run of a datum's provenance (`Datum.with_provenance`): `length` positions that are positions
    `offset...` of sequence `sequence_id`'s prompt (`sampled` False) or of its sampled tokens."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]
    # the provenance of the loss rows (the targets), None without provenance
    spans: list[Span] | None = None


@dataclass
class ForwardBackward:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)
    loss_fn_config: dict[str, float] = field(default_factory=dict)


def _span(buf: bytes) -> Span:
    for number, value in fields(buf):
        if number in (1, 2):  # prompt_tokens | sampled_tokens, each {sequence_id, offset, length}
            sequence_id, offset, length = "", 0, 0
            for inner, scalar in fields(_bytes(value)):
                if inner == 1:
                    sequence_id = _bytes(scalar).decode()
                elif inner == 2:
                    offset = _int(scalar)
                elif inner == 3:
                    length = _int(scalar)
            return Span(number == 2, sequence_id, offset, length)
    raise WireError("a provenance span names neither prompt nor sampled tokens")


def _datum(buf: bytes) -> Datum:
    tokens: list[int] = []
    inputs: dict[str, list[float] | list[int]] = {}
    spans: list[Span] | None = None
    for number, value in fields(buf):
        if number == 1:  # a Chunk; only encoded_text (field 1) is served
            for chunk_number, chunk in fields(_bytes(value)):
                if chunk_number != 1:
                    raise WireError("only encoded_text model inputs are supported (no images or audio)")
                for text_number, raw in fields(_bytes(chunk)):
                    if text_number == 1:
                        tokens.extend(int(t) for t in _numbers(_bytes(raw), "i"))
        elif number == 2:
            key, tensor = _map_entry(_bytes(value))
            inputs[key] = _tensor(_bytes(tensor))
        elif number == 4:  # loss_fn_input_spans (3, the input's, says nothing the targets' do not)
            spans = [*(spans or []), _span(_bytes(value))]
    return Datum(tokens=tokens, inputs=inputs, spans=spans)


def read_forward_backward(body: bytes) -> ForwardBackward:
    out = ForwardBackward()
    for number, value in fields(body):
        if number == 1:
            out.model_id = _bytes(value).decode()
        elif number == 2:
            out.seq_id = _int(value)
        elif number == 3:
            out.data.append(_datum(_bytes(value)))
        elif number == 4:
            out.loss_fn = _bytes(value).decode()
        elif number == 5:  # the legacy float map; v2 (7) carries the same numbers and strings
            key, raw = _map_entry(_bytes(value))
            out.loss_fn_config.setdefault(key, struct.unpack("<d", _int(raw).to_bytes(8, "little"))[0])
        elif number == 6:
            out.forward_only = bool(_int(value))
        elif number == 7:
            key, raw = _map_entry(_bytes(value))
            for value_number, scalar in fields(_bytes(raw)):
                if value_number == 1:
                    out.loss_fn_config[key] = struct.unpack("<d", _int(scalar).to_bytes(8, "little"))[0]
                else:
                    raise WireError(f"loss_fn_config.{key}: only numbers are supported")
    return out


# --- writing ------------------------------------------------------------------------------------------


def _write_varint(out: bytearray, value: int) -> None:
    value &= (1 << 64) - 1
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _key(out: bytearray, number: int, wire_type: int) -> None:
    _write_varint(out, number << 3 | wire_type)


def _len_field(out: bytearray, number: int, payload: bytes) -> None:
    _key(out, number, 2)
    _write_varint(out, len(payload))
    out += payload


def _varint_field(out: bytearray, number: int, value: int) -> None:
    if value:
        _key(out, number, 0)
        _write_varint(out, value)


def _packed(values: list[float] | list[int], code: str) -> bytes:
    packed = array(code, values)
    if byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def write_forward_backward_output(
    outputs: list[dict[str, list[float]]], metrics: dict[str, float], output_type: str = "ArrayRecord"
) -> bytes:
    """`ForwardBackwardOutput` with one ArrayRecord: each field a BatchedTensor of float32 whose
    `offsets` (int64 bytes, n + 1 of them) cut the concatenated values into one flat array per datum."""
    record = bytearray()
    _len_field(record, 1, output_type.encode())
    names = list(outputs[0]) if outputs else []
    for name in names:
        data, offsets = bytearray(), [0]
        for datum in outputs:
            data += _packed(datum[name], "f")
            offsets.append(len(data))
        batched = bytearray()
        _len_field(batched, 1, bytes(data))
        _len_field(batched, 2, _packed(offsets, "q"))
        _varint_field(batched, 3, DTYPE_FLOAT32)
        entry = bytearray()
        _len_field(entry, 1, name.encode())
        _len_field(entry, 2, bytes(batched))
        _len_field(record, 2, bytes(entry))
    _varint_field(record, 3, len(outputs))
    out = bytearray()
    _len_field(out, 1, output_type.encode())
    _len_field(out, 2, bytes(record))
    for key, value in metrics.items():
        entry = bytearray()
        _len_field(entry, 1, key.encode())
        _key(entry, 2, 1)
        entry += struct.pack("<d", value)
        _len_field(out, 3, bytes(entry))
    return bytes(out)


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def _topk(rows: list[list[tuple[int, float]]], k: int) -> bytes:
    """`TopkLogprobs{token_ids, logprobs, k, length}`: `length` rows of `k` (id, log-prob), row-major."""
    msg = bytearray()
    _len_field(msg, 1, _packed([t for row in rows for t, _ in row], "i"))
    _len_field(msg, 2, _packed([lp for row in rows for _, lp in row], "f"))
    _varint_field(msg, 3, k)
    _varint_field(msg, 4, len(rows))
    return bytes(msg)


def write_sample_response(
    sequences: list[Sequence],
    prompt_logprobs: list[float] | None = None,
    topk_prompt: list[list[tuple[int, float]]] | None = None,
) -> bytes:
    out = bytearray()
    for seq in sequences:
        msg = bytearray()
        _varint_field(msg, 1, STOP_REASON[seq.stop_reason])
        _len_field(msg, 2, _packed(seq.tokens, "i"))
        _len_field(msg, 3, _packed(seq.logprobs, "f"))
        _len_field(out, 1, bytes(msg))
    if prompt_logprobs is not None:
        _len_field(out, 2, _packed(prompt_logprobs, "f"))
    if topk_prompt:
        _len_field(out, 3, _topk(topk_prompt, len(topk_prompt[0])))
    return bytes(out)
