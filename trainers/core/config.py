"""The hyperparameters every training method shares, and their range checks.

Each method's config (``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``RLOOConfig``, ...: one per method)
subclasses ``TrainingConfig``, names its ``trainers.registry`` entry in ``method``, re-declares a shared
field only where its default differs (``learning_rate``) and adds its own data and method fields. Field
names are the registry's hyperparameter names (the worker builds configs by keyword), and the ranges are
the registry's: ``validate`` checks them, there is no second copy here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from trainers.core.errors import DataError
from trainers.registry import get_method


@dataclass
class TrainingConfig:
    """The fields every method config has; each method documents how it reads them where that differs.

    Model:
        model_path: a local Hugging Face folder (or a hub id where the host is online).
        output_dir: local folder that receives ``checkpoint-{step:06d}/`` folders.
        use_lora: train a LoRA adapter (merged into the base for the final checkpoint) instead of all
            weights.
        lora_r, lora_alpha, lora_dropout: LoRA rank, scaling numerator (scale = alpha / r) and dropout.
        lora_target_modules: module names to adapt; None adapts every linear layer but the LM head.
        gradient_checkpointing: recompute activations in the backward pass to save memory.

    Optimisation:
        n_epochs: passes over the training rows.
        batch_size: examples per forward pass (micro-batch).
        gradient_accumulation_steps: micro-batches per optimizer step; an optimizer step sees
            ``batch_size * gradient_accumulation_steps`` examples (fewer at the end of an epoch).
        learning_rate: peak AdamW learning rate (each method has its own default).
        lr_scheduler: ``linear`` | ``cosine`` (decay to 0) | ``constant``, after linear warmup.
        warmup_ratio: fraction of the optimizer steps spent warming up from 0.
        weight_decay: AdamW decoupled weight decay, on matrices only.
        max_grad_norm: clip the global gradient norm to this.
        mixed_precision: ``auto`` (bf16 on CUDA if supported, else none) | ``no`` | ``bf16`` | ``fp16``;
            on a CPU only ``bf16`` autocasts (``precision.autocast_dtype``), the others train in fp32.
        seed: seeds LoRA initialisation, dropout and the data order.
        max_steps: cap on the number of optimizer steps (None: ``n_epochs`` full epochs).

    Run control:
        save_steps: write a resumable checkpoint every N optimizer steps (0: none by step count).
        save_minutes: also write one whenever this many minutes of training passed since the last
            (0: none by time), so a crash loses at most that much work; with ``save_steps`` 0 and
            ``save_minutes`` 0 only the final checkpoint is written.
        keep_checkpoints: resumable checkpoints kept in ``output_dir``; older ones are deleted as new
            ones are written (the final checkpoint is never deleted). Not a job hyperparameter: the
            worker sets it from the deployment's ``TUNEHOUSE_CHECKPOINT_KEEP``.
        eval_steps: evaluate every N steps when validation rows are given (``valid_loss``; the online
            methods' ``valid_reward``, see ``RolloutConfig``); 0 does it at the end of each epoch (and
            always after the last step).
        resume_from: a checkpoint folder written by this library; training continues from it exactly.
    """

    method: ClassVar[str]  # the trainers.registry entry whose ranges ``validate`` checks

    model_path: str
    output_dir: str
    use_lora: bool = True
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    n_epochs: int = 1
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-4
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"
    gradient_checkpointing: bool = False
    seed: int = 42
    max_steps: int | None = None
    save_steps: int = 0
    save_minutes: float = 10.0
    keep_checkpoints: int = 3
    eval_steps: int = 0
    resume_from: str | None = None

    def validate(self) -> None:
        """Raise ``DataError`` naming the first hyperparameter out of range.

        The ranges are the method's declaration in ``trainers.registry`` (the same the API validates
        with), checked in declaration order, then the method's cross-field constraints.
        """
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        problem = get_method(self.method).check(values, by_field=True)
        if problem is None and self.keep_checkpoints < 1:  # the one run-control field the API lacks
            problem = (
                "keep_checkpoints",
                f"keep_checkpoints={self.keep_checkpoints!r} is out of range: expected >= 1",
            )
        if problem is not None:
            name, message = problem
            raise DataError(message, param=f"hyperparameters.{name}")


@dataclass
class RolloutConfig(TrainingConfig):
    """The fields of every method that samples from the policy it trains (GRPO, PPO, RLOO, online DPO;
    the registry's ``RL_COMMON``):

    Data:
        max_prompt_length: prompts keep their last this many tokens.

    Sampling:
        max_completion_length: sampling budget in tokens; a completion without EOS is truncated.
        temperature, top_p: sampling parameters; the policy-gradient methods compute log-probs at the
            same temperature.

    Validation (``valid_rows``, at ``eval_steps`` and after the last step):
        eval_sampling: ``greedy`` (the default: one deterministic completion per validation prompt) or
            ``sample`` (one completion drawn with ``temperature`` and ``top_p``, from the same seed at
            every evaluation). The grader scores them: ``valid_reward`` is the mean weighted reward,
            ``valid_reward/{grader}`` each reward function's mean (``trainers.families.rl.reward_evaluator``).
    """

    max_prompt_length: int = 512
    max_completion_length: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    eval_sampling: str = "greedy"

    @property
    def uses_reference(self) -> bool:
        """Whether the method compares the policy with the base model (then a full fine-tune loads a
        frozen copy of it; LoRA disables its adapter instead)."""
        raise NotImplementedError
