"""Rollouts for the online methods (GRPO, PPO, RLOO, online DPO): prompts from RL rows, batched sampling,
per-token log-probs, and the micro-batches and step-preparer base they share.

RL rows are ``{"messages": [...], "tools": [...]}`` (OpenAI's chat row, ``trainers.chat.rows``, rendered with
the chat template, the row's tools and its generation prompt) or ``{"prompt": str}``; every other field is a
column handed to the reward functions. ``generate_rollout`` samples ``num_generations`` completions per prompt
in one ``model.generate`` call (KV cache, prompts left-padded, stop at EOS), seeded so that a resumed run
draws the same completions. A completion's mask covers its tokens up to and including EOS; a completion
without EOS is ``truncated``. Each completion is read with the model's chat format
(``trainers.chat.formats``), so that graders read its content, reasoning and tool calls
(``trainers.rewards.samples``: ``{{sample.output_text}}``, ``{{sample.output_tools}}``).

``completion_logps`` gives log p(o_t | q, o_<t) of each completion token under a model, with logits
divided by the sampling temperature, as the policy-gradient losses need. Where the model's decoder runs
alone on packed rows (``modeling.runs_packed``), it runs on the real tokens only (``completion_layout``):
each row's prompt and completion packed, and where its attention takes a mask (``modeling.pair_packing``),
the prompt shared by consecutive rows (a GRPO or RLOO group, an online DPO pair) once
(``packing.shared_prompt_layout``).

A step preparer (``trainers.core.loop.StepPreparer``) subclasses ``ReusedRollout``: its ``rollout`` samples,
scores, and splits the rollout into ``micro_batch_spans`` (``Rollout.select`` trims their padding) of
``RolloutBatch``es, which the loop trains on for ``steps_per_rollout`` steps and checkpoints while in use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Generic, NoReturn, Self, TypeVar

import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import LogitsProcessorList, PreTrainedTokenizerBase

from trainers.chat.rows import read_chat
from trainers.core import distributed as dist
from trainers.core.errors import DataError
from trainers.core.loop import PreparedStep
from trainers.data.chat import prompt_text, read_errors
from trainers.data.chat_prompt import chat_format
from trainers.data.example_store import ExampleWriter
from trainers.data.packing import PackedLayout, PairPacking, pack_layout, shared_prompt_layout
from trainers.data.sft import _bos_text, first_row_kind, row_errors, rows_of_kind
from trainers.formats import FileFormat, Shape
from trainers.kernels.merged_lora import merged_lora
from trainers.modeling.generation import SamplingProcessor, contiguous_head_input, marker_decoder
from trainers.modeling.loading import decoder_and_head, packed_hidden_states, pair_packing, runs_packed
from trainers.rewards.samples import Completion


@dataclass(frozen=True)
class RLPrompt:
    """One RL row, ready to sample from."""

    text: str  # the prompt as the model sees it (chat template applied), given to reward functions
    input_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other fields


def tokenize_rl_rows(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int,
    param: str = "training_file",
) -> Sequence[RLPrompt]:
    """Render and tokenize prompts; longer prompts keep their last ``max_prompt_length`` tokens. They are
    written to disk as they come (``trainers.data.example_store``): a large prompt file does not live in
    RAM."""
    kind = first_row_kind(
        rows,
        frozenset({FileFormat.PROMPT_ONLY}),
        expected='{"messages": [...]} not ending with an assistant message, or {"prompt": str}',
        param=param,
    )
    bos = _bos_text(tokenizer)
    prompts = ExampleWriter(RLPrompt)
    for line, row in rows_of_kind(rows, kind, param=param):
        if kind.shape is Shape.MESSAGES:
            with row_errors(line, kind, param=param), read_errors():
                chat = read_chat(row["messages"], "messages", tools_from=row)
                chat.weights = [0] * len(chat.weights)  # a prompt is context only
                text = prompt_text(tokenizer, chat)  # with the row's tools, where the template puts them
            columns = {k: v for k, v in row.items() if k != "messages"}
        elif isinstance(row.get("prompt"), str):
            text = bos + row["prompt"]
            columns = {k: v for k, v in row.items() if k != "prompt"}
        else:
            raise DataError(f'line {line}: "prompt" must be a string', param=param)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt_length:]
        if not ids:
            raise DataError(f"line {line}: the prompt is empty", param=param)
        try:
            prompts.append(RLPrompt(str(tokenizer.decode(ids)), list(ids), columns))
        except (TypeError, ValueError) as exc:  # kept as JSON on disk
            message = f"line {line}: the row's fields must be JSON values ({exc})"
            raise DataError(message, param=param) from exc
    return prompts.finish()


@dataclass
class Rollout:
    """``N = len(prompts) * num_generations`` sampled completions, each prompt's G completions adjacent.

    prompt_ids, prompt_mask: [N, P], left-padded. completion_ids, completion_mask: [N, C], right-padded;
    the mask covers tokens up to and including EOS. truncated: [N] bool, no EOS within the budget.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    prompts: list[str]  # one per completion
    # decoded without special tokens but the chat format's markers, each with what the format read from it
    completions: list[Completion]
    columns: dict[str, list[Any]]  # one entry per completion

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)

    def loss_mask(self, mask_truncated: bool) -> torch.Tensor:
        """The completion mask, zero on truncated completions if ``mask_truncated`` (they get no loss)."""
        if not mask_truncated:
            return self.completion_mask
        return self.completion_mask * (~self.truncated).long().unsqueeze(1)

    def select(self, rows: slice) -> RolloutRows:
        """Rows ``rows`` (a micro-batch), without the columns that are padding in all of them."""
        prompt_ids, prompt_mask = trim_left_padding(self.prompt_ids[rows], self.prompt_mask[rows])
        width = max(1, int(self.completion_mask[rows].sum(dim=1).max()))
        return RolloutRows(
            prompt_ids,
            prompt_mask,
            self.completion_ids[rows, :width],
            self.completion_mask[rows, :width],
            width,
        )


@dataclass(frozen=True)
class RolloutRows:
    """Some rows of a rollout, trimmed: prompts [n, P'], completions [n, C'] (C' = ``width``)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    width: int

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The arguments of ``completion_logps`` and ``reference_logps``."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def trim_left_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading columns that are padding in every row of a left-padded batch."""
    keep = int(mask.sum(dim=1).max())
    return ids[:, ids.size(1) - keep :], mask[:, mask.size(1) - keep :]


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [N, C] of tokens up to and including the first EOS, truncated [N] where there is none).

    >>> completion_mask_from_eos(torch.tensor([[5, 2, 0], [5, 6, 7]]), eos_id=2)
    (tensor([[1, 1, 0],
            [1, 1, 1]]), tensor([False,  True]))
    """
    is_eos = completion_ids == eos_id
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.size(1))
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device)
    mask = (positions.unsqueeze(0) <= first.unsqueeze(1)).long()
    return mask, ~has_eos


def rollout_seed() -> int:
    """The seed of a step's sampling: drawn from the loop's RNG, so a resumed run draws the same
    completions, plus the rank, so that ranks (which share the loop's RNG) sample differently."""
    return int(torch.randint(0, 2**62, (1,)).item()) + dist.rank()


@torch.no_grad()
def generate_rollout(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[RLPrompt],
    *,
    num_generations: int,
    max_completion_length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int,
    greedy: bool = False,
) -> Rollout:
    """Sample ``num_generations`` completions per prompt with the KV cache, seeded by ``seed``
    (``greedy``: the most likely token at each step instead, as validation does by default).

    The model is put in eval mode for sampling (no dropout) and restored to its mode afterwards. The
    global RNG is left as it was: sampling draws from a generator forked and seeded with ``seed``.
    """
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos_id, int) and isinstance(pad_id, int)
    device = next(model.parameters()).device
    repeated = [p for p in prompts for _ in range(num_generations)]
    prompt_ids, prompt_mask = left_pad([p.input_ids for p in repeated], pad_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    was_training = model.training
    model.eval()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), merged_lora(model), contiguous_head_input(model):
            torch.manual_seed(seed)
            generate: Any = model.generate  # transformers types generate() loosely
            # generate's greedy search, which takes no sampling knobs (transformers warns when they are
            # given); to sample, the last logits processor draws the token and leaves it alone to pick
            sampling: dict[str, Any] = {"do_sample": False}
            if not greedy:
                processor = SamplingProcessor(temperature=temperature, top_p=top_p)
                sampling["logits_processor"] = LogitsProcessorList([processor])
            output = generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                **sampling,
                max_new_tokens=max_completion_length,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
                use_cache=True,
            )
    finally:
        model.train(was_training)
    completion_ids = output[:, prompt_ids.size(1) :]
    mask, truncated = completion_mask_from_eos(completion_ids, eos_id)
    completion_ids = completion_ids.masked_fill(mask == 0, pad_id)
    # each completion read with the model's chat format, for graders (content, reasoning, tool calls)
    fmt = chat_format(tokenizer)
    decode = marker_decoder(tokenizer, fmt.markers)
    completions = [
        Completion.read(decode(row[: int(n)].tolist()), fmt, p.text)
        for row, n, p in zip(completion_ids.cpu(), mask.sum(dim=1).cpu(), repeated, strict=True)
    ]
    keys = {k for p in prompts for k in p.columns}
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        truncated=truncated,
        prompts=[p.text for p in repeated],
        completions=completions,
        columns={k: [p.columns.get(k) for p in repeated] for k in sorted(keys)},
    )


def forward_completion(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    output_hidden_states: bool = False,
) -> Any:
    """Forward pass over prompt + completion; position ids count real tokens only, as in generation.
    The head runs on the last C + 1 positions only (``logits_to_keep``), a strided slice of the hidden
    states, so it gets a contiguous copy of them (``contiguous_head_input``: else the CPU copies the head's
    weight once per row, in forward and again in backward)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    with contiguous_head_input(model):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=completion_ids.size(1) + 1,
            output_hidden_states=output_hidden_states,
        )


def token_logps(
    logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [N, C] of ``completion_ids`` and entropies [N, C] (no grad) from ``logits``
    [N, C + 1, V] (the last C + 1 positions of prompt + completion), divided by ``temperature``."""
    return _predicted_logps(logits[:, :-1, :], completion_ids, temperature)


def _predicted_logps(
    logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logps`` from the logits [N, C, V] that predict each completion token."""
    logits = logits.float() / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return logps, entropy


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(o_t | q, o_<t) [N, C] of each completion token under ``model``, and the entropies [N, C]
    (values at the positions ``completion_mask`` leaves out are not defined). On the real tokens only
    where the decoder runs alone (the module docstring)."""
    split = decoder_and_head(model)
    if split is None or not runs_packed(model):
        out = forward_completion(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        return token_logps(out.logits, completion_ids, temperature)
    decoder, head = split
    shared = pair_packing(model) is PairPacking.SHARED_PROMPTS
    packed = completion_layout(
        prompt_ids, prompt_mask, completion_ids, completion_mask, shared_prompts=shared
    )
    device = prompt_ids.device
    layout = packed.layout.to(device)
    hidden = packed_hidden_states(decoder, packed.input_ids.to(device), layout)
    predicting = layout.take(hidden, packed.predicting.to(device))  # zeros where a row has no token
    return _predicted_logps(head(predicting), completion_ids, temperature)


@dataclass(frozen=True)
class CompletionLayout:
    """Prompts and completions laid out on their real tokens only (``completion_layout``)."""

    layout: PackedLayout  # of right-padded rows [N, T]: each row's prompt tokens, then its completion's
    input_ids: torch.Tensor  # [R, W] the packed rows
    # [N, C] the packed slot whose hidden state predicts each completion token; R * W (one past the end)
    # where ``completion_mask`` has no token
    predicting: torch.Tensor


def completion_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    shared_prompts: bool,
) -> CompletionLayout:
    """Left-padded prompts [N, P] and right-padded completions [N, C] (their masks as prefixes) packed on
    the CPU: each row as a sequence of its own (``pack_layout``), or with ``shared_prompts`` every run of
    consecutive rows that begin with the same prompt as one group whose prompt runs once
    (``shared_prompt_layout``). Positions count real tokens only, as in generation."""
    prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu()
    completion_ids, completion_mask = completion_ids.cpu(), completion_mask.cpu()
    n, width = prompt_ids.shape
    prompts = [
        row[width - int(length) :] for row, length in zip(prompt_ids, prompt_mask.sum(dim=1), strict=True)
    ]
    completions = completion_mask.sum(dim=1).tolist()
    lengths = [len(p) + c for p, c in zip(prompts, completions, strict=True)]
    padded_width = max(lengths)
    rows = torch.zeros((n, padded_width), dtype=prompt_ids.dtype)
    for i, (prompt, c) in enumerate(zip(prompts, completions, strict=True)):
        rows[i, : len(prompt)] = prompt
        rows[i, len(prompt) : len(prompt) + c] = completion_ids[i, :c]
    if shared_prompts:
        groups: list[list[int]] = []
        for i in range(n):
            if groups and torch.equal(prompts[groups[-1][0]], prompts[i]):
                groups[-1].append(i)
            else:
                groups.append([i])
        layout = shared_prompt_layout(
            [len(prompts[g[0]]) for g in groups],
            [[completions[i] for i in g] for g in groups],
            groups,
            padded_width,
        )
    else:
        layout = pack_layout(lengths, padded_width, capacity=padded_width)
    # completion token j of row i is predicted at padded position len(prompt) - 1 + j of row i
    steps = torch.arange(completion_ids.shape[1])
    starts = torch.tensor([i * padded_width + len(p) - 1 for i, p in enumerate(prompts)])
    positions = (starts[:, None] + steps).clamp(max=n * padded_width - 1)
    rows_packed, packed_width = layout.packed_shape
    within = steps < torch.tensor(completions)[:, None]
    predicting = torch.where(within, layout.slot_of[positions], rows_packed * packed_width)
    return CompletionLayout(layout, layout.pack(rows), predicting)


def load_frozen_reference(model_path: str, device: torch.device) -> torch.nn.Module:
    """A frozen copy of the base model: the KL reference of full fine-tuning (LoRA needs none)."""
    from transformers import AutoModelForCausalLM

    reference: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    reference.eval().requires_grad_(False)
    return reference.to(device)


@torch.no_grad()
def reference_logps(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Token log-probs [N, C] under the reference: ``reference`` if given (full fine-tuning), else the
    LoRA ``model`` with its adapter disabled, so that LoRA runs hold one copy of the base weights."""
    args = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    if reference is not None:
        return completion_logps(reference, *args, temperature=temperature)[0]
    if not isinstance(model, PeftModel):
        raise ValueError("a reference model is needed to compute a KL to the base without LoRA")
    with model.disable_adapter():
        return completion_logps(model, *args, temperature=temperature)[0]


# -- what the online methods' step preparers share -----------------------------------------------------
def micro_batch_spans(sizes: Sequence[int]) -> list[slice]:
    """Consecutive row ranges of the given sizes: a rollout's micro-batches.

    >>> micro_batch_spans([4, 4, 2])
    [slice(0, 4, None), slice(4, 8, None), slice(8, 10, None)]
    """
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return [slice(end - size, end) for end, size in zip(ends, sizes, strict=True)]


def rollout_only(examples: Sequence[RLPrompt]) -> NoReturn:
    """The ``collate`` of online methods' tasks: their batches come from the step preparer."""
    raise TypeError(
        "online methods build their batches from rollouts in their StepPreparer, not by collating"
    )


@dataclass
class RolloutBatch:
    """Base of the micro-batches online methods build from a rollout: prompts [n, P] (left-padded) and
    completions [n, C]; subclasses add their tensors and say what their loss units are."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def loss_denominator(self) -> int:
        raise NotImplementedError

    @property
    def n_tokens(self) -> int:
        return int(self.prompt_mask.sum()) + int(self.completion_mask.sum())

    def to(self, device: torch.device) -> Self:
        moved = {
            f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def state_dict(self) -> dict[str, Any]:
        """A checkpointable copy: the fields, tensors on the CPU."""
        return {
            f.name: v.cpu() if isinstance(v := getattr(self, f.name), torch.Tensor) else v
            for f in fields(self)
        }


BatchT = TypeVar("BatchT", bound=RolloutBatch)


class ReusedRollout(Generic[BatchT]):
    """Base of the step preparers that train on one rollout for ``steps_per_rollout`` consecutive optimizer
    steps: ``rollout`` samples and builds the batches at repeat 0; later repeats (and a run resumed between
    them, from ``state_dict``) reuse them."""

    def __init__(self, batch_type: type[BatchT], steps_per_rollout: int) -> None:
        self.batch_type, self.steps_per_rollout = batch_type, steps_per_rollout
        self.current: PreparedStep[BatchT] | None = None
        self.spent = False  # the current rollout's last step is done: a checkpoint need not carry it

    def rollout(self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]]) -> PreparedStep[BatchT]:
        raise NotImplementedError

    def prepare(
        self, model: torch.nn.Module, examples: list[Sequence[RLPrompt]], repeat: int
    ) -> PreparedStep[BatchT]:
        if repeat == 0 or self.current is None:
            self.current = self.rollout(model, examples)
        self.spent = repeat == self.steps_per_rollout - 1
        return self.current

    def state_dict(self) -> dict[str, Any]:
        if self.current is None or self.spent:
            return {}
        return {"batches": [b.state_dict() for b in self.current.batches], "metrics": self.current.metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            batches: list[dict[str, Any]] = state["batches"]
            self.current = PreparedStep([self.batch_type(**b) for b in batches], dict(state["metrics"]))


@dataclass
class GRPOBatch(RolloutBatch):
    """One micro-batch of a rollout: [N, P] prompts, [N, C] completions, [N] advantages."""

    # completion_mask is the loss mask: zero for truncated completions if they are masked
    advantages: torch.Tensor
    old_logps: torch.Tensor | None  # π_old when num_iterations > 1; else the current policy, detached
    ref_logps: torch.Tensor | None  # when beta > 0
    loss_units: int  # this micro-batch's share of the step's loss denominator
    metric_scale: float  # step loss units / step completion tokens: token sums / units = token means

    @property
    def loss_denominator(self) -> int:
        return self.loss_units
