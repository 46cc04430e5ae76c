"""tinker-cookbook 0.6.1's own training loops, run unchanged as a researcher runs them, each in its own
process so that its exit status is the test's: `python -m tests.tinker.cookbook_runs RECIPE LOG_PATH`.

The configuration is the only thing of ours: the tiny model under a hub name (MODEL, served through
TUNEHOUSE_MODEL_REGISTRY, its tokenizer in an offline Hugging Face cache the test builds), the generic
`role_colon` renderer, and few, small steps. TINKER_BASE_URL and TINKER_API_KEY come from the
environment, as for any cookbook user; the SDK's telemetry is left on.

- sft [MAX_STEPS [STATE]]: supervised.train.main on a conversation file (CONVERSATIONS), from a saved
  state when STATE is given (`load_checkpoint_path`: the cookbook's way to go on from a checkpoint)
- rl:              rl.train.main with loss_fn="stable_reinforce" on a small env (VowelsEnv)
- dpo:             preference.train_dpo.main on a comparison file (COMPARISONS)
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
from tinker_cookbook import renderers
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import get_tokenizer

MODEL = "Qwen/Qwen3-0.6B"  # a hub name; the server has the tiny model under it (no download anywhere)
RENDERER = "role_colon"
HERE = Path(__file__).parent
CONVERSATIONS = HERE / "data" / "conversations.jsonl"
COMPARISONS = HERE / "data" / "comparisons.jsonl"


def _common(batch_size: int) -> ChatDatasetBuilderCommonConfig:
    return ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=MODEL,
        renderer_name=RENDERER,
        max_length=256,
        batch_size=batch_size,
        train_on_what=renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )


def sft_config(log_path: str, max_steps: int | None = None, load: str | None = None) -> sl_train.Config:
    return sl_train.Config(
        log_path=log_path,
        model_name=MODEL,
        recipe_name="tunehouse_test_sft",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=_common(4), file_path=str(CONVERSATIONS)),
        learning_rate=5e-3,
        lr_schedule="constant",
        num_epochs=3,
        lora_rank=8,
        save_every=2,
        eval_every=0,
        max_steps=max_steps,
        load_checkpoint_path=load,
    )


class VowelsEnv(ProblemEnv):
    """A question whose reward is the share of vowels in the answer: graded, so a group's rewards differ
    and the tiny model has something to climb."""

    def get_question(self) -> str:
        return "Say something."

    def check_answer(self, sample_str: str) -> bool:
        letters = [c for c in sample_str.lower() if c.isalpha()]
        return bool(letters) and sum(c in "aeiou" for c in letters) / len(letters) > 0.4

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "aeiou"


class VowelsDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batches: int, group_size: int) -> None:
        self.renderer, self.batches, self.group_size = renderer, batches, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        env = partial(VowelsEnv, renderer=self.renderer, format_coef=0.0)
        return [ProblemGroupBuilder(env_thunk=env, num_envs=self.group_size) for _ in range(2)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class VowelsBuilder(RLDatasetBuilder):
    batches: int = 4
    group_size: int = 4

    async def __call__(self) -> tuple[VowelsDataset, None]:
        renderer = renderers.get_renderer(RENDERER, tokenizer=get_tokenizer(MODEL))
        return VowelsDataset(renderer, self.batches, self.group_size), None


def rl_config(log_path: str) -> rl_train.Config:
    return rl_train.Config(
        learning_rate=2e-2,
        dataset_builder=VowelsBuilder(),
        model_name=MODEL,
        recipe_name="tunehouse_test_rl",
        renderer_name=RENDERER,
        max_tokens=12,
        log_path=log_path,
        loss_fn="stable_reinforce",
        lora_rank=8,
        eval_every=0,
        save_every=2,
    )


def dpo_config(log_path: str) -> train_dpo.Config:
    return train_dpo.Config(
        log_path=log_path,
        model_name=MODEL,
        recipe_name="tunehouse_test_dpo",
        renderer_name=RENDERER,
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=_common(2),
            comparison_builder=ComparisonBuilderFromJsonl(train_path=str(COMPARISONS)),
        ),
        learning_rate=5e-3,
        lr_schedule="constant",
        num_epochs=2,
        lora_rank=8,
        dpo_beta=0.1,
        num_replicas=1,
        eval_every=0,
        save_every=0,
    )


def main(recipe: str, log_path: str, max_steps: str = "", load: str = "") -> None:
    if recipe == "sft":
        config = sft_config(log_path, int(max_steps) if max_steps else None, load or None)
        asyncio.run(sl_train.main(config))
    elif recipe == "rl":
        asyncio.run(rl_train.main(rl_config(log_path)))
    elif recipe == "dpo":
        train_dpo.main(dpo_config(log_path))
    else:
        raise SystemExit(f"unknown recipe {recipe!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
