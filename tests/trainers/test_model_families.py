"""Every model family people fine-tune trains on our trainers, on the CPU (tests/model_families.py: tiny
random-init models of each architecture with its real chat template from TRL).

- The matrix: family x {SFT LoRA, SFT full, SFT packed, DPO, GRPO}, three steps each, trains (the loss of
  the repeated batch falls, for GRPO the weights move) and its export (LoRA merged) loads with plain
  ``AutoModelForCausalLM``; or, where the architecture cannot take the feature, the trainer refuses it
  with the ``DataError`` naming the hyperparameter (``REFUSED``; the service's 400 for the same:
  tests/service/test_job_creation.py).
- Where our kernels replace transformers' computation (fused LoRA, activation recompute, the chunked LM
  head, packed rows, CPU attention), the SFT loss and every gradient, and the log-probs that DPO and GRPO
  read, equal a plain transformers forward of the same weights on the same rows: eager attention, no
  kernel of ours, LoRA as peft computes it. Each family's rows cross its sliding window.
- What LoRA adapts on a mixture of experts: attention and the experts' fused weights, not the router.
"""

from __future__ import annotations

import doctest
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from trl.chat_template_utils import get_training_chat_template

import trainers.architectures
from tests.model_families import FAMILIES, TEMPLATES_DIR, WINDOW, FamilySpec
from tests.trainers.helpers import Recorder
from trainers.architectures import ARCHITECTURES, architecture
from trainers.chat.rows import read_chat
from trainers.core.errors import DataError
from trainers.data.chat import render
from trainers.data.collate import pack_batch, pad_batch
from trainers.data.packing import PairPacking
from trainers.data.preference import collate_preferences, tokenize_preference_rows
from trainers.data.sft import tokenize_sft_rows
from trainers.families.entry import load_model_to_train
from trainers.families.reference import policy_log_probs
from trainers.families.rollout import completion_logps
from trainers.kernels import varlen_attention
from trainers.kernels.fused_lora import _fused_forward
from trainers.methods.dpo import DPOConfig, train_dpo
from trainers.methods.grpo import GRPOConfig, train_grpo
from trainers.methods.sft import SFTConfig, sft_loss, train_sft
from trainers.modeling.loading import (
    decoder_and_head,
    load_model,
    load_tokenizer,
    pair_packing,
    runs_packed,
)
from trainers.rewards.reward_set import RewardSet

NAMES = list(FAMILIES)
CPU = torch.device("cpu")
# about 20 tokens of the tiny BPE: every row below is longer than the sliding windows (16)
LONG = "the quick brown fox jumps over the lazy dog while the capital of peru is lima"


def test_every_family_has_an_architecture_entry_and_the_docs_say_what_it_declares() -> None:
    assert doctest.testmod(trainers.architectures).failed == 0
    for name, spec in FAMILIES.items():
        assert spec.config_class.model_type in ARCHITECTURES, name
    page = (Path(__file__).parents[2] / "docs" / "model-families.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| ") and "| `" in line[:60]]

    def yes(value: bool) -> str:
        return "yes" if value else "no"

    documented = {tuple(cell.strip().strip("*") for cell in row.strip("|").split("|")) for row in rows}
    declared = {
        (
            arch.family,
            f"`{model_type}`",
            yes(arch.plain_head),
            yes(arch.packed_positions),
            yes(arch.llama_layers),
            "yes" if arch.lora_experts else "—",
        )
        for model_type, arch in ARCHITECTURES.items()
    }
    assert {row for row in documented if len(row) == 6 and row[0] != "family"} == declared


@pytest.mark.parametrize("name", NAMES)
def test_the_family_is_a_real_checkpoint_with_its_real_template(
    name: str, family_model: Callable[[str], Path]
) -> None:
    spec = FAMILIES[name]
    path = family_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model.config) is spec.config_class
    assert tokenizer.chat_template == (TEMPLATES_DIR / spec.template).read_text(encoding="utf-8")
    # the training variant is the one TRL itself swaps in for this template (none for Llama 3.1's)
    if spec.training_template is None:
        with pytest.raises(ValueError, match="patching is not supported"):
            get_training_chat_template(tokenizer)
    else:
        assert get_training_chat_template(tokenizer) == spec.training_chat_template()
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (spec.bos, spec.eos, spec.pad)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in spec.special_tokens}
    for token, token_id in ids.items():  # one id each, never split by the BPE
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id], token
    assert model.generation_config.eos_token_id == [ids[t] for t in spec.generation_eos]
    assert (tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id) == spec.adds_bos
    # an assistant turn ends with the EOS the tokenizer declares (rendered as training renders it: a
    # template that reads content only as parts, Mistral's, is given parts)
    chat = read_chat(
        [
            {"role": "user", "content": "What is the capital of Peru?"},
            {"role": "assistant", "content": "Lima."},
        ],
        "messages",
    )
    assert "Lima." + spec.eos in render(tokenizer, chat, 2, generation_prompt=False)


# -- the matrix ---------------------------------------------------------------------------------------------
METHODS = ["sft-lora", "sft-full", "sft-packing", "dpo", "grpo"]
# (family, method) -> the hyperparameter the trainer refuses (the service refuses it at job creation)
REFUSED = {("gpt-oss", "sft-packing"): "hyperparameters.packing"}


def _chats(spec: FamilySpec) -> list[dict[str, Any]]:
    """Single-turn chats, or for a template that renders no string content prompt/completion strings (the
    chat rendering of issue 53 is to render those too)."""
    pairs = [(f"Question {i}: {LONG}?", f"Answer {i}: {LONG[: 20 + 9 * i]}.") for i in range(4)]
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs
    ]


def _prompt_completions() -> list[dict[str, Any]]:
    return [{"prompt": f"Question {i}: {LONG}?", "completion": f" The answer is {i}."} for i in range(4)]


def _preference_pairs() -> list[dict[str, Any]]:
    return [
        {"prompt": f"Is town {i} a city? {LONG}", "chosen": f" Yes, town {i} is a city.", "rejected": " No."}
        for i in range(4)
    ]


def _rl_prompts(spec: FamilySpec) -> list[dict[str, Any]]:
    texts = [f"Name a color, {LONG}:", "Say hello:"]
    return [{"messages": [{"role": "user", "content": t}]} for t in texts]


def _longer_is_better(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """A reward that differs between a group's completions, so that every GRPO step has an advantage."""
    return [float(len(c)) for c in completions]


def _run(method: str, spec: FamilySpec, path: str, out: str, rec: Recorder) -> Path:
    """Three optimizer steps of ``method`` on one repeated batch; the final checkpoint's model folder."""
    steps = {"max_steps": 3, "n_epochs": 3, "batch_size": 4, "lr_scheduler": "constant"}
    if method.startswith("sft"):
        full = method == "sft-full"
        config = SFTConfig(
            path,
            out,
            use_lora=not full,
            learning_rate=3e-3 if full else 1e-2,
            packing=method == "sft-packing",
            **steps,
        )
        result = train_sft(config, _prompt_completions() if full else _chats(spec), callbacks=rec)
    elif method == "dpo":
        result = train_dpo(
            DPOConfig(path, out, learning_rate=1e-2, **steps), _preference_pairs(), callbacks=rec
        )
    else:
        config = GRPOConfig(
            path,
            out,
            learning_rate=1e-2,
            num_generations=2,
            max_completion_length=6,
            **(steps | {"batch_size": 2, "n_epochs": 1}),
        )
        result = train_grpo(
            config, _rl_prompts(spec) * 3, callbacks=rec, rewards=RewardSet.of([_longer_is_better])
        )
    assert result.final_checkpoint is not None
    return result.final_checkpoint.path / "model"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", NAMES)
def test_each_family_trains_with_each_method_and_exports(
    name: str, method: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    spec, path = FAMILIES[name], family_model(name)
    rec = Recorder()
    refused = REFUSED.get((name, method))
    if refused is not None:
        with pytest.raises(DataError) as info:
            _run(method, spec, str(path), str(tmp_path / "out"), rec)
        assert info.value.param == refused
        assert rec.steps == []
        return
    exported = _run(method, spec, str(path), str(tmp_path / "out"), rec)
    losses = rec.losses
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    if method != "grpo":  # the same batch three times: its loss falls
        assert losses[-1] < losses[0], losses
    # the export is a plain transformers model (LoRA merged), of the base's tensors, trained
    assert not (exported / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert type(model.config) is spec.config_class
    before, after = load_file(path / "model.safetensors"), load_file(exported / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert any(".self_attn." in key for key in changed), sorted(changed)
    if architecture(model.config.model_type).lora_experts:  # LoRA and full training both reach the experts
        assert any(".mlp.experts." in key for key in changed), sorted(changed)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


# -- our kernels against a plain forward --------------------------------------------------------------------
def _plain_twin(config: SFTConfig, ours: torch.nn.Module) -> torch.nn.Module:
    """The same weights as ``ours`` with none of our kernels: transformers' eager attention, peft's LoRA."""
    twin = load_model(config, CPU)
    twin.load_state_dict(ours.state_dict())
    base = twin.get_base_model() if isinstance(twin, PeftModel) else twin
    base.set_attn_implementation("eager")
    return twin


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_grads(ours: Mapping[str, torch.Tensor], plain: Mapping[str, torch.Tensor]) -> None:
    assert ours.keys() == plain.keys()
    for key, expected in plain.items():
        scale = float(expected.abs().max()) or 1.0
        assert float((ours[key] - expected).abs().max()) <= 1e-5 * scale, key


def _sft_batches(
    tokenizer: PreTrainedTokenizerBase, packs: bool
) -> dict[str, Callable[[Sequence[Any]], Any]]:
    pad = tokenizer.pad_token_id
    collates: dict[str, Callable[[Sequence[Any]], Any]] = {"padded": partial(pad_batch, pad_token_id=pad)}
    if packs:  # packing: true, and the padding-free rows of an architecture that packs without asking
        collates["packed"] = partial(pack_batch, pad_token_id=pad, max_length=256)
        collates["padding-free"] = partial(pack_batch, pad_token_id=pad, max_length=None)
    return collates


def _left_padded(rows: Sequence[Sequence[int]], pad: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", NAMES)
def test_losses_and_log_probs_equal_a_plain_forward(
    name: str, lora: bool, family_model: Callable[[str], Path]
) -> None:
    path = str(family_model(name))
    config = SFTConfig(path, "", use_lora=lora)
    tokenizer = load_tokenizer(path)  # the pad token: the tokenizer's own, else its EOS
    pad = tokenizer.pad_token_id
    torch.manual_seed(0)
    ours = load_model_to_train(config, CPU)
    arch = architecture(ours.config.model_type)
    if lora:  # adapters that change the output (peft starts B at 0), fused except on the experts
        with torch.no_grad():
            for key, p in ours.named_parameters():
                if "lora_B" in key:
                    p.normal_(0, 0.05)
        assert all(m.forward.__func__ is _fused_forward for m in ours.modules() if isinstance(m, LoraLinear))
    # the kernels the declaration gives this architecture
    assert (decoder_and_head(ours) is not None) == arch.plain_head
    assert runs_packed(ours) == (arch.plain_head and arch.packed_positions)
    layers = (ours.get_base_model() if lora else ours).get_decoder().layers
    assert all(("forward" in vars(layer)) == arch.llama_layers for layer in layers)  # activation recompute
    plain = _plain_twin(config, ours)

    # SFT: the loss of a batch and every gradient, padded and, where the architecture packs, packed
    examples = list(tokenize_sft_rows(_prompt_completions(), tokenizer, max_length=256))
    assert min(len(e.input_ids) for e in examples) > WINDOW
    padded = pad_batch(examples, pad_token_id=pad)
    expected = plain(
        input_ids=padded.input_ids,
        attention_mask=padded.attention_mask,
        labels=padded.labels,
        use_cache=False,
    ).loss
    expected.backward()
    for layout, collate in _sft_batches(tokenizer, arch.packed_positions).items():
        ours.zero_grad()
        batch = collate(examples)
        loss = sft_loss(ours, batch).loss / batch.n_targets
        loss.backward()
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-5), layout
        _assert_close_grads(_grads(ours), _grads(plain))

    # DPO: each row's summed completion log-prob, in the layout the pair methods pick for the model
    pairs = list(
        tokenize_preference_rows(_preference_pairs(), tokenizer, max_length=256, max_prompt_length=128)
    )
    layout = pair_packing(ours)
    assert layout is PairPacking.PADDED if not runs_packed(ours) else layout is not PairPacking.PADDED
    batch = collate_preferences(pairs, pad_token_id=pad, pack=layout)
    with torch.no_grad():
        got = policy_log_probs(ours, batch)
        logits = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        per_token = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        want = (per_token * batch.completion_mask[:, 1:]).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)

    # GRPO: each completion token's log-prob, two completions of each of two left-padded prompts
    prompts = [tokenizer(f"Name a color, {LONG}:").input_ids, tokenizer("Hello").input_ids]
    generator = torch.Generator().manual_seed(1)
    completions = [torch.randint(0, 500, (n,), generator=generator).tolist() for n in (9, 3, 5, 1)]
    prompt_ids, prompt_mask = _left_padded([prompts[i // 2] for i in range(4)], pad, left=True)
    completion_ids, completion_mask = _left_padded(completions, pad, left=False)
    got, _ = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)
    with torch.no_grad():
        mask = torch.cat([prompt_mask, completion_mask], 1)
        logits = plain(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),  # as generation counts them
            use_cache=False,
        ).logits[:, prompt_ids.shape[1] - 1 : -1]
        want = logits.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    real = completion_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-6, atol=1e-5)


@pytest.fixture
def varlen_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The variable-length attention kernel's path on the CPU (its sequence-by-sequence branch)."""
    monkeypatch.setattr(varlen_attention, "VARLEN_DEVICES", frozenset({"cpu", "cuda"}))
    varlen_attention.install()
    yield
    varlen_attention.uninstall()


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_packed_rows_through_the_varlen_kernel_keep_sliding_windows(
    name: str, family_model: Callable[[str], Path], varlen_on_cpu: None
) -> None:
    """The variable-length kernel attends to the whole of each sequence: a sliding-window layer's call
    (Gemma 3's local layers) takes sdpa under transformers' mask instead; a full layer keeps the kernel."""
    path = str(family_model(name))
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    examples = list(tokenize_sft_rows(_prompt_completions(), tokenizer, max_length=256))
    padded = pad_batch(examples, pad_token_id=tokenizer.pad_token_id)
    packed = pack_batch(examples, pad_token_id=tokenizer.pad_token_id, max_length=256)
    assert packed.attention_kwargs()  # the bounds reach the attention calls
    with torch.no_grad():
        want = sft_loss(model, padded).loss / padded.n_targets
        got = sft_loss(model, packed).loss / packed.n_targets
    assert float(got) == pytest.approx(float(want), abs=1e-5)


def test_soft_capped_logits_keep_the_whole_model(family_model: Callable[[str], Path]) -> None:
    """A config that soft-caps its logits (Gemma 2's final_logit_softcapping) has no plain head: SFT
    runs the whole model, and the loss is still the plain forward's."""
    path = str(family_model("gemma3"))
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, final_logit_softcapping=2.0)
    assert decoder_and_head(model) is None and not runs_packed(model)
    batch = pad_batch(
        list(tokenize_sft_rows(_prompt_completions(), tokenizer, max_length=256)), pad_token_id=0
    )
    with torch.no_grad():
        want = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
        got = sft_loss(model, batch).loss / batch.n_targets
    assert float(got) == pytest.approx(float(want), abs=1e-6)


# -- LoRA on a mixture of experts ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_lora_adapts_attention_and_experts_not_the_router(
    name: str, family_model: Callable[[str], Path]
) -> None:
    path = str(family_model(name))
    model = load_model_to_train(SFTConfig(path, ""), CPU)
    trained = {
        key.split(".layers.0.")[1].split(".lora_")[0]
        for key, p in model.named_parameters()
        if p.requires_grad and ".layers.0." in key
    }
    # peft's target_parameters wraps the experts' two fused weights: one inside the other
    assert trained == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.experts",
        "mlp.experts.base_layer",
    }
    experts = model.get_base_model().model.layers[0].mlp.experts
    n_experts = experts.base_layer.base_layer.gate_up_proj.shape[0]
    assert experts.lora_A["default"].weight.shape[0] == 8 * n_experts  # rank r per expert
    with pytest.raises(DataError) as info:  # peft applies no dropout to fused expert weights
        train_sft(SFTConfig(path, "", lora_dropout=0.1), _prompt_completions())
    assert info.value.param == "hyperparameters.lora_dropout"
    # naming the modules leaves the experts out, and dropout is then fine
    named = load_model_to_train(SFTConfig(path, "", lora_target_modules=["q_proj"], lora_dropout=0.1), CPU)
    assert not any(".experts." in key for key, p in named.named_parameters() if p.requires_grad)
