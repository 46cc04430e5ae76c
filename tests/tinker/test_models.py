"""One system, not two: Tinker checkpoints are tunehouse models, and jobs' checkpoints load into Tinker
clients. The official `tinker` and `openai` SDKs against the real stack (uvicorn + Celery training worker
+ inference worker, tests/conftest.py `stack`) and a real Tinker host, on the tiny model.

Answers are checked against the same weights run another way (the Tinker sampler, the job's checkpoint
loaded here with peft), so a model served without its adapter, or an adapter loaded with the wrong
scale, fails.
"""

from __future__ import annotations

import gc
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import DATA_DIR, Stack, _stop, new_key
from tests.helpers import chat_rows, start_tinker_host, tenant_of, upload_ok, wait_for

tinker = pytest.importorskip("tinker")  # the dev extra pins it
from tinker import types  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # see test_sdk
os.environ["TINKER_TELEMETRY"] = "0"  # the server keeps none
BASE = "tunehouse/tiny-llama"
QUESTION = [{"role": "user", "content": "What is 3 plus 3?"}]
SEQUENCE = [5 + (7 * j) % 200 for j in range(12)]


@pytest.fixture(scope="module")
def host(stack: Stack) -> Iterator[None]:
    env = {**os.environ, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1"}
    proc = start_tinker_host(env)
    yield
    _stop(proc)
    gc.collect()  # the SDK's unclosed transports, under this module's warning filter (see test_sdk)


@pytest.fixture(scope="module")
def key() -> str:
    return new_key()


def _service(stack: Stack, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=stack.url, api_key=f"tml-{key}")


def _openai(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _logprobs(training: Any, tokens: list[int]) -> list[float]:
    out = training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return [float(v) for v in out.tolist()]


def _tokenizer() -> Any:
    from trainers.modeling.loading import load_tokenizer

    return load_tokenizer(str(DATA_DIR / "models" / "tiny-llama"))


def test_a_sampler_checkpoint_is_a_model_of_its_tenant(stack: Stack, host: None, key: str) -> None:
    from trainers.modeling.generation import chat_prompt_ids

    service = _service(stack, key)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tokenizer = _tokenizer()
    prompt = chat_prompt_ids(tokenizer, QUESTION)
    # taught to answer the question with a fixed reply, so the adapter changes the greedy answer
    reply = tokenizer("Twelve apples.")["input_ids"]
    for _ in range(8):
        training.forward_backward([_datum(prompt + reply)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("chat").result().path
    name = f"ft:{BASE}:{tenant_of(key)}:tinker:{path.removeprefix('tinker://')}"

    # the reference: greedy decoding through the Tinker sampler of the same weights
    sampler = service.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[tokenizer.eos_token_id])
    tokens = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens
    expected = tokenizer.decode(tokens, skip_special_tokens=True)

    with _openai(stack, key) as oai:
        listed = [m.id for m in oai.models.list().data]
        assert name in listed
        assert oai.models.retrieve(name).owned_by == tenant_of(key)
        answers = {}
        for model in (name, path, BASE):  # the ft: name, the tinker:// path itself, and the base
            answer = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
            answers[model] = answer.choices[0].message.content
        assert answers[name] == answers[path] == expected
        assert answers[BASE] != expected  # the adapter was on
    # another tenant neither lists nor serves it
    with _openai(stack, new_key()) as other:
        assert name not in [m.id for m in other.models.list().data]
        with pytest.raises(openai.NotFoundError):
            other.chat.completions.create(model=name, messages=QUESTION, max_tokens=2)


def test_a_saved_state_is_a_jobs_model(stack: Stack, host: None, key: str) -> None:
    """save_state gives an ft: model that a fine-tuning job, or a new Tinker client, trains further (its
    adapter merged into its base), and that loads into a client even when Redis lost its run."""
    service = _service(stack, key)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    loss = training.forward_backward([_datum(SEQUENCE)], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_state("for-a-job").result().path
    # the run's listing carries tunehouse's own fields, which the dashboard shows (SDK ignores them)
    run = httpx.get(
        f"{stack.url}/api/v1/training_runs/{training.model_id}", headers={"X-API-Key": f"tml-{key}"}
    ).json()
    assert (run["calls"], run["steps"]) == (4, 1)  # create, forward_backward, optim_step, save_state
    assert run["last_loss"] == pytest.approx(loss)
    saved = _logprobs(training, SEQUENCE)
    name = f"ft:{BASE}:{tenant_of(key)}:tinker:{path.removeprefix('tinker://')}"
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        train = upload_ok(http, chat_rows(8))
        body = {
            "model": name,
            "training_file": train,
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 8}}},
        }
        created = http.post("/v1/fine_tuning/jobs", json=body)
        assert created.status_code == 200, created.text
        job = wait_for(http, created.json()["id"])
        assert job["status"] == "succeeded", job
        assert job["fine_tuned_model"].startswith(f"ft:{BASE}:")
    # another tenant cannot train from it
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {new_key()}"}) as other:
        theirs = body | {"training_file": upload_ok(other, chat_rows(8))}
        refused = other.post("/v1/fine_tuning/jobs", json=theirs)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    # a new training client on it: its adapter merged into the base, a fresh one on top (B = 0)
    on_it = service.create_lora_training_client(base_model=name, rank=4, seed=2).result()
    assert _logprobs(on_it, SEQUENCE) == pytest.approx(saved, abs=1e-4)
    # the checkpoint outlives its run's Redis entry: it loads by its ft: name from PostgreSQL and the blobs
    import redis

    from service.tinker.channel import key as tinker_key

    with redis.Redis.from_url(os.environ["TUNEHOUSE_REDIS_URL"]) as client:
        assert client.delete(tinker_key("model", training.model_id)) == 1
    restored = service.create_training_client_from_state(name).result()
    assert restored.get_info().lora_rank == 4
    assert _logprobs(restored, SEQUENCE) == pytest.approx(saved, abs=1e-6)


@pytest.fixture(scope="module")
def job(stack: Stack, key: str) -> dict[str, Any]:
    """A succeeded LoRA job (4 steps, a checkpoint every 2: step 2 is an adapter, the final is merged)."""
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        train = upload_ok(http, chat_rows(16))
        hp = {"n_epochs": 2, "batch_size": 8, "learning_rate": 5e-2, "lora": True, "save_steps": 2}
        created = http.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": BASE,
                "training_file": train,
                "seed": 3,
                "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
            },
        )
        assert created.status_code == 200, created.text
        done = wait_for(http, created.json()["id"])
        assert done["status"] == "succeeded", done
        checkpoints = http.get(f"/v1/fine_tuning/jobs/{done['id']}/checkpoints").json()["data"]
        adapter = next(c for c in checkpoints if c["step_number"] == 2)
        content = http.get(f"/v1/fine_tuning/jobs/{done['id']}/checkpoints/{adapter['id']}/content")
        assert content.status_code == 200
    folder = DATA_DIR / f"download-{adapter['id']}"
    with tarfile.open(fileobj=io.BytesIO(content.content)) as tar:
        tar.extractall(folder, filter="data")
    return {"job": done, "adapter": adapter, "folder": folder}


def _reference_logprobs(folder: Path, tokens: list[int]) -> list[float]:
    """log p(token_t+1 | tokens_≤t) under the job's adapter on the base, computed here with peft."""
    import torch

    from trainers.modeling.generation import load_with_adapter

    model, _ = load_with_adapter(DATA_DIR / "models" / "tiny-llama", folder)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits.float()
    picked = logits.log_softmax(-1).gather(-1, torch.tensor([tokens[1:]]).unsqueeze(-1)).squeeze(-1)
    return [float(v) for v in picked[0]]


# TrainingClient.load_state still works in 0.38.0 and is served; the SDK only warns that it will go
@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_a_jobs_checkpoint_loads_into_a_training_client(
    stack: Stack, host: None, key: str, job: dict[str, Any]
) -> None:
    service = _service(stack, key)
    expected = _reference_logprobs(job["folder"], SEQUENCE)
    adapter_id = job["adapter"]["id"]  # ftckpt-...
    # a new client from the job's adapter checkpoint: its weights (alpha / r scale included)
    restored = service.create_training_client_from_state(adapter_id).result()
    assert _logprobs(restored, SEQUENCE) == pytest.approx(expected, abs=1e-4)
    assert restored.get_info().lora_rank == 8  # the job's LoRA rank
    # load_state into a client of its own (rank 8; it adapts the head too, which the job's did not)
    mine = service.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()
    mine.forward_backward([_datum(SEQUENCE)], "cross_entropy").result()
    mine.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    mine.load_state(job["adapter"]["fine_tuned_model_checkpoint"]).result()  # by its ft:...:ckpt-step-2 name
    assert _logprobs(mine, SEQUENCE) == pytest.approx(expected, abs=1e-4)
    # and it trains on from there
    mine.forward_backward([_datum(SEQUENCE)], "cross_entropy").result()
    mine.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert _logprobs(mine, SEQUENCE) != pytest.approx(expected, abs=1e-4)

    # the job's final model (merged weights): a new client on it as its base, with a fresh adapter
    final = job["job"]["fine_tuned_model"]
    on_final = service.create_training_client_from_state(final).result()
    assert on_final.get_info().model_data.model_name == final

    # what does not load answers 4xx naming the parameter
    with pytest.raises(tinker.BadRequestError, match="optimizer") as refused:
        service.create_training_client_from_state_with_optimizer(adapter_id).result()
    assert refused.value.status_code == 400
    with pytest.raises(tinker.BadRequestError, match=r"path: .* holds full weights"):
        mine.load_state(final).result()
    with pytest.raises(tinker.NotFoundError, match="path: no checkpoint"):
        mine.load_state("ftckpt-000000000000000000000000").result()
    other = _service(stack, new_key())
    with pytest.raises(tinker.NotFoundError, match="path: no checkpoint"):
        other.create_training_client_from_state(adapter_id).result()
