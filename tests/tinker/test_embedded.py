"""A plain `make run` is the whole product: the official `tinker` SDK trains through it with nothing else
started (its private redis-server and Tinker host come with `tunehouse up`), configured by the very
`export` lines it prints; and the CLI, given no URL, follows the server it started on a non-default port
(its model list, and a reply streamed through the inference worker over that Redis). Last, SIGTERM
(systemd, docker stop) to its `tunehouse up` stops it with every process it started: no orphan keeps the
port or the embedded database. (One stack for the three: each start costs a minute of a busy CI box.)
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

tinker = pytest.importorskip("tinker")  # the dev extra pins it
from tinker import types  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
REPO = Path(__file__).resolve().parents[2]


@dataclass
class MadeRun:
    exported: dict[str, str]  # the variables it printed to export
    data: Path  # its data dir
    port: int
    make: subprocess.Popen[str]  # `make`, whose child is `tunehouse up`


@pytest.fixture(scope="module")
def made_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MadeRun]:
    """`make run ARGS="--no-demo --port P --data-dir D"` in the repository (its venv already installed)."""
    data = tmp_path_factory.mktemp("made-run") / "data"
    port = free_port()
    # no TUNEHOUSE_* of the test session: the embedded default as a newcomer has it; one torch thread
    # per process on a busy 2-core machine
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNEHOUSE_", "TINKER_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        ["make", "-s", "run", f"ARGS=--no-demo --port {port} --data-dir {data}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("tunehouse is running") for line in lines):
            line = proc.stdout.readline()
            assert (line or proc.poll() is None) and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        exported = dict(re.findall(r"^\s+export (\w+)=(\S+)$", "".join(lines), re.MULTILINE))
        yield MadeRun(exported, data, port, proc)
    finally:
        if proc.poll() is None:  # (the last test stops it itself)
            os.killpg(proc.pid, signal.SIGINT)  # make and `tunehouse up` below it, as Ctrl-C would
            proc.wait(timeout=60)
        proc.stdout.close()


def test_the_tinker_sdk_trains_through_a_plain_make_run(made_run: MadeRun) -> None:
    exported = made_run.exported
    assert set(exported) == {"TUNEHOUSE_BASE_URL", "TUNEHOUSE_API_KEY", "TINKER_BASE_URL", "TINKER_API_KEY"}
    assert exported["TINKER_API_KEY"] == "tml-" + exported["TUNEHOUSE_API_KEY"]
    os.environ["TINKER_TELEMETRY"] = "0"
    service = tinker.ServiceClient(base_url=exported["TINKER_BASE_URL"], api_key=exported["TINKER_API_KEY"])
    training = service.create_lora_training_client(base_model="tunehouse/tiny-llama", rank=4, seed=0).result()
    tokens = [5 + 3 * j for j in range(12)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    losses = []
    for _ in range(4):
        out = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0], losses
    # the SDK's one-off start-up connection pool (tests/tinker/test_sdk.py says why): collected here,
    # under this module's warning filter, not during whichever test runs next
    del service, training
    gc.collect()


def test_the_cli_follows_the_server_make_run_started(made_run: MadeRun) -> None:
    exported, data = made_run.exported, made_run.data
    assert not exported["TUNEHOUSE_BASE_URL"].endswith(":8000")  # not the CLI's default port
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEHOUSE_")}
    env["TUNEHOUSE_DATA_DIR"] = str(data)  # no URL, no key: both come from the running `up`
    listed = subprocess.run(
        [sys.executable, "-m", "tunehouse.cli", "models", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert "tunehouse/tiny-llama  LlamaForCausalLM  0.1M params  context 2048  text" in listed.stdout
    # a streamed reply through the inference worker, over the private Redis' unix socket
    chat = subprocess.run(
        [sys.executable, "-m", "tunehouse.cli", "chat", "tunehouse/tiny-llama", "Hi", "--max-tokens", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert chat.returncode == 0 and chat.stdout.endswith("\n") and chat.stdout.strip(), chat.stderr


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (reaped by init once its parent is gone)
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1][0] != "Z"


def test_up_stops_its_children_on_sigterm(made_run: MadeRun) -> None:
    """Runs last in this module: it stops the stack."""
    (up,) = _children(made_run.make.pid)  # make runs a plain recipe line without a shell
    children = _children(up)
    # its private redis-server, the API, the training worker, the inference worker and the Tinker host
    assert len(children) == 5, children
    assert (made_run.data / "endpoint.json").exists()  # where the CLI finds this server
    assert httpx.get(f"http://127.0.0.1:{made_run.port}/healthz").status_code == 200

    signalled = time.monotonic()
    os.kill(up, signal.SIGTERM)
    made_run.make.wait(timeout=60)
    took = time.monotonic() - signalled
    assert made_run.make.returncode == 0  # make exits with `tunehouse up`'s status
    try:
        leftover = [pid for pid in children if _alive(pid)]
        assert not leftover, f"orphans after SIGTERM: {leftover}"
        assert not (made_run.data / "endpoint.json").exists()  # the CLI no longer points at it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{made_run.port}/healthz", timeout=2)
        print(f"\ntunehouse up: SIGTERM -> exit 0 with every child stopped in {took:.1f}s")
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
