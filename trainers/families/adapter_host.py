"""One loaded base model and many named LoRA adapters on it, each with its own optimizer: the torch side
of the training-primitives (Tinker) API, and the piece a shared-base process for jobs can reuse.

An adapter is a training client: `forward_backward` runs the base with only that adapter active,
computes one of the built-in losses (trainers/losses/primitives.py) per datum, and accumulates gradients
into that adapter's weights alone (an inactive adapter's parameters take no part in the graph, so its
pending gradients wait untouched for its own `optim_step`); `optim_step` applies AdamW with the
parameters of that call and clears them. `state` / `load_state` carry the adapter's weights and its
optimizer's moments and step, exactly. Sampling runs an adapter (or a frozen snapshot of one, or the base
alone) token by token with a KV cache.

The host does no I/O and no scheduling: the caller (worker/tinker_host.py) feeds it one call at a time.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from trainers.losses.primitives import LOSSES
from trainers.modeling.generation import KV_CACHE, pick_next

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


class HostError(ValueError):
    """A call the host cannot serve as asked (the client's fault): unknown adapter, bad inputs."""


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def modules(self) -> list[str]:
        names = list(ATTENTION if self.train_attn else ()) + list(MLP if self.train_mlp else ())
        return names + list(UNEMBED if self.train_unembed else ())


def lora_config(spec: AdapterSpec) -> LoraConfig:
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.rank,  # Tinker scales a LoRA by 1 (alpha = r): the learning rate sets the step
        lora_dropout=0.0,
        target_modules=spec.modules(),
    )


@dataclass(frozen=True)
class Adam:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class _Adapter:
    spec: AdapterSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    steps: int = 0


class AdapterHost:
    """A base model (loaded once, frozen) and named LoRA adapters with their optimizers."""

    def __init__(self, base_path: str, *, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        self.vocab_size = int(base.config.vocab_size)
        # the longest sequence the base takes: a sample's prompt plus max_tokens must fit in it
        self.context = int(getattr(base.config, "max_position_embeddings", 0) or 2048)
        self.base: torch.nn.Module = torch.nn.Module.to(base, self.device)
        self.base.requires_grad_(False)
        self.model: PeftModel | None = None
        self.adapters: dict[str, _Adapter] = {}
        self.snapshots: set[str] = set()  # frozen adapters for sampling only

    # --- adapters -------------------------------------------------------------------------------------

    def _add(self, name: str, spec: AdapterSpec) -> None:
        config = lora_config(spec)
        if self.model is not None and name in self.model.peft_config:
            return  # the last adapter removed stays in peft (remove says why): reused, its weights to be set
        if spec.seed is not None:
            torch.manual_seed(spec.seed)
        with warnings.catch_warnings():
            # peft reads `model.is_gradient_checkpointing`, which transformers 5 deprecates
            warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing", category=FutureWarning)
            if self.model is None:
                model = get_peft_model(self.base, config, adapter_name=name)
                assert isinstance(model, PeftModel)
                self.model = model
            else:
                self.model.add_adapter(name, config)

    def _peft(self) -> PeftModel:
        if self.model is None:
            raise HostError("no adapter on this host yet")
        return self.model

    def create(self, name: str, spec: AdapterSpec) -> None:
        if name in self.adapters:
            raise HostError(f"adapter '{name}' exists")
        self._add(name, spec)
        params = [p for n, p in self._peft().named_parameters() if f".{name}." in n and "lora_" in n]
        for p in params:
            p.requires_grad_(True)
        self.adapters[name] = _Adapter(spec, params, torch.optim.AdamW(params, lr=0.0))

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.snapshots.discard(name)
        # peft cannot delete its last adapter: that one stays loaded, unused, until another is added
        if self.model is not None and name in self.model.peft_config and len(self.model.peft_config) > 1:
            self.model.delete_adapter(name)

    def _check_ids(self, ids: Sequence[int], where: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise HostError(f"{where}: token ids are 0 to {self.vocab_size - 1} for this base model")

    def has_pending_gradients(self, name: str) -> bool:
        """Whether a forward_backward of this adapter waits for its optim_step."""
        return any(p.grad is not None for p in self._adapter(name).params)

    def _adapter(self, name: str) -> _Adapter:
        found = self.adapters.get(name)
        if found is None:
            raise HostError(f"no training client '{name}' on this host")
        return found

    def _activate(self, name: str) -> PeftModel:
        model = self._peft()
        model.set_adapter(name)
        if name in self.adapters:  # set_adapter may flip requires_grad; this adapter trains, snapshots don't
            for p in self.adapters[name].params:
                p.requires_grad_(True)
        return model

    # --- training -------------------------------------------------------------------------------------

    def _logprobs(
        self, model: torch.nn.Module, tokens: list[list[int]], targets: list[list[int]]
    ) -> list[torch.Tensor]:
        """Per datum [T]: log p(target_t | tokens_≤t), one padded batch through the model."""
        width = max(len(t) for t in tokens)
        ids = torch.zeros((len(tokens), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        tgt = torch.zeros_like(ids)
        for row, (toks, tg) in enumerate(zip(tokens, targets, strict=True)):
            ids[row, : len(toks)] = torch.tensor(toks)
            tgt[row, : len(tg)] = torch.tensor(tg)
            mask[row, : len(toks)] = 1
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        picked = logits.log_softmax(dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        return [picked[row, : len(toks)] for row, toks in enumerate(tokens)]

    def forward_backward(
        self,
        name: str,
        data: Sequence[tuple[list[int], dict[str, list[float] | list[int]]]],
        *,
        loss_fn: str,
        config: dict[str, float],
        forward_only: bool = False,
    ) -> tuple[list[dict[str, list[float]]], dict[str, float]]:
        """Per-datum outputs (`logprobs`: the target tokens' log-probabilities) and metrics (`loss:sum`).
        Gradients of the summed loss accumulate in the adapter until its `optim_step`."""
        if loss_fn not in LOSSES:
            raise HostError(f"loss_fn '{loss_fn}' is not a built-in loss ({', '.join(LOSSES)})")
        if not data:
            raise HostError("data: at least one datum")
        fn, needed = LOSSES[loss_fn]
        tokens, targets, inputs = [], [], []
        for index, (toks, raw) in enumerate(data):
            target = raw.get("target_tokens")
            if target is None or len(target) != len(toks) or not toks:
                raise HostError(f"data[{index}].loss_fn_inputs.target_tokens: one per input token")
            self._check_ids(toks, f"data[{index}].model_input")
            self._check_ids([int(t) for t in target], f"data[{index}].loss_fn_inputs.target_tokens")
            tensors = {}
            for key in needed:
                if key not in raw or len(raw[key]) != len(toks):
                    raise HostError(f"data[{index}].loss_fn_inputs.{key}: one value per input token")
                tensors[key] = torch.tensor(raw[key], dtype=torch.float32, device=self.device)
            tokens.append(list(toks))
            targets.append([int(t) for t in target])
            inputs.append(tensors)
        self._adapter(name)
        model = self._activate(name)
        with torch.set_grad_enabled(not forward_only):
            logprobs = self._logprobs(model, tokens, targets)
            total = torch.stack([fn(lp, inp, config) for lp, inp in zip(logprobs, inputs, strict=True)]).sum()
            if not forward_only:
                total.backward()  # type: ignore[no-untyped-call]
        outputs = [{"logprobs": lp.detach().cpu().tolist()} for lp in logprobs]
        return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, name: str, adam: Adam) -> dict[str, float]:
        adapter = self._adapter(name)
        for group in adapter.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        metrics: dict[str, float] = {}
        if adam.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(adapter.params, adam.grad_clip_norm)
            metrics["grad_norm"] = float(norm)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return metrics

    # --- state ----------------------------------------------------------------------------------------

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's weights, under names free of the adapter's own name (peft's file layout)."""
        return {
            k: v.detach().clone()
            for k, v in get_peft_model_state_dict(
                self._peft(), adapter_name=name, save_embedding_layers=False
            ).items()
        }

    def state(self, name: str, *, optimizer: bool = True) -> dict[str, Any]:
        adapter = self._adapter(name)
        out: dict[str, Any] = {
            "spec": adapter.spec.__dict__,
            "weights": self.weights(name),
            "steps": adapter.steps,
        }
        if optimizer:
            out["optimizer"] = copy.deepcopy(adapter.optimizer.state_dict())
        return out

    def load_state(self, name: str, state: dict[str, Any], *, optimizer: bool) -> None:
        """Into an adapter of this name (created from the state's spec when missing)."""
        spec = AdapterSpec(**state["spec"])
        if name not in self.adapters:
            self.create(name, spec)
        adapter = self._adapter(name)
        if spec.rank != adapter.spec.rank or not set(spec.modules()) <= set(adapter.spec.modules()):
            raise HostError(
                f"path: the state's LoRA (rank {spec.rank}, {', '.join(spec.modules())}) does not fit this "
                f"client's (rank {adapter.spec.rank}, {', '.join(adapter.spec.modules())})"
            )
        # a state may adapt fewer modules than the client (a job's adapter): the others add nothing
        for n, p in self._peft().named_parameters():
            if f".{name}." in n and "lora_B" in n:
                p.data.zero_()
        set_peft_model_state_dict(self._peft(), state["weights"], adapter_name=name)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer and "optimizer" in state:
            adapter.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            adapter.steps = int(state.get("steps", 0))
        else:
            adapter.optimizer = torch.optim.AdamW(adapter.params, lr=0.0)
            adapter.steps = 0

    def snapshot(self, name: str, weights: dict[str, torch.Tensor], spec: dict[str, Any]) -> None:
        """A frozen adapter `name` for sampling (saved sampler weights), replacing one of that name."""
        if name in self.snapshots:
            self.remove(name)
        self._add(name, AdapterSpec(**spec))
        set_peft_model_state_dict(self._peft(), weights, adapter_name=name)
        for n, p in self._peft().named_parameters():
            if f".{name}." in n:
                p.requires_grad_(False)
        self.snapshots.add(name)

    # --- sampling -------------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self,
        adapter: str | None,
        prompt: list[int],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_tokens: set[int],
        seed: int | None,
        stops_at: Callable[[list[int]], bool] | None = None,
        top_k: int = 0,
    ) -> list[Sampled]:
        """`num_samples` continuations of `prompt`; each token's log-probability is the model's own
        (before temperature), what importance sampling needs. A stop token ends a sequence and is kept;
        so does `stops_at(tokens so far)` turning true (stop strings, which need the tokenizer)."""
        if not prompt:
            raise HostError("prompt: at least one token")
        self._check_ids(prompt, "prompt")
        with self._policy(adapter) as model:
            return self._decode(
                model, prompt, num_samples, max_tokens, temperature, top_p, top_k, stop_tokens, seed, stops_at
            )

    @contextmanager
    def _policy(self, adapter: str | None) -> Iterator[torch.nn.Module]:
        """The model as `adapter` makes it: the base alone (None), or with that adapter on."""
        if adapter is None:
            if self.model is None:
                yield self.base
            else:
                with self.model.disable_adapter():
                    yield self.model
            return
        if adapter not in self.adapters and adapter not in self.snapshots:
            raise HostError(f"no weights '{adapter}' on this host")
        yield self._activate(adapter)

    @torch.no_grad()
    def prompt_logprobs(
        self, adapter: str | None, prompt: list[int], *, top: int = 0
    ) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
        """log p(prompt_t | prompt_<t) for each position, NaN at position 0 (nothing precedes it); and with
        `top` > 0 the `top` most likely tokens at each position with their log-probabilities, position 0
        filled with the SDK's "none" sentinel (token 0, log-prob -99999)."""
        with self._policy(adapter) as model:
            logits = model(input_ids=torch.tensor([prompt], device=self.device), use_cache=False).logits
            table = logits.float().log_softmax(dim=-1)[0]
        scored = table[:-1].gather(-1, torch.tensor(prompt[1:], device=self.device).unsqueeze(-1)).squeeze(-1)
        ranked = None
        if top > 0:
            values, ids = table[:-1].topk(min(top, self.vocab_size), dim=-1)
            none = [(0, -99999.0)] * values.shape[-1]
            ranked = [none] + [
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        return [float("nan"), *scored.tolist()], ranked

    def _decode(
        self,
        model: torch.nn.Module,
        prompt: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_tokens: set[int],
        seed: int | None,
        stops_at: Callable[[list[int]], bool] | None,
    ) -> list[Sampled]:
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        out = [Sampled([], [], "length") for _ in range(n)]
        done = [False] * n
        step_input = torch.tensor([prompt] * n, dtype=torch.long, device=self.device)
        past: Any = None
        for _ in range(max_tokens):
            result = model(input_ids=step_input, use_cache=True, logits_to_keep=1, **{KV_CACHE: past})
            past = getattr(result, KV_CACHE)
            logits = result.logits[:, -1, :].float()
            picked = pick_next(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
            logprobs = logits.log_softmax(dim=-1).gather(-1, picked.unsqueeze(-1)).squeeze(-1)
            for row, (token, logprob) in enumerate(zip(picked.tolist(), logprobs.tolist(), strict=True)):
                if done[row]:
                    continue
                out[row].tokens.append(int(token))
                out[row].logprobs.append(float(logprob))
                if int(token) in stop_tokens or (stops_at is not None and stops_at(out[row].tokens)):
                    out[row].stop_reason, done[row] = "stop", True
            if all(done):
                break
            step_input = picked.unsqueeze(1)
        return out
