"""`tunehouse up`: the whole service on one machine with no servers to install.

SQLite, kombu's filesystem broker and a blob folder, all under the data dir; the API (uvicorn), one
training worker, one inference worker and one Tinker host run as child processes, beside a private
redis-server on a unix socket (tunehouse/embedded_redis.py) that the Tinker API and live streams use.
A local API key is created once and kept in the data dir; the URL and key are printed as `export`
lines (and kept in the data dir, where the CLI finds them); a demo SFT job on the bundled tiny model is
submitted and its progress printed, then the fine-tuned model is asked a question through
/v1/chat/completions, unless --no-demo.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from tunehouse.embedded_redis import find_redis_server, start_redis

# Full fine-tuning: the demo model is tiny and random, so LoRA at any sane rate barely moves it;
# 20 epochs x 8 steps take the loss from ~6.2 to well under 1 in a few seconds on a laptop CPU.
DEMO_HYPERPARAMETERS = {
    "n_epochs": 20,
    "batch_size": 8,
    "lora": False,
    "learning_rate": 3e-3,
    "warmup_ratio": 0.1,
}
DEMO_QUESTION = "What is the capital of France?"
# where a running `tunehouse up` says which URL it serves (read by the CLI; removed when it stops)
ENDPOINT_FILE = "endpoint.json"
# how long `tunehouse up` waits for its API and worker to exit before killing them
STOP_GRACE_SECONDS = 15.0


# progress bars of model loading/saving would drown the demo's own progress lines
QUIET_LIBRARIES = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


class EmbeddedError(Exception):
    pass


def export_lines(url: str, key: str) -> list[str]:
    """The shell lines README.md promises: the tunehouse SDK/CLI and the Tinker SDK (`tml-` + a key)."""
    return [
        f"export TUNEHOUSE_BASE_URL={url}",
        f"export TUNEHOUSE_API_KEY={key}",
        f"export TINKER_BASE_URL={url}",
        f"export TINKER_API_KEY=tml-{key}",
    ]


def _local_key(data_dir: Path) -> str:
    """The embedded instance's own key, created on first start and kept (mode 600) in the data dir."""
    from service.auth import create_api_key, tenant_for_key
    from service.db import session_scope

    key_file = data_dir / "local_api_key"
    with session_scope() as session:
        if key_file.exists():
            key = key_file.read_text().strip()
            if tenant_for_key(session, key) is not None:
                return key
        _, key = create_api_key(session, tenant_name="local", key_name="tunehouse up")
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    return key


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedError(f"the API process exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise EmbeddedError(f"the API did not become ready at {url} within {timeout:.0f}s")


def submit_demo(client: httpx.Client) -> str:
    demo = resources.files("trainers") / "assets" / "demo_sft.jsonl"
    upload = client.post(
        "/v1/files", files={"file": ("demo_sft.jsonl", demo.read_bytes())}, data={"purpose": "fine-tune"}
    )
    upload.raise_for_status()
    job = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": "tunehouse/tiny-llama",
            "training_file": upload.json()["id"],
            "suffix": "demo",
            "seed": 0,
            "method": {"type": "supervised", "supervised": {"hyperparameters": DEMO_HYPERPARAMETERS}},
        },
    )
    job.raise_for_status()
    return str(job.json()["id"])


Children = dict[str, subprocess.Popen[bytes]]  # by what they are: "API", "training worker", ...


def _check_children(children: Children) -> None:
    """Raise if a child process has exited: a job then waits for a worker that is gone."""
    for name, child in children.items():
        if child.poll() is not None:
            raise EmbeddedError(f"the {name} process exited with code {child.returncode}")


def watch_job(client: httpx.Client, job_id: str, started: float, children: Children) -> dict[str, Any]:
    """Print each new metric row until the job ends; returns the final job object. Raises
    EmbeddedError when one of `children` exits meanwhile."""
    after: int | None = None
    while True:
        _check_children(children)
        params = {"after": after} if after is not None else {}
        job: dict[str, Any] = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        every = max(1, (job.get("total_steps") or 20) // 20)  # about 20 lines per job
        for row in client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics", params=params).json()["data"]:
            after = row["step"]
            if row["step"] % every and row["step"] not in (1, job.get("total_steps")):
                continue
            print(
                f"  [{time.monotonic() - started:6.1f}s] step {row['step']:>3}"
                f"  loss {row.get('loss', float('nan')):.4f}"
                f"  lr {row.get('learning_rate', 0):.2e}",
                flush=True,
            )
        job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled") and after == job.get("current_step", after):
            return job
        time.sleep(0.5)


def demo_answer(client: httpx.Client, model: str) -> str:
    """Ask the fine-tuned model the demo question through the API (the inference worker answers)."""
    reply = client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": DEMO_QUESTION}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )
    if reply.status_code != 200:
        raise EmbeddedError(f"/v1/chat/completions answered {reply.status_code}: {reply.text}")
    return str(reply.json()["choices"][0]["message"]["content"]).strip()


def run_embedded(*, host: str, port: int, demo: bool, tinker: bool = True) -> int:
    started = time.monotonic()
    for name, value in QUIET_LIBRARIES.items():
        os.environ.setdefault(name, value)
    from service.config import get_settings
    from service.migrate import upgrade_head

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if not _port_free(host, port):
        print(f"tunehouse: port {port} on {host} is already in use; pass --port", file=sys.stderr)
        return 2
    upgrade_head(settings.database_url)
    key = _local_key(settings.data_dir)
    env = {**os.environ, "TUNEHOUSE_DATA_DIR": str(settings.data_dir), **QUIET_LIBRARIES}
    # the children log to files so the terminal shows the service's own lines; `tail -f` them to debug
    logs = settings.data_dir / "logs"
    logs.mkdir(exist_ok=True)
    children: Children = {}
    servers: Children = {}  # stopped after the children that use them
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if tinker:
            tinker_note = _start_redis(settings.redis_url, settings.data_dir, logs, env, servers)
        else:
            tinker_note = "Tinker API: off (--no-tinker)"
        with (
            (logs / "api.log").open("ab") as api_log,
            (logs / "worker.log").open("ab") as worker_log,
            (logs / "inference.log").open("ab") as inference_log,
            (logs / "tinker.log").open("ab") as tinker_log,
        ):
            children["API"] = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "service.app:app", "--host", host, "--port", str(port)],
                env=env,
                stdout=api_log,
                stderr=subprocess.STDOUT,
            )
            children["training worker"] = subprocess.Popen(
                [sys.executable, "-m", "tunehouse.cli", "worker", "--loglevel", "info"],
                env=env,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
            )
            # its own process, so trying a model (/v1/chat/completions) never waits behind training
            children["inference worker"] = subprocess.Popen(
                [sys.executable, "-m", "tunehouse.cli", "worker", "--inference", "--loglevel", "info"],
                env=env,
                stdout=inference_log,
                stderr=subprocess.STDOUT,
            )
            if tinker and env.get("TUNEHOUSE_REDIS_URL"):
                # the Tinker API's host: holds the training clients' adapters (worker/tinker_host.py)
                children["Tinker host"] = subprocess.Popen(
                    [sys.executable, "-m", "tunehouse.cli", "worker", "--tinker"],
                    env=env,
                    stdout=tinker_log,
                    stderr=subprocess.STDOUT,
                )
        return _serve(
            host,
            port,
            key,
            children,
            settings.data_dir,
            logs,
            demo=demo,
            started=started,
            note=tinker_note,
            redis_url=env.get("TUNEHOUSE_REDIS_URL", ""),
        )
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_children(children)
        _stop_children(servers)
        (settings.data_dir / ENDPOINT_FILE).unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start_redis(redis_url: str, data_dir: Path, logs: Path, env: dict[str, str], servers: Children) -> str:
    """Point the children at the operator's Redis (TUNEHOUSE_REDIS_URL) or a private one started here;
    returns a line saying what the Tinker API runs on."""
    if redis_url:
        env["TUNEHOUSE_REDIS_URL"] = redis_url
        return f"Tinker API: on, its hosts talk through {redis_url}"
    binary = find_redis_server()
    if binary is None:
        return (
            "Tinker API: off (it needs Redis: install tunehouse[local], which carries a redis-server, or "
            "set TUNEHOUSE_REDIS_URL)"
        )
    proc, url = start_redis(binary, data_dir, logs / "redis.log")
    servers["Redis"] = proc
    env["TUNEHOUSE_REDIS_URL"] = url
    return f"Tinker API: on, with a private redis-server at {url}"


def _wait_tinker_host(redis_url: str, children: Children, timeout: float = 180.0) -> None:
    """Until the Tinker host has announced itself in Redis (its imports take seconds): a Tinker client
    started before would be answered 503 and retry."""
    import redis

    from service.tinker.channel import key

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while not next(iter(client.scan_iter(key("host", "*"))), None):
            _check_children(children)
            if time.monotonic() > deadline:
                raise EmbeddedError(f"the Tinker host did not start within {timeout:.0f}s")
            time.sleep(0.2)
    finally:
        client.close()


def _interrupt(signum: int, _frame: object) -> None:
    # SIGTERM (systemd, docker stop, kill) gets the same orderly exit as Ctrl-C: the children are
    # stopped in `finally`, never left running as orphans that hold the port
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_children(children: Children) -> None:
    """SIGTERM every child, then wait for them together; SIGKILL what is left after STOP_GRACE_SECONDS.

    The API drains in about a second (it closes its streams); the worker may be in a job: its trainer
    dies with it (PR_SET_PDEATHSIG), and the job resumes from its latest checkpoint on the next start.
    """
    # a second Ctrl-C while we wait must not abandon the children
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve(
    host: str,
    port: int,
    key: str,
    children: Children,
    data_dir: Path,
    logs: Path,
    *,
    demo: bool,
    started: float,
    note: str,
    redis_url: str,
) -> int:
    api = children["API"]
    url = f"http://{host}:{port}"
    try:
        _wait_ready(url, api)
        # the CLI's default server while this one runs (tunehouse/cli_client.py)
        (data_dir / ENDPOINT_FILE).write_text(json.dumps({"base_url": url, "pid": os.getpid()}) + "\n")
        print(f"tunehouse is up at {url}  (data dir {data_dir}, logs in {logs})", flush=True)
        print(f"API key: {key}", flush=True)
        print(note, flush=True)
        print("for the SDK, the CLI, the openai and tinker clients in another shell:", flush=True)
        for line in export_lines(url, key):
            print(f"  {line}", flush=True)
        print(f"try: curl -H 'Authorization: Bearer {key}' {url}/v1/fine_tuning/jobs", flush=True)
        if "Tinker host" in children:
            _wait_tinker_host(redis_url, children)
            print(f"Tinker API: ready at {url}/api/v1", flush=True)
        if demo:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
                job_id = submit_demo(client)
                print(
                    f"demo: submitted SFT job {job_id} on tunehouse/tiny-llama; watching it train", flush=True
                )
                job = watch_job(client, job_id, started, children)
                print(
                    f"demo: job {job_id} {job['status']}"
                    + (f"; model {job['fine_tuned_model']}" if job.get("fine_tuned_model") else "")
                    + (f"; error: {job['error']['message']}" if job.get("error") else ""),
                    flush=True,
                )
                if job["status"] == "succeeded":
                    answer = demo_answer(client, job["fine_tuned_model"])
                    print(
                        f"demo: asked the fine-tuned model {DEMO_QUESTION!r}; it answers {answer!r}",
                        flush=True,
                    )
        print("tunehouse is running; press Ctrl-C (or send SIGTERM) to stop", flush=True)
        while all(c.poll() is None for c in children.values()):
            time.sleep(0.5)
        return 1
    except EmbeddedError as exc:
        print(f"tunehouse: {exc} (see {logs})", file=sys.stderr)
        return 1
