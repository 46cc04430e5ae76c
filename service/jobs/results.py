"""A job's per-step metrics as the CSV OpenAI gives as a job's result file (`purpose: fine-tune-results`).

OpenAI's columns come first, filled from our metric rows (the same rows GET .../metrics returns):

    step, train_loss, train_accuracy, valid_loss, valid_mean_token_accuracy

then `epoch` and every other metric the method logged (DPO's rewards/margins, GRPO's reward/<grader>,
learning_rate, grad_norm, trained_tokens, ...) as extra columns in name order. A cell is empty where
a step has no value (a validation loss exists only at evaluation steps).

>>> print(metrics_csv([(1, 0.5, {"loss": 2.0, "mean_token_accuracy": 0.25, "kl": 0.1}),
...                    (2, 1.0, {"loss": 1.5, "valid_loss": 1.75})]), end="")
step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy,epoch,kl
1,2.0,0.25,,,0.5,0.1
2,1.5,,1.75,,1.0,
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

# OpenAI's column -> the key of our metric rows it is read from
OPENAI_COLUMNS: dict[str, str] = {
    "train_loss": "loss",
    "train_accuracy": "mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
}
# row keys that are bookkeeping, not metrics (the wall-clock time a step was logged)
_NOT_METRICS = frozenset({"logged_at"})

MetricRow = tuple[int, float, dict[str, Any]]  # (step, epoch, values)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float
    return str(value)


def metrics_csv(rows: Sequence[MetricRow]) -> str:
    mapped = set(OPENAI_COLUMNS.values())
    extra = sorted({k for _, _, values in rows for k in values} - mapped - _NOT_METRICS)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *OPENAI_COLUMNS, "epoch", *extra])
    for step, epoch, values in rows:
        writer.writerow(
            [
                step,
                *(_cell(values.get(key)) for key in OPENAI_COLUMNS.values()),
                _cell(epoch),
                *(_cell(values.get(key)) for key in extra),
            ]
        )
    return out.getvalue()
