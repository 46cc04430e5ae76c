"""A reward model built on a LoRA causal LM that other jobs train too (a shared base,
``trainers.families.shared_base``): the LM's decoder under this job's adapter, and a scalar head of the
job's own.

A lone reward model is transformers' sequence classifier with a LoRA adapter and a fully trained
``score`` head (``trainers.modeling.loading.load_sequence_classifier``). Its decoder is the causal LM's
decoder, weight for weight, under the same adapter layers; only the LM head is replaced by ``score``.
So on a shared causal LM the same classifier is the decoder with the job's adapter active, followed by a
head the job holds itself: ``AdapterClassifier``. It computes what the lone classifier computes, starts
from the same initial weights (``untrained_head`` draws the head as transformers does, before the
adapter is drawn), and its files are the lone classifier's files (``save_trained``): a checkpoint holds
the adapter and the head under the names peft gives them, the export a plain
``AutoModelForSequenceClassification`` with the adapter merged into a copy of the base weights.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, TaskType
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from trainers.core import checkpoint

HEAD = "score"  # transformers' name of a causal LM classifier's head (GenericForSequenceClassification)
# the head's key in a lone LoRA reward model's adapter file (peft's name for a `modules_to_save` module)
HEAD_KEY = f"base_model.model.{HEAD}.weight"


def untrained_head(model_path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Linear:
    """The scalar head of a new reward model on ``model_path``, as transformers initialises the missing
    ``score`` of a classifier loaded in ``dtype`` (normal, std ``initializer_range``, from the global
    generator) and then kept in float32 for training. Drawn before the adapter's weights, as a lone
    reward model's are, so that one seed gives both the same start."""
    config = AutoConfig.from_pretrained(model_path)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    weight = torch.empty(1, config.hidden_size, dtype=dtype).normal_(0.0, std).float()
    head = torch.nn.Linear(config.hidden_size, 1, bias=False, device="meta")  # draws nothing
    head.weight = torch.nn.Parameter(weight.to(device))
    return head


class AdapterClassifier(torch.nn.Module):
    """``head(decoder(x))`` scored at each row's rightmost non-pad token, the decoder being ``lm``'s
    under adapter ``adapter`` (active whenever this job holds the turn on the shared base)."""

    def __init__(self, lm: PeftModel, adapter: str, head: torch.nn.Linear, pad_token_id: int) -> None:
        super().__init__()
        self.lm, self.adapter, self.head, self.pad_token_id = lm, adapter, head, pad_token_id

    @property
    def base(self) -> PreTrainedModel:
        """The causal LM under the adapters."""
        base = self.lm.get_base_model()
        assert isinstance(base, PreTrainedModel)
        return base

    @property
    def decoder(self) -> torch.nn.Module:
        decoder: torch.nn.Module = getattr(self.base, self.base.base_model_prefix)
        return decoder

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool = False
    ) -> SequenceClassifierOutputWithPast:
        # as GenericForSequenceClassification: the head on every position, then each row's last real one
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)
        logits = self.head(hidden.last_hidden_state)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (positions * (input_ids != self.pad_token_id)).argmax(-1)
        return SequenceClassifierOutputWithPast(
            logits=logits[torch.arange(input_ids.shape[0], device=input_ids.device), last]
        )

    def restore_head(self, model_folder: Path) -> None:
        """The head's weights from a checkpoint's ``model/`` folder (a lone reward model's too)."""
        saved = checkpoint.load_adapter_file(model_folder)
        with torch.no_grad():
            self.head.weight.copy_(saved[HEAD_KEY])

    def save_trained(self, path: Path, *, final: bool) -> None:
        """``trainers.core.checkpoint.SavesItself``: a lone LoRA reward model's files (see the module's
        docstring)."""
        if not final:
            adapter = copy.deepcopy(self.lm.peft_config[self.adapter])
            assert isinstance(adapter, LoraConfig)
            adapter.task_type, adapter.modules_to_save = TaskType.SEQ_CLS, [HEAD]
            checkpoint.save_active_adapter(
                self.lm, path, config=adapter, extra={HEAD_KEY: self.head.weight.detach()}
            )
            return
        weights = checkpoint.merged_copy_weights(self.lm)
        weights.pop("lm_head.weight", None)  # the causal LM's head; a classifier has `score` instead
        weights[f"{HEAD}.weight"] = self.head.weight.detach()  # float32, as a lone reward model's
        config = copy.deepcopy(self.base.config)
        config.num_labels = 1
        config.pad_token_id = self.pad_token_id
        checkpoint.save_as_plain(
            AutoModelForSequenceClassification.from_config,
            config,
            weights,
            path,
            dtype=checkpoint.loaded_dtype(self.base),
        )
