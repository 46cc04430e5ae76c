"""Reference log-probs kept between DPO runs (trainers/families/reference_cache.py): a later run on the same
pairs
and reference reads them instead of scoring the pairs again, and anything the log-probs depend on
changes the entry's key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerBase

import trainers.methods.dpo
from tests.trainers.helpers import Recorder
from tests.trainers.methods.test_dpo import separable_rows
from trainers.data.packing import PairPacking
from trainers.data.preference import PreferenceExample, tokenize_preference_rows
from trainers.families.entry import load_model_to_train
from trainers.families.reference import Reference
from trainers.families.reference_cache import MAX_ENTRIES, ReferenceCache, reference_key
from trainers.methods.dpo import DPOConfig, Scoring, scoring_message, train_dpo

RUN = {"use_lora": True, "precompute_ref_log_probs": True, "max_steps": 3, "batch_size": 4}


@pytest.fixture
def make_config(tiny_model_path: Path, tmp_path: Path) -> Callable[..., DPOConfig]:
    def make(**overrides: Any) -> DPOConfig:
        return DPOConfig(
            **({"model_path": str(tiny_model_path), "output_dir": str(tmp_path / "out")} | overrides)
        )

    return make


def test_a_later_run_on_the_same_pairs_reads_the_kept_log_probs_and_trains_the_same(
    make_config: Callable[..., DPOConfig],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = separable_rows(12)
    kept = tmp_path / "reference.npz"
    first = Recorder()
    train_dpo(
        make_config(**RUN, beta=0.5, output_dir=str(tmp_path / "a"), reference_cache_file=str(kept)),
        rows,
        None,
        first,
    )
    assert first.messages == [scoring_message(12)]  # computed, not reused
    with np.load(kept) as npz:
        assert len(npz.files) == 1 and npz[npz.files[0]].shape == (12, 2)

    # a sweep's next run: another β and learning rate, the same pairs and reference
    sweep = {**RUN, "beta": 0.2, "learning_rate": 1e-2}
    plain = Recorder()
    train_dpo(make_config(**sweep, output_dir=str(tmp_path / "b")), rows, None, plain)

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("the reference scored the pairs again")

    monkeypatch.setattr(trainers.methods.dpo, "precompute_reference_log_probs", refuse)
    reused = Recorder()
    train_dpo(
        make_config(**sweep, output_dir=str(tmp_path / "c"), reference_cache_file=str(kept)),
        rows,
        None,
        reused,
    )
    assert reused.messages == ["Reference log-probs of 12 pairs reused from an earlier run on the same pairs"]
    assert reused.losses == pytest.approx(plain.losses, abs=1e-6)
    assert len(set(plain.losses)) == 3  # the losses move, so the reference's values matter to them
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert [r[key] for r in reused.steps] == pytest.approx([r[key] for r in plain.steps], abs=1e-6)


def _examples(tokenizer: PreTrainedTokenizerBase, n: int = 4) -> list[PreferenceExample]:
    return list(tokenize_preference_rows(separable_rows(n), tokenizer, max_length=64))


def test_the_key_changes_with_what_the_log_probs_depend_on_and_nothing_else(
    make_config: Callable[..., DPOConfig],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    model = load_model_to_train(make_config(use_lora=True), torch.device("cpu"))
    reference = Reference(model, disable_adapter=True)
    examples = _examples(tokenizer)

    def key(
        ref: Reference = reference, pairs: list[PreferenceExample] = examples, settings: str = "s"
    ) -> str:
        return reference_key(ref.tensors(), ref.config(), pairs, settings=settings)

    base = key()
    assert key() == base
    assert key(settings="other dtype") != base
    assert key(pairs=examples[:3]) != base
    first = examples[0]
    one_token = PreferenceExample(first.prompt_ids, [*first.chosen_ids[:-1], 7], first.rejected_ids)
    assert key(pairs=[one_token, *examples[1:]]) != base
    other_rejected = PreferenceExample(first.prompt_ids, first.chosen_ids, [*first.rejected_ids, 7])
    assert key(pairs=[other_rejected, *examples[1:]]) != base
    swapped = PreferenceExample(first.prompt_ids, first.rejected_ids, first.chosen_ids)
    assert key(pairs=[swapped, *examples[1:]]) != base

    names = [name for name, _ in reference.tensors()]
    assert names and not any("lora_" in name for name in names)
    with torch.no_grad():
        lora = next(p for name, p in model.named_parameters() if "lora_B" in name)
        lora.add_(1.0)  # training moves the adapter, not the reference
        assert key() == base
        base_weight = next(p for name, p in model.named_parameters() if "lora_" not in name)
        base_weight.view(-1)[0] += 1.0
        assert key() != base
        base_weight.view(-1)[0] -= 1.0
    assert key() == base

    config = model.get_base_model().config
    config._name_or_path = "/elsewhere/the-same-model"  # the folder it was loaded from is not its identity
    assert key() == base
    config.rope_theta = float(getattr(config, "rope_theta", 10000.0)) * 2
    assert key() != base


def test_the_scoring_settings_in_the_key_are_the_precision_the_device_and_the_packing() -> None:
    base = Scoring(4, 0, torch.device("cpu"), torch.bfloat16, PairPacking.SHARED_PROMPTS)
    assert replace(base, batch_size=8).key_settings() == base.key_settings()  # rounding only
    for other in (
        replace(base, compute_dtype=None),
        replace(base, compute_dtype=torch.float16),
        replace(base, device=torch.device("meta")),
        replace(base, pack=PairPacking.PADDED),
    ):
        assert other.key_settings() != base.key_settings(), other


def test_an_unreadable_or_mismatched_file_is_a_miss_and_the_newest_entries_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "kept.npz"
    cache = ReferenceCache(path)
    assert cache.load("a", 2) is None  # no file yet
    path.write_bytes(b"half a download")
    assert cache.load("a", 2) is None
    cache.save("a", np.array([[-1.5, -2.5], [-3.0, -4.0]]))
    assert cache.load("a", 2).tolist() == [[-1.5, -2.5], [-3.0, -4.0]]  # type: ignore[union-attr]
    assert cache.load("a", 3) is None  # another number of pairs under the same name: not these pairs
    for i in range(MAX_ENTRIES):
        cache.save(f"k{i}", np.full((1, 2), float(i)))
    assert cache.load("a", 2) is None  # the oldest went
    assert [cache.load(f"k{i}", 1).tolist() for i in range(MAX_ENTRIES)] == [  # type: ignore[union-attr]
        [[float(i), float(i)]] for i in range(MAX_ENTRIES)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.npz"]  # no temporary file left
