"""The pure parts of job progress and results: `estimated_finish` arithmetic and the results CSV."""

from __future__ import annotations

import doctest

import pytest

import service.errors
import service.jobs.results
import worker.reporter
from service.jobs.results import metrics_csv
from worker.reporter import estimate_finish


@pytest.mark.parametrize("module", [service.jobs.results, worker.reporter, service.errors])
def test_doctests_pass(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0


def test_estimate_uses_the_steps_since_this_process_started() -> None:
    # resumed at step 100 at t=1000; 10 steps took 20 s -> 2 s/step, 90 steps left
    assert estimate_finish(now=1020.0, origin=(100, 1000.0), step=110, total=200) == 1020 + 180
    # a slower stretch moves the estimate later
    assert estimate_finish(now=1040.0, origin=(100, 1000.0), step=110, total=200) == 1040 + 360
    assert estimate_finish(now=1020.0, origin=(100, 1000.0), step=200, total=200) == 1020


def test_results_csv_columns() -> None:
    text = metrics_csv([(1, 0.25, {"loss": 1.0, "rewards/margins": 0.5, "logged_at": 1.0e9})])
    header, row = text.splitlines()
    assert header == (
        "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy,epoch,rewards/margins"
    )
    assert row == "1,1.0,,,,0.25,0.5"
