"""Adapter host states as peft folders and back (trainers/families/adapter_files.py), in process on the
tiny model: an exported client serves exactly what the client computes, and a job-shaped adapter
(alpha != r, a subset of modules, full module names) loads into a client computing exactly what peft
computes with it."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, TaskType, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers.families.adapter_files import read_adapter_folder, write_adapter_folder
from trainers.families.adapter_host import Adam, AdapterHost, AdapterSpec, HostError

TOKENS = [5, 9, 13, 17, 21, 25, 29, 33]
DATUM = (TOKENS[:-1], {"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})


@pytest.fixture(scope="module")
def host(tiny_model_path: Path) -> Iterator[AdapterHost]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # test_adapter_host.py says why
    yield AdapterHost(str(tiny_model_path))
    torch.set_num_threads(threads)


def _client_logprobs(host: AdapterHost, name: str) -> list[float]:
    outputs, _ = host.forward_backward(name, [DATUM], loss_fn="cross_entropy", config={}, forward_only=True)
    return outputs[0]["logprobs"]


@torch.no_grad()
def _model_logprobs(model: torch.nn.Module) -> list[float]:
    logits = model(input_ids=torch.tensor([DATUM[0]])).logits.float()
    picked = logits.log_softmax(-1).gather(-1, torch.tensor([TOKENS[1:]]).unsqueeze(-1)).squeeze(-1)
    return [float(v) for v in picked[0]]


def test_an_exported_client_serves_what_the_client_computes(
    host: AdapterHost, tiny_model_path: Path, tmp_path: Path
) -> None:
    from trainers.modeling.generation import load_with_adapter

    host.create("export-a", AdapterSpec(rank=4, seed=0))
    for _ in range(3):
        host.forward_backward("export-a", [DATUM], loss_fn="cross_entropy", config={})
        host.optim_step("export-a", Adam(learning_rate=5e-2))
    state = host.state("export-a", optimizer=False)
    write_adapter_folder(tmp_path, state)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    # what inference does with it (the adapter merged into the base)
    served, _ = load_with_adapter(tiny_model_path, tmp_path)
    expected = _client_logprobs(host, "export-a")
    assert _model_logprobs(served) == pytest.approx(expected, abs=1e-5)
    assert _model_logprobs(served) != pytest.approx(_model_logprobs(_base(tiny_model_path)), abs=1e-3)
    # and back: the same shape (the seed drew the initial weights; it is not kept) and weights
    again = read_adapter_folder(tmp_path)
    assert again["spec"] == state["spec"] | {"seed": None}
    assert all(torch.equal(again["weights"][k], v) for k, v in state["weights"].items())


def _base(path: Path) -> torch.nn.Module:
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model


def _job_adapter(path: Path, folder: Path, **config: object) -> torch.nn.Module:
    """A peft adapter as a job saves it (random B, so that it changes the model), and the peft model."""
    torch.manual_seed(0)
    lora = LoraConfig(task_type=TaskType.CAUSAL_LM, init_lora_weights=False, **config)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        # peft reads `model.is_gradient_checkpointing`, which transformers 5 deprecates (adapter_host.py)
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(_base(path), lora)
    model.save_pretrained(str(folder), save_embedding_layers=False)
    return model


def test_a_jobs_adapter_loads_with_its_scale_and_modules(
    host: AdapterHost, tiny_model_path: Path, tmp_path: Path
) -> None:
    peft_model = _job_adapter(
        tiny_model_path, tmp_path, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]
    )
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["lora_alpha"] != config["r"]
    state = read_adapter_folder(tmp_path)
    assert state["spec"] == AdapterSpec(rank=4, train_mlp=False, train_unembed=False).__dict__
    expected = _model_logprobs(peft_model)
    # a new client from it, and an existing one with more modules (its head's adapter must not count)
    host.load_state("job-new", state, optimizer=False)
    assert _client_logprobs(host, "job-new") == pytest.approx(expected, abs=1e-5)
    host.create("job-into", AdapterSpec(rank=4, seed=3))
    for _ in range(2):
        host.forward_backward("job-into", [DATUM], loss_fn="cross_entropy", config={})
        host.optim_step("job-into", Adam(learning_rate=5e-2))
    host.load_state("job-into", state, optimizer=False)
    assert _client_logprobs(host, "job-into") == pytest.approx(expected, abs=1e-5)
    # a client of another rank cannot hold it
    host.create("job-rank-8", AdapterSpec(rank=8))
    with pytest.raises(HostError, match="path: the state's LoRA"):
        host.load_state("job-rank-8", state, optimizer=False)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, "not DoRA"),
        ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 4, "target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ],
)
def test_what_a_client_cannot_hold_is_refused(
    tiny_model_path: Path, tmp_path: Path, config: dict[str, object], refusal: str
) -> None:
    _job_adapter(tiny_model_path, tmp_path, **config)
    with pytest.raises(HostError, match=f"path: .*{refusal}"):
        read_adapter_folder(tmp_path)


def test_full_weights_are_not_an_adapter(tiny_model_path: Path) -> None:
    with pytest.raises(HostError, match="path: this checkpoint holds full weights"):
        read_adapter_folder(tiny_model_path)
