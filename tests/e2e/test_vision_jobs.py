"""Vision fine-tuning through the real stack (uvicorn, a training worker, an inference worker, Redis,
PostgreSQL), on the tiny Gemma 3, Idefics3 and Qwen2.5-VL bases (tests/vision_families.py) in the
operator's registry: rows with images uploaded, estimated (their image tokens counted, each image's place
in the preview), an SFT job per family and a DPO job trained, and the fine-tuned model and its base asked
about an image with the official `openai` client; a text-only model answers a 400 naming `messages`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import VISION_MODELS, Stack, new_key
from tests.helpers import upload_ok, wait_for
from tests.vision_families import FAMILIES, data_url, image_bytes, image_part, image_row

RED = data_url(image_bytes((40, 30), (220, 20, 20)))
BLUE = data_url(image_bytes((30, 44), (20, 20, 220), "JPEG"), "image/jpeg")
ROWS = [image_row(RED, "A red square."), image_row(BLUE, "A blue bar."), image_row(RED, "Red.")]


@pytest.fixture(scope="module")
def key() -> str:
    return new_key()


@pytest.fixture(scope="module")
def http(stack: Stack, key: str, vision_models: dict[str, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=180) as client:
        yield client


def _body(model: str, file_id: str, method: str = "supervised", **hp: Any) -> dict[str, Any]:
    hyperparameters = {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 2.0, **hp}
    return {
        "model": model,
        "training_file": file_id,
        "method": {"type": method, method: {"hyperparameters": hyperparameters}},
    }


@pytest.fixture(scope="module")
def fine_tuned(http: httpx.Client) -> dict[str, str]:
    """An SFT job per family on the same image rows: family -> its fine-tuned model."""
    file_id = upload_ok(http, ROWS)
    jobs = {f: http.post("/v1/fine_tuning/jobs", json=_body(VISION_MODELS[f], file_id)) for f in FAMILIES}
    models = {}
    for family, created in jobs.items():
        assert created.status_code == 200, created.text
        job = wait_for(http, created.json()["id"])
        assert job["status"] == "succeeded", job
        models[family] = job["fine_tuned_model"]
    return models


@pytest.mark.parametrize("family", FAMILIES)
def test_the_estimate_counts_the_images_and_shows_where_each_stands(http: httpx.Client, family: str) -> None:
    file_id = upload_ok(http, ROWS)
    answer = http.post("/v1/fine_tuning/jobs/estimate", json=_body(VISION_MODELS[family], file_id))
    assert answer.status_code == 200, answer.text
    estimate = answer.json()
    assert estimate["examples"] == 3 and estimate["images"]["per_epoch"] == 3
    assert estimate["images"]["tokens_per_epoch"] > 0
    first = estimate["preview"][0]
    images = [s for s in first if s.get("image") is not None]
    assert [(s["text"], s["trained"]) for s in images] == [("[image 1]", False)]
    assert images[0]["tokens"] >= estimate["images"]["tokens_per_epoch"] // 3  # its tokens, around them
    assert "".join(s["text"] for s in first if s["trained"]).lstrip().startswith("A red square.")
    assert sum(s["tokens"] for s in first) <= estimate["trained_tokens"]["per_epoch"]


def test_a_dpo_job_trains_on_pairs_with_images(http: httpx.Client) -> None:
    question = [image_part(RED), {"type": "text", "text": "Colour?"}]
    pair = {
        "input": {"messages": [{"role": "user", "content": question}]},
        "preferred_output": [{"role": "assistant", "content": "Red."}],
        "non_preferred_output": [{"role": "assistant", "content": "Blue."}],
    }
    file_id = upload_ok(http, [pair, pair])
    created = http.post("/v1/fine_tuning/jobs", json=_body(VISION_MODELS["gemma3"], file_id, "dpo"))
    assert created.status_code == 200, created.text
    job = wait_for(http, created.json()["id"])
    assert job["status"] == "succeeded", job


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fine_tuned_model_and_its_base_answer_about_an_image(
    stack: Stack, key: str, fine_tuned: dict[str, str], family: str
) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=180)
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(RED, "low")]}
    ]
    for model in (fine_tuned[family], VISION_MODELS[family]):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        # the prompt's tokens count the image's: more than the text alone makes
        assert reply.usage is not None and reply.usage.prompt_tokens > 8


def test_a_text_model_refuses_an_image_naming_messages(stack: Stack, key: str, chat_model: str) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=180)
    messages: Any = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "?"}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=chat_model, messages=messages, max_tokens=2)
    assert refused.value.body["param"] == "messages"  # type: ignore[index]
    bad: Any = [{"role": "user", "content": [image_part(data_url(b"not an image"))]}]
    with pytest.raises(openai.BadRequestError) as broken:
        client.chat.completions.create(model=VISION_MODELS["gemma3"], messages=bad, max_tokens=2)
    assert broken.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]
