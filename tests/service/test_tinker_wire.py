"""service/tinker/wire.py against the official SDK's own protobuf encoder and decoders (tinker==0.38.0)."""

from __future__ import annotations

import math

import pytest

from service.tinker import wire

types = pytest.importorskip("tinker.types")  # the dev extra pins the SDK
request_conv = pytest.importorskip("tinker.proto.request_conv")
response_conv = pytest.importorskip("tinker.proto.response_conv")


def test_reads_the_sdks_forward_backward_request() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 300]),
        loss_fn_inputs={"target_tokens": [2, 300, 4], "weights": [1.0, 0.5, 0.0]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum, datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.9}
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    proto = request_conv.forward_backward_request_to_proto(request)
    proto.forward_only = True
    read = wire.read_forward_backward(proto.SerializeToString())
    assert (read.model_id, read.seq_id, read.loss_fn, read.forward_only) == ("s:train:0", 3, "ppo", True)
    assert read.loss_fn_config == {"clip_low_threshold": 0.9}
    assert read.data[1].tokens == [1, 2, 300]
    assert read.data[1].inputs == {"target_tokens": [2, 300, 4], "weights": [1.0, 0.5, 0.0]}


def test_refuses_what_it_does_not_read() -> None:
    with pytest.raises(wire.WireError):
        wire.read_forward_backward(b"\x0a\xff")  # a length past the end
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"x", format="png")]),
        loss_fn_inputs={"target_tokens": [1]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[image], loss_fn="cross_entropy"),
        model_id="m",
        seq_id=1,
    )
    with pytest.raises(wire.WireError, match="encoded_text"):
        wire.read_forward_backward(
            request_conv.forward_backward_request_to_proto(request).SerializeToString()
        )


def test_the_sdk_reads_our_results() -> None:
    body = wire.write_forward_backward_output(
        [{"logprobs": [-1.0, -2.5]}, {"logprobs": [-3.0]}], {"loss:sum": 6.5}
    )
    output = response_conv.deserialize_forward_backward_output(body)
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[-1.0, -2.5], [-3.0]]
    assert output.metrics == {"loss:sum": 6.5}
    sample = wire.write_sample_response(
        [wire.Sequence([7, 8], [-0.25, -0.5], "stop"), wire.Sequence([9], [-1.0], "length")], [math.nan, -2.0]
    )
    response = response_conv.deserialize_sample_response(sample)
    assert [(list(s.tokens), s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([7, 8], [-0.25, -0.5], "stop"),
        ([9], [-1.0], "length"),
    ]
    assert response.prompt_logprobs == [None, -2.0]
