"""Trying models over /v1/chat/completions and /v1/completions on the real stack: the official `openai`
client against uvicorn + a Celery inference worker (its own process and queue) + Redis + PostgreSQL.

One LoRA SFT job on the tiny model gives a fine-tuned model (merged weights) and an intermediate
checkpoint (the adapter only, served as base + adapter). Answers are checked against the same greedy
decoding run here on the downloaded weights, so a worker that loaded the wrong weights (the base
without the adapter, another checkpoint) fails.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import DATA_DIR, Stack, new_key
from tests.helpers import chat_rows, upload_ok, wait_for

BASE = "tunehouse/tiny-llama"
QUESTION = [{"role": "user", "content": "What is 3 plus 3?"}]


@pytest.fixture(scope="module")
def trained(stack: Stack) -> Iterator[dict[str, Any]]:
    """A succeeded LoRA job of its own tenant: its key, model, checkpoints (4 steps, one every 2)."""
    key = new_key()
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
        job = wait_for(http, created.json()["id"])
        assert job["status"] == "succeeded", job
        checkpoints = http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        yield {"key": key, "job": job, "checkpoints": checkpoints, "http": http}


@pytest.fixture
def oai(stack: Stack, trained: dict[str, Any]) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=trained["key"], max_retries=0, timeout=120)
    yield client
    client.close()


def _reference(folder: Path, messages: list[dict[str, str]], max_tokens: int) -> str:
    """Greedy decoding of the weights in `folder` (an adapter goes on the worker's built base model)."""
    from trainers.modeling.generation import Generation, chat_prompt_ids, load_causal_lm, load_with_adapter

    if (folder / "adapter_config.json").exists():
        model, tokenizer = load_with_adapter(DATA_DIR / "models" / "tiny-llama", folder)
    else:
        model, tokenizer = load_causal_lm(folder)
    generation = Generation(tokenizer, n=1, stop=())
    prompt = chat_prompt_ids(tokenizer, messages)
    for _ in generation.run(model, prompt, max_new_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=0):
        pass
    return generation.texts[0]


def _download(trained: dict[str, Any], ckpt: dict[str, Any], dest: Path) -> Path:
    job_id = trained["job"]["id"]
    content = trained["http"].get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/content")
    assert content.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(content.content)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def test_fine_tuned_model_plain_and_streamed(
    oai: openai.OpenAI, trained: dict[str, Any], tmp_path: Path
) -> None:
    model = trained["job"]["fine_tuned_model"]
    reply = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.object == "chat.completion" and reply.model == model and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    final = next(c for c in trained["checkpoints"] if c["is_final"])
    assert choice.message.content == _reference(_download(trained, final, tmp_path / "final"), QUESTION, 8)
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(
        oai.chat.completions.create(
            model=model,
            messages=QUESTION,  # type: ignore[arg-type]
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # token by token
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_lora_checkpoint_serves_base_plus_adapter(
    oai: openai.OpenAI, trained: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = next(c for c in trained["checkpoints"] if c["step_number"] == 2)
    folder = _download(trained, ckpt, tmp_path / "step2")
    assert (folder / "adapter_config.json").exists()  # the adapter only: the worker must add the base
    expected = _reference(folder, QUESTION, 10)
    assert expected != _reference(DATA_DIR / "models" / "tiny-llama", QUESTION, 10)  # the adapter matters
    by_id = oai.chat.completions.create(model=ckpt["id"], messages=QUESTION, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert by_id.choices[0].message.content == expected and by_id.model == ckpt["id"]
    name = ckpt["fine_tuned_model_checkpoint"]
    assert name.endswith(":ckpt-step-2")
    streamed = oai.chat.completions.create(
        model=name,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_completions_n_seed_stop_and_usage(oai: openai.OpenAI) -> None:
    def ask(seed: int, **extra: Any) -> Any:
        return oai.completions.create(
            model=BASE, prompt="The cat", max_tokens=6, n=3, temperature=1.5, seed=seed, **extra
        )

    first, again, other = ask(5), ask(5), ask(6)
    assert first.object == "text_completion" and [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]  # the seed reproduces
    assert texts != [c.text for c in other.choices]
    assert first.usage is not None and first.usage.prompt_tokens > 0
    assert first.usage.completion_tokens <= 3 * 6
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)

    longest = max(texts, key=len)
    assert len(longest) >= 3, texts
    stop = longest[1:3]
    cut = ask(5, stop=[stop])
    for before, after in zip(texts, cut.choices, strict=True):
        if stop in before:
            assert after.text == before[: before.find(stop)] and after.finish_reason == "stop"
        else:
            assert after.text == before

    streamed = list(
        oai.completions.create(
            model=BASE, prompt="The cat", max_tokens=6, n=3, temperature=1.5, seed=5, stream=True
        )
    )
    joined = [
        "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    assert joined == texts


def test_a_request_beyond_the_context_is_refused_by_the_worker(stack: Stack) -> None:
    """The tiny model's context is 2048 tokens; the service lets max_tokens up to its own cap (4096) pass,
    so the worker, which alone knows the model's context, refuses: a 400 naming the param, streamed or not."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=new_key(), max_retries=0, timeout=120)
    with client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(
                    model=BASE,
                    messages=QUESTION,  # type: ignore[arg-type]
                    max_tokens=2048,
                    stream=stream,
                )
            assert caught.value.body["param"] == "max_tokens", caught.value.body  # type: ignore[index]
            assert "context of 2048 tokens" in caught.value.body["message"]  # type: ignore[index]
        # a prompt alone beyond the context names the prompt: /v1/completions' own name for it
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=BASE, prompt="The cat sat. " * 1000, max_tokens=2)
        assert caught.value.body["param"] == "prompt", caught.value.body  # type: ignore[index]


def test_another_tenants_models_are_not_found(stack: Stack, trained: dict[str, Any]) -> None:
    stranger = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=new_key(), max_retries=0)
    ckpt = trained["checkpoints"][0]
    for model in (trained["job"]["fine_tuned_model"], ckpt["id"], ckpt["fine_tuned_model_checkpoint"]):
        with pytest.raises(openai.NotFoundError) as caught:
            stranger.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
        assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        stranger.completions.create(model=ckpt["id"], prompt="hi", max_tokens=2)
    stranger.close()


def test_trying_a_model_does_not_wait_behind_training(stack: Stack, trained: dict[str, Any]) -> None:
    http: httpx.Client = trained["http"]
    train = upload_ok(http, chat_rows(16))
    hp = {"n_epochs": 100, "batch_size": 1, "lora": False}  # 1600 steps: still running when asked
    created = http.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": BASE,
            "training_file": train,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        },
    )
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    try:
        assert wait_for(http, job_id, ("running",))["status"] == "running"
        reply = http.post(
            "/v1/chat/completions", json={"model": BASE, "messages": QUESTION, "max_tokens": 3}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        assert http.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "running"
    finally:
        http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert wait_for(http, job_id)["status"] == "cancelled"


def test_a_deleted_model_no_longer_serves(oai: openai.OpenAI, trained: dict[str, Any]) -> None:
    model = trained["job"]["fine_tuned_model"]
    assert oai.models.delete(model).deleted
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]


def test_a_qlora_job_downloads_and_serves_its_merged_model(stack: Stack, tmp_path: Path) -> None:
    """`quantization: "nf4"` through the service: the job trains on the worker with its base in NF4, its
    download is a plain model (the adapter merged into the dequantized base: no quantization config),
    and /v1/chat/completions on its ft: model answers what those weights decode."""
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        hp = {"n_epochs": 1, "batch_size": 8, "learning_rate": 5e-2, "quantization": "nf4"}
        created = http.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": BASE,
                "training_file": upload_ok(http, chat_rows(16)),
                "seed": 3,
                "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
            },
        )
        assert created.status_code == 200, created.text
        assert created.json()["method"]["supervised"]["hyperparameters"]["quantization"] == "nf4"
        job = wait_for(http, created.json()["id"])
        assert job["status"] == "succeeded", job
        checkpoints = http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        final = next(c for c in checkpoints if c["is_final"])
        folder = _download({"job": job, "http": http}, final, tmp_path / "final")
    config = (folder / "config.json").read_text()
    assert "quantization_config" not in config and '"float32"' in config
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)
    with client:
        reply = client.chat.completions.create(
            model=job["fine_tuned_model"],
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
    assert reply.choices[0].message.content == _reference(folder, QUESTION, 8)
