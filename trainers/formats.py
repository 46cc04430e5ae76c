"""The training-file formats, each declared once, and the one rule that tells them apart.

Standard library only: the upload validator (``service.files.validation``, in the API process) and the
trainers' readers (``trainers.data``) both detect a row's format here, so a file the API accepted for a
method is a file that method's reader reads. A file's format (and, for formats with two shapes, its
shape) is its first example's; every later example must have the same.

>>> detect({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
<FileFormat.CHAT: 'chat'>
>>> detect({"messages": [{"role": "user", "content": "Hi"}]})  # no answer to train on: an RL prompt
<FileFormat.PROMPT_ONLY: 'prompt_only'>
>>> shape(FileFormat.PREFERENCE, {"prompt": "Q", "chosen": "A", "rejected": "B"})
<Shape.PROMPT_CHOSEN_REJECTED: 'prompt/chosen/rejected'>
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class FileFormat(StrEnum):
    """The format of a training file (the values are what ``trainers.registry`` lists per method)."""

    CHAT = "chat"
    """``{"messages": [...]}`` ending with an assistant message (supervised fine-tuning)."""
    PROMPT_COMPLETION = "prompt_completion"
    """``{"prompt": str, "completion": str}``."""
    TEXT = "text"
    """``{"text": str}`` for continued pre-training."""
    PREFERENCE = "preference"
    """OpenAI ``{"input": {"messages"}, "preferred_output", "non_preferred_output"}`` or
    ``{"prompt", "chosen", "rejected"}`` (each a string or a message list)."""
    PROMPT_ONLY = "prompt_only"
    """RL prompts: ``{"messages"}`` not ending with an assistant message, or ``{"prompt": str}``."""
    UNPAIRED_PREFERENCE = "unpaired_preference"
    """Unpaired feedback (KTO): ``{"prompt", "completion", "label": true|false}`` (each a string or a message
    list) or ``{"messages": [..., assistant], "label": true|false}``, the last message being the judged
    completion. Detected by a boolean ``label``; once a file has this format, every line needs one."""


SFT_FORMATS = frozenset({FileFormat.CHAT, FileFormat.PROMPT_COMPLETION, FileFormat.TEXT})


class Shape(StrEnum):
    """The two shapes of each format that has two; a file keeps its first line's."""

    OPENAI_PREFERENCE = "input/preferred_output/non_preferred_output"
    PROMPT_CHOSEN_REJECTED = "prompt/chosen/rejected"
    MESSAGES = "messages"  # an RL prompt as a message list
    PROMPT = "prompt"  # an RL prompt as a string
    MESSAGES_LABEL = "messages/label"
    PROMPT_COMPLETION_LABEL = "prompt/completion/label"


def ends_with_assistant(messages: object) -> bool:
    if isinstance(messages, list) and messages:
        last = messages[-1]
        return isinstance(last, dict) and last.get("role") == "assistant"
    return False


def detect(row: Mapping[str, Any], known: FileFormat | None = None) -> FileFormat | None:
    """The format of one example, or None when it has none of the formats' keys. ``known``, the file's
    format so far, settles the shapes that two formats share (a message list is chat or an RL prompt;
    a prompt with a completion is SFT data or an RL prompt with a reference answer), so that a later
    line missing its answer reads as that rather than as a change of format."""
    if any(k in row for k in ("preferred_output", "non_preferred_output", "chosen", "rejected")):
        return FileFormat.PREFERENCE
    # A boolean label marks unpaired feedback; other labels are extra fields of other formats (a grader's
    # reference answer, say). Once the file is unpaired feedback, a row without one is checked as such.
    if isinstance(row.get("label"), bool) or (
        known is FileFormat.UNPAIRED_PREFERENCE and ("prompt" in row or "messages" in row)
    ):
        return FileFormat.UNPAIRED_PREFERENCE
    if "messages" in row:
        if known in (FileFormat.CHAT, FileFormat.PROMPT_ONLY):
            return known
        return FileFormat.CHAT if ends_with_assistant(row["messages"]) else FileFormat.PROMPT_ONLY
    if "prompt" in row:
        # RL prompts may carry any extra field (a "completion" reference answer included); a
        # prompt/completion file must have a completion on every line.
        if known in (FileFormat.PROMPT_COMPLETION, FileFormat.PROMPT_ONLY):
            return known
        return FileFormat.PROMPT_COMPLETION if "completion" in row else FileFormat.PROMPT_ONLY
    if "text" in row:
        return FileFormat.TEXT
    return None


def shape(kind: FileFormat, row: Mapping[str, Any]) -> Shape | None:
    """Which of ``kind``'s two shapes ``row`` has (None for the formats with one shape)."""
    if kind is FileFormat.PREFERENCE:
        return Shape.OPENAI_PREFERENCE if "input" in row else Shape.PROMPT_CHOSEN_REJECTED
    if kind is FileFormat.PROMPT_ONLY:
        return Shape.MESSAGES if "messages" in row else Shape.PROMPT
    if kind is FileFormat.UNPAIRED_PREFERENCE:
        return (
            Shape.MESSAGES_LABEL
            if "messages" in row and "prompt" not in row
            else Shape.PROMPT_COMPLETION_LABEL
        )
    return None


# The training-primitives (Tinker) API's built-in losses and the `loss_fn_inputs` each reads besides
# `target_tokens` (one value per input token): the API checks a call against this before it is sent,
# trainers/losses/primitives.py implements each one.
PRIMITIVE_LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
    # the sampler's log-probabilities come from what the server recorded when it sampled (provenance)
    "stable_reinforce": ("advantages",),
}
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # Tinker's PPO range, ε = 0.2
# Each loss's `loss_fn_config` keys and their defaults (another key is refused, naming it)
PRIMITIVE_LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": _CLIP,
    "cispo": _CLIP,
    "gspo": _CLIP,
    # Tinker's docs give no default beta; 0.05 is the value their example passes
    "dro": {"beta": 0.05},
    # the cap C of the truncated importance weight min(ρ, C) (Yao et al. 2025 use C = 2)
    "stable_reinforce": {"truncation": 2.0},
}
# The losses that read what the sampler recorded for the datum's tokens: each datum names its sampled
# sequences (`Datum.with_provenance`), from a sampling client made with `record_stability_info=True`
PRIMITIVE_LOSS_PROVENANCE = frozenset({"stable_reinforce"})
# what the server adds to such a loss's inputs, per target: the sampler's recorded log-probability, and
# 1 where the target is a sampled token (0 on prompt tokens, which were not sampled)
RECORDED_LOGPROBS, RECORDED_MASK = "recorded_logprobs", "recorded_mask"
