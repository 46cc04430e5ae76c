"""An RL job's grader measures each row's templates before it builds them (worker/graders.py): a row
whose `{{item.x}}` copies would expand past `grader_max_text_chars` fails the job as a data error
naming the field, instead of building hundreds of MB in the trainer (issue 46)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import get_settings
from service.jobs.spec import load_method
from service.storage import LocalBlobStore
from trainers.rewards.graders import GraderError
from worker.graders import reward_set

REPEATED = {
    "type": "string_check",
    "name": "copies",
    "operation": "like",
    "input": "{{sample.output_text}}",
    "reference": "{{item.r}}" * 2000,  # 20,000 characters as written: at the cap
}


def _grader(tmp_path: Path, grader: dict[str, object]):  # type: ignore[no-untyped-def]
    method = load_method({"type": "grpo", "grpo": {"grader": grader, "hyperparameters": {}}})
    rewards = reward_set(method, settings=get_settings(), blobs=LocalBlobStore(tmp_path), tenant_id="t")
    assert rewards is not None
    return rewards.funcs[0]


def test_a_row_that_would_expand_past_the_cap_fails_naming_the_field(tmp_path: Path) -> None:
    grader = _grader(tmp_path, REPEATED)
    assert grader(["q"], ["x"], r=["r"]) == [0.0]  # 2,000 characters expanded: graded
    with pytest.raises(GraderError) as failure:
        grader(["q", "q"], ["x", "x"], r=["r", "r" * 10_000])  # 20,000,000 characters: not built
    assert failure.value.param == "method.grpo.grader.reference"
    assert "expands to 20000000 characters for a row of the training file" in failure.value.message


def test_a_multi_names_its_sub_grader(tmp_path: Path) -> None:
    multi = {"type": "multi", "graders": {"copies": REPEATED}, "calculate_output": "copies"}
    with pytest.raises(GraderError) as failure:
        _grader(tmp_path, multi)(["q"], ["x"], r=["r" * 10_000])
    assert failure.value.param == "method.grpo.grader.graders.copies.reference"


def test_a_path_into_a_list_is_measured_by_what_it_reaches(tmp_path: Path) -> None:
    """``{{item.r[1]}}`` copies the list's second entry, not the list: measured as that entry."""
    grader = _grader(tmp_path, {**REPEATED, "reference": "{{item.r[1]}}" * 1000})
    assert grader(["q"], ["x"], r=[["r" * 10_000, "ab"]]) == [0.0]  # 2,000 characters expanded: graded
    with pytest.raises(GraderError):
        grader(["q"], ["x"], r=[["ab", "r" * 10_000]])
