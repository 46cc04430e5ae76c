"""The one signature of every method's train function (the ``trainer`` of its ``trainers.registry``
entry), and the steps each of them starts with.

    train_x(config, train_rows, valid_rows=None, callbacks=None, *, rewards=None) -> TrainResult

``rewards`` (a ``trainers.rewards.reward_set.RewardSet``) is required by the methods the registry marks
``grader`` and
refused by the others, so the worker calls every method the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from trainers.architectures import problem as architecture_problem
from trainers.core.callbacks import TrainingCallbacks, TrainResult
from trainers.core.config import TrainingConfig
from trainers.core.errors import DataError
from trainers.core.rng import seed_everything
from trainers.data.vision import ImageFiles, VisionData
from trainers.families.shared_base import seat_of_this_thread, shareable
from trainers.kernels.install import install_kernels
from trainers.modalities import image_token_id
from trainers.modeling.loading import (
    ModelSettings,
    load_model,
    load_sequence_classifier,
    load_tokenizer,
    model_type,
)
from trainers.modeling.vision import is_vision_model, load_processor, load_vision_model, model_config
from trainers.registry import get_method

if TYPE_CHECKING:
    from trainers.rewards.reward_set import RewardSet

Rows = Sequence[Mapping[str, Any]]
T = TypeVar("T")


class TrainEntry(Protocol):
    def __call__(
        self,
        config: Any,
        train_rows: Rows,
        valid_rows: Rows | None = None,
        callbacks: TrainingCallbacks | None = None,
        *,
        rewards: RewardSet | None = None,
    ) -> TrainResult: ...


def begin_training(
    config: TrainingConfig,
    *,
    valid_rows: Rows | None,
    rewards: RewardSet | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedTokenizerBase:
    """Check the config's ranges, that the model's architecture takes the features it asks for
    (``trainers.architectures.problem``: the check the service makes at job creation, repeated for a
    model the service could not read) and that the inputs fit the method; seed everything, load the
    tokenizer (unless given: a vision model's processor's)."""
    config.validate()
    problem = architecture_problem(model_type(config.model_path), config.hyperparameters())
    if problem is not None:
        name, message = problem
        raise DataError(message, param=f"hyperparameters.{name}")
    method = get_method(config.method)
    if method.grader and rewards is None:
        raise DataError(f"method '{method.name}' needs a grader (reward functions)", param="grader")
    if not method.grader and rewards is not None:
        raise ValueError(f"method '{method.name}' takes no reward functions")
    seed_everything(config.seed)
    return tokenizer if tokenizer is not None else load_tokenizer(config.model_path)


def load_vision_data(config: TrainingConfig) -> VisionData | None:
    """The processor and image files a run reads rows with images through, where its model takes images
    (``trainers.data.vision``); None for a text model."""
    if not is_vision_model(config.model_path):
        return None
    token = image_token_id(model_config(config.model_path))
    return VisionData(load_processor(config.model_path), ImageFiles(config.images_dir), image_token_id=token)


def begin_on_rows(
    config: TrainingConfig,
    tokenize_rows: Callable[..., Sequence[T]],
    train_rows: Rows,
    valid_rows: Rows | None,
    *,
    rewards: RewardSet | None,
    **limits: Any,
) -> tuple[PreTrainedTokenizerBase, Sequence[T], Sequence[T] | None]:
    """``begin_training``, then ``tokenize_rows(rows, tokenizer=..., param=..., **limits)`` on the training
    rows and, when given, the validation rows (each split's errors name its file). A ``vision`` among the
    limits (``load_vision_data``'s) brings the tokenizer: its processor's."""
    vision: VisionData | None = limits.get("vision")
    tokenizer = begin_training(
        config, valid_rows=valid_rows, rewards=rewards, tokenizer=vision.tokenizer if vision else None
    )
    tokenize = partial(tokenize_rows, tokenizer=tokenizer, **limits)
    train = tokenize(train_rows, param="training_file")
    return tokenizer, train, tokenize(valid_rows, param="validation_file") if valid_rows else None


def load_model_to_train(settings: ModelSettings, device: torch.device) -> torch.nn.Module:
    """The model a method trains: loaded (``trainers.modeling.loading.load_model``), then the job's kernels
    installed on it in one explicit call (``trainers.kernels.install.install_kernels``). A job on a shared
    base (``trainers.families.shared_base``) gets its adapter on that base instead; a vision-language
    base loads through ``trainers.modeling.vision`` (never shared)."""
    if is_vision_model(settings.model_path):
        return install_kernels(load_vision_model(settings, device), settings, device)
    seat = seat_of_this_thread()
    if seat is not None and shareable(settings):
        base, name = seat
        return base.attach(name, settings, device)
    return install_kernels(load_model(settings, device), settings, device)


def load_classifier_to_train(
    settings: ModelSettings, device: torch.device, *, pad_token_id: int
) -> torch.nn.Module:
    """``load_model_to_train`` for a sequence classifier (a reward model)."""
    seat = seat_of_this_thread()
    if seat is not None and shareable(settings):
        base, name = seat
        return base.attach_classifier(name, settings, device, pad_token_id=pad_token_id)
    model = load_sequence_classifier(settings, device, pad_token_id=pad_token_id)
    return install_kernels(model, settings, device)
