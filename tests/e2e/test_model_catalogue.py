"""The managed catalogue of base models: `tunehouse models add` through the real `huggingface_hub`
client against a stand-in hub on loopback (tests/hub_server.py; no hub is reachable here), the files
stored once in the blob store with their sha256, `GET /v1/models` showing what the model is, and a job
training on it through the stack, whose worker fetched it from the blob store (not the hub)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import DATA_DIR, Stack
from tests.hub_server import Hub

NAME = "acme/tiny-chat"
TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    from trainers.modeling.tiny_model import build_tiny_model

    hub = Hub().start()
    hub.add(NAME, build_tiny_model(tmp_path_factory.mktemp("hub") / "tiny-chat", seed=3), token=TOKEN)
    yield hub
    hub.stop()


def models_add(hub: Hub, tmp: Path, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    # the hub client's own variables: the stand-in, no cache shared with anything, online
    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "0"}
    if token:
        env["HF_TOKEN"] = token
    command = [sys.executable, "-m", "tunehouse.cli", "models", "add", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_models_add_stores_a_hub_model_once_and_a_job_trains_on_it(
    hub: Hub, stack: Stack, stack_client: httpx.Client, tmp_path: Path
) -> None:
    gated = models_add(hub, tmp_path, NAME)
    assert gated.returncode == 2 and "Traceback" not in gated.stderr
    assert f"tunehouse: {NAME} is gated: accept its terms on the hub and set HF_TOKEN" in gated.stderr
    assert stack_client.get(f"/v1/models/{NAME}").status_code == 404  # nothing half-added

    added = models_add(hub, tmp_path, NAME, token=TOKEN)
    assert added.returncode == 0, added.stderr
    commit = hub.repos[NAME].commit
    assert f"added {NAME} at revision {commit} (6 files" in added.stdout
    assert set(hub.downloads.values()) == {1}  # each file fetched from the hub once
    # stored once, under its pinned revision, each file with its sha256
    model = stack_client.get(f"/v1/models/{NAME}").json()
    stored = DATA_DIR / "blobs" / "base-models" / NAME / commit
    for path in sorted(hub.repos[NAME].folder.iterdir()):
        assert (
            hashlib.sha256((stored / path.name).read_bytes()).digest()
            == hashlib.sha256(path.read_bytes()).digest()
        )
    assert {k: model[k] for k in ("architecture", "parameters", "context_length", "modalities")} == {
        "architecture": "LlamaForCausalLM",
        "parameters": 139_584,
        "context_length": 2048,
        "modalities": ["text"],
    }
    assert (model["revision"], model["source"], model["owned_by"]) == (commit, NAME, "operator")
    assert model["chat_template"] == (hub.repos[NAME].folder / "chat_template.jinja").read_text()
    assert "grpo" in model["trainable"]["methods"] and model["trainable"]["quantization"] == ["nf4", "int8"]

    again = models_add(hub, tmp_path, NAME, token=TOKEN)
    assert f"{NAME} is already in the catalogue at {commit}" in again.stdout
    assert set(hub.downloads.values()) == {1}

    # a job on it: the worker fetches the model from the blob store into its host's cache
    demo = Path("trainers/assets/demo_sft.jsonl").read_bytes()
    upload = stack_client.post("/v1/files", files={"file": ("d.jsonl", demo)}, data={"purpose": "fine-tune"})
    body = {
        "model": NAME,
        "training_file": upload.json()["id"],
        "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 8}}},
    }
    job = stack_client.post("/v1/fine_tuning/jobs", json=body).json()
    deadline = time.monotonic() + 240
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(1)
        job = stack_client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    assert job["status"] == "succeeded", job["error"]
    assert job["fine_tuned_model"].startswith(f"ft:{NAME}:")
    cached = DATA_DIR / "models" / "base" / f"acme--tiny-chat@{commit[:16]}"
    assert (cached / ".complete").read_text().strip() == commit
    assert set(hub.downloads.values()) == {1}  # the worker read the blob store, not the hub


def test_a_local_folder_is_added_under_its_name_and_names_are_checked(
    hub: Hub, stack_client: httpx.Client, tmp_path: Path
) -> None:
    folder = hub.repos[NAME].folder
    added = models_add(hub, tmp_path, str(folder), "--name", "local-tiny", "--json")
    assert added.returncode == 0, added.stderr
    assert stack_client.get("/v1/models/local-tiny").json()["source"] == str(folder)
    bad = models_add(hub, tmp_path, str(folder), "--name", "ft:nope")
    assert bad.returncode == 2 and "'ft:nope' cannot name a base model" in bad.stderr
    missing = models_add(hub, tmp_path, "nobody/nothing")
    assert missing.returncode == 2 and "no model 'nobody/nothing' on the hub" in missing.stderr
