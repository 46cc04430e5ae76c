"""`client.models`, `client.chat.completions` (whole and streamed, sync and async) and `tunehouse chat`
against the live stack (its inference worker generates on the tiny model)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

import tunehouse
from tests.conftest import Stack

MODEL = "tunehouse/tiny-llama"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list_and_retrieve(stack: Stack, api_key: str) -> None:
    with tunehouse.Client(base_url=stack.url, api_key=api_key) as client:
        models = client.models.list()
        tiny = next(m for m in models if m.id == MODEL)
        assert tiny.architecture == "LlamaForCausalLM" and tiny.parameters == 139_584
        assert tiny.trainable is not None and "supervised" in tiny.trainable.methods
        assert client.models.retrieve(MODEL) == tiny
        with pytest.raises(tunehouse.NotFoundError, match="did you mean 'tunehouse/tiny-llama'"):
            client.models.retrieve("tunehouse/tiny-lama")


def test_chat_whole_and_streamed(stack: Stack, api_key: str) -> None:
    with tunehouse.Client(base_url=stack.url, api_key=api_key) as client:
        whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
        chunks = list(client.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=6, temperature=0))
    assert whole.object == "chat.completion" and whole.model == MODEL
    # greedy: the streamed pieces add up to the whole reply
    assert "".join(c.text for c in chunks) == whole.text
    assert len([c for c in chunks if c.text]) > 1  # it came in pieces

    async def streamed() -> str:
        async with tunehouse.AsyncClient(base_url=stack.url, api_key=api_key) as client:
            pieces = [
                c.text
                async for c in client.chat.completions.stream(
                    model=MODEL, messages=ASK, max_tokens=6, temperature=0
                )
            ]
        return "".join(pieces)

    assert asyncio.run(streamed()) == whole.text


def test_the_chat_command_streams_the_reply(stack: Stack, api_key: str) -> None:
    env = {**os.environ, "TUNEHOUSE_BASE_URL": stack.url, "TUNEHOUSE_API_KEY": api_key}
    command = [sys.executable, "-m", "tunehouse.cli", "chat", MODEL, ASK[0]["content"], "--max-tokens", "6"]
    done = subprocess.run(
        [*command, "--temperature", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    with tunehouse.Client(base_url=stack.url, api_key=api_key) as client:
        expected = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0).text
    assert done.stdout == expected + "\n"
    unknown = subprocess.run(
        [*command[:4], "nobody/model", "hi"], env=env, capture_output=True, text=True, timeout=60
    )
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
