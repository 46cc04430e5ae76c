"""The hyperparameters every training method shares, and their range checks.

Each method's config (``SFTConfig``, ``DPOConfig``, ``RewardModelConfig``, ``GRPOConfig``,
``PPOConfig``) subclasses ``TrainingConfig``, re-declares a shared field only where its default differs
(``learning_rate``) and adds its own data and method fields. Field names are the job spec's
hyperparameter names (the worker builds configs by keyword), so they must not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.errors import DataError
from trainers.modeling import PRECISIONS
from trainers.schedule import SCHEDULES


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
        max_grad_norm: clip the global gradient norm to this (<= 0: no clipping).
        mixed_precision: ``auto`` (bf16 on CUDA if supported, else none) | ``no`` | ``bf16`` | ``fp16``;
            CPU always trains in plain fp32.
        seed: seeds LoRA initialisation, dropout and the data order.
        max_steps: cap on the number of optimizer steps (None: ``n_epochs`` full epochs).

    Run control:
        save_steps: write a resumable checkpoint every N optimizer steps; 0 writes only the final one.
        eval_steps: compute ``valid_loss`` every N steps when validation rows are given; 0 does it at the
            end of each epoch (and always after the last step).
        resume_from: a checkpoint folder written by this library; training continues from it exactly.
    """

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
    eval_steps: int = 0
    resume_from: str | None = None

    def validate(self) -> None:
        """Raise ``DataError`` naming the first hyperparameter out of range.

        The order checked: ``lora_r``, the method's data fields, the shared optimisation and run-control
        fields, then the method's own fields.
        """
        checks = {
            "lora_r": self.lora_r >= 1,
            **self._data_checks(),
            "n_epochs": self.n_epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "gradient_accumulation_steps": self.gradient_accumulation_steps >= 1,
            "learning_rate": self.learning_rate > 0,
            "lr_scheduler": self.lr_scheduler in SCHEDULES,
            "warmup_ratio": 0.0 <= self.warmup_ratio <= 1.0,
            "weight_decay": self.weight_decay >= 0,
            "mixed_precision": self.mixed_precision in PRECISIONS,
            "max_steps": self.max_steps is None or self.max_steps >= 1,
            "save_steps": self.save_steps >= 0,
            "eval_steps": self.eval_steps >= 0,
            **self._method_checks(),
        }
        for name, ok in checks.items():
            if not ok:
                raise DataError(
                    f"{name}={getattr(self, name)!r} is out of range", param=f"hyperparameters.{name}"
                )

    def _data_checks(self) -> dict[str, bool]:
        """Field name -> whether it is in range, for the method's data fields (checked after lora_r)."""
        return {}

    def _method_checks(self) -> dict[str, bool]:
        """Field name -> whether it is in range, for the method's own fields (checked last)."""
        return {}
