"""What a `forward_backward` call must satisfy before it is queued, so that a bad call is a 400 naming
its field at once and never reaches (or poisons) the host: a served loss, its `loss_fn_config` keys and
ranges (trainers/formats.py PRIMITIVE_LOSS_CONFIG), one finite value per input token for each input the
loss reads, and, for a loss that reads what the sampler recorded (`stable_reinforce`), provenance that
names this session's recorded sequences token for token (service/tinker/service.py keeps the records).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from service.errors import BadRequest
from service.tinker.wire import Datum, ForwardBackward, Span
from trainers.formats import (
    PRIMITIVE_LOSS_CONFIG,
    PRIMITIVE_LOSS_INPUTS,
    PRIMITIVE_LOSS_PROVENANCE,
    RECORDED_LOGPROBS,
    RECORDED_MASK,
)

# a clip range's ends and a penalty's weight: anything past this is a mistake, not a setting
MAX_LOSS_PARAMETER = 1e6


def check_loss(call: ForwardBackward) -> None:
    if call.loss_fn not in PRIMITIVE_LOSS_INPUTS:
        raise BadRequest(
            f"loss_fn: '{call.loss_fn}' is not served (built-in losses: {', '.join(PRIMITIVE_LOSS_INPUTS)}; "
            "custom losses are not supported)",
            param="loss_fn",
            code="unsupported_loss",
        )
    known = PRIMITIVE_LOSS_CONFIG[call.loss_fn]
    for key, value in call.loss_fn_config.items():
        param = f"loss_fn_config.{key}"
        if key not in known:
            served = ", ".join(known) or "none"
            raise BadRequest(f"{param}: {call.loss_fn} takes no '{key}' (it takes: {served})", param=param)
        if not math.isfinite(value) or not 0 <= value <= MAX_LOSS_PARAMETER:
            raise BadRequest(f"{param}: a finite number from 0 to {MAX_LOSS_PARAMETER:g}", param=param)
    low = call.loss_fn_config.get("clip_low_threshold", known.get("clip_low_threshold", 0.0))
    high = call.loss_fn_config.get("clip_high_threshold", known.get("clip_high_threshold", 0.0))
    if low > high:
        raise BadRequest(
            "loss_fn_config.clip_low_threshold: at most clip_high_threshold", param="loss_fn_config"
        )


def check_data(call: ForwardBackward) -> None:
    if not call.data:
        raise BadRequest("data: at least one datum", param="data")
    for index, datum in enumerate(call.data):
        for key in ("target_tokens", *PRIMITIVE_LOSS_INPUTS[call.loss_fn]):
            param = f"data[{index}].loss_fn_inputs.{key}"
            values = datum.inputs.get(key, ())
            if len(values) != len(datum.tokens) or not datum.tokens:
                raise BadRequest(f"{param}: {call.loss_fn} needs one value per input token", param=param)
            if not all(math.isfinite(v) for v in values):
                raise BadRequest(f"{param}: NaN and infinite values are refused", param=param)
        if call.loss_fn == "gspo" and not any(datum.inputs["sequence_ratio_mask"]):
            param = f"data[{index}].loss_fn_inputs.sequence_ratio_mask"
            raise BadRequest(f"{param}: mark at least one token for the sequence ratio", param=param)
        if call.loss_fn in PRIMITIVE_LOSS_PROVENANCE and datum.spans is None:
            param = f"data[{index}].loss_fn_input_spans"
            raise BadRequest(
                f"{param}: {call.loss_fn} needs provenance on every datum (Datum.with_provenance, from a "
                "sampling client made with record_stability_info=True)",
                param=param,
            )


def sequence_ids(data: Sequence[Datum]) -> set[str]:
    return {span.sequence_id for datum in data for span in datum.spans or ()}


def attach_recorded(data: Sequence[Datum], records: dict[str, dict[str, Any]]) -> None:
    """Give each datum, per target, the log-probability the sampler recorded and whether it was sampled
    (RECORDED_LOGPROBS, RECORDED_MASK), after checking that its provenance tiles its targets and that
    each named run is what was recorded: the same tokens, at positions the record has. `records`: the
    recorded sequences of this session by id (`prompt`, `tokens`, `logprobs`)."""
    for index, datum in enumerate(data):
        param = f"data[{index}].loss_fn_input_spans"
        targets = [int(t) for t in datum.inputs["target_tokens"]]
        spans: list[Span] = datum.spans or []
        if sum(span.length for span in spans) != len(targets):
            raise BadRequest(f"{param}: the runs must cover the {len(targets)} targets exactly", param=param)
        logprobs: list[float] = []
        mask: list[float] = []
        for span in spans:
            record = records.get(span.sequence_id)
            if record is None:
                raise BadRequest(
                    f"{param}: no recorded sequence '{span.sequence_id}' in this session (sample with "
                    "record_stability_info=True in the same session; records last a day)",
                    param=param,
                    code="unknown_sequence",
                )
            source = record["tokens"] if span.sampled else record["prompt"]
            start = len(logprobs)
            if (
                span.offset + span.length > len(source)
                or source[span.offset : span.offset + span.length] != targets[start : start + span.length]
            ):
                what = "sampled tokens" if span.sampled else "prompt"
                raise BadRequest(
                    f"{param}: targets {start}..{start + span.length - 1} are not positions "
                    f"{span.offset}..{span.offset + span.length - 1} of the {what} of '{span.sequence_id}'",
                    param=param,
                )
            if span.sampled:
                logprobs += record["logprobs"][span.offset : span.offset + span.length]
            else:
                logprobs += [0.0] * span.length
            mask += [1.0 if span.sampled else 0.0] * span.length
        advantages = datum.inputs["advantages"]
        if any(a != 0 and m == 0 for a, m in zip(advantages, mask, strict=True)):
            raise BadRequest(
                f"data[{index}].loss_fn_inputs.advantages: nonzero only on sampled tokens",
                param=f"data[{index}].loss_fn_inputs.advantages",
            )
        datum.inputs[RECORDED_LOGPROBS] = logprobs
        datum.inputs[RECORDED_MASK] = mask
