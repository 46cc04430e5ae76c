"""The CLI as a user runs it: subprocesses against live servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import Stack
from tests.helpers import chat_rows, jsonl


def th(*args: str, url: str, key: str | None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TUNEHOUSE_API_KEY", "TUNEHOUSE_BASE_URL")}
    env["TUNEHOUSE_BASE_URL"] = url
    if key:
        env["TUNEHOUSE_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "tunehouse.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_keys_create_prints_key_last_line_or_json(api_url: str) -> None:
    plain = th("keys", "create", "--tenant", "cli-plain", url=api_url, key=None)
    assert plain.returncode == 0, plain.stderr
    key = plain.stdout.strip().splitlines()[-1]
    assert key.startswith("th-")
    as_json = th("keys", "create", "--tenant", "cli-json", "--json", url=api_url, key=None)
    data = json.loads(as_json.stdout)
    assert data["tenant"] == "cli-json" and data["api_key"].startswith("th-")
    # the printed key works
    listed = th("files", "list", "--json", url=api_url, key=key)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


def test_files_and_jobs_commands(api_url: str, api_key: str, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl(chat_rows(8)))
    up = th("files", "upload", str(path), "--json", url=api_url, key=api_key)
    assert up.returncode == 0, up.stderr
    file_id = json.loads(up.stdout)["id"]
    assert file_id in th("files", "list", url=api_url, key=api_key).stdout
    assert (
        json.loads(th("files", "get", file_id, "--json", url=api_url, key=api_key).stdout)["line_count"] == 8
    )

    created = th(
        "jobs",
        "create",
        "--model",
        "tunehouse/tiny-llama",
        "--training-file",
        file_id,
        "-p",
        "n_epochs=2",
        "-p",
        "lora=false",
        "--metadata",
        "team=cli",
        "--json",
        url=api_url,
        key=api_key,
    )
    assert created.returncode == 0, created.stderr
    job = json.loads(created.stdout)
    assert job["method"]["supervised"]["hyperparameters"]["n_epochs"] == 2
    assert job["method"]["supervised"]["hyperparameters"]["lora"] is False
    assert job["id"] in th("jobs", "list", url=api_url, key=api_key).stdout
    assert "queued" in th("jobs", "get", job["id"], url=api_url, key=api_key).stdout
    assert "Validating training file" in th("jobs", "events", job["id"], url=api_url, key=api_key).stdout
    assert "cancelled" in th("jobs", "cancel", job["id"], url=api_url, key=api_key).stdout
    deleted = th("files", "delete", file_id, url=api_url, key=api_key)
    assert deleted.returncode == 0 and "deleted" in deleted.stdout


def test_user_errors_are_one_line(api_url: str, api_key: str, tmp_path: Path) -> None:
    missing = th("files", "upload", str(tmp_path / "nope.jsonl"), url=api_url, key=api_key)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "bot", "content": "x"}]}\n')
    rejected = th("files", "upload", str(bad), url=api_url, key=api_key)
    assert rejected.returncode == 1 and "Traceback" not in rejected.stderr
    assert (
        rejected.stderr.startswith("tunehouse: error 400 [file]: line 1") and "request id" in rejected.stderr
    )

    no_job = th("jobs", "get", "ftjob-missing", url=api_url, key=api_key)
    assert no_job.returncode == 1 and "error 404" in no_job.stderr and no_job.stderr.count("\n") == 1

    paused = th("jobs", "pause", "ftjob-missing", url=api_url, key=api_key)
    assert paused.returncode == 1

    no_key = th("files", "list", url=api_url, key=None)
    assert no_key.returncode == 2 and "API key" in no_key.stderr

    unreachable = th("files", "list", url="http://127.0.0.1:9", key=api_key)
    assert unreachable.returncode == 1 and "cannot reach the API" in unreachable.stderr


def test_wait_shows_progress_and_exit_codes(stack: Stack, api_key: str, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(jsonl(chat_rows(16)))
    file_id = json.loads(th("files", "upload", str(path), "--json", url=stack.url, key=api_key).stdout)["id"]
    run = th(
        "jobs",
        "create",
        "--model",
        "tunehouse/tiny-llama",
        "--training-file",
        file_id,
        "-p",
        "n_epochs=2",
        "-p",
        "batch_size=4",
        "--wait",
        url=stack.url,
        key=api_key,
    )
    assert run.returncode == 0, run.stderr
    assert "succeeded" in run.stdout
    # not a terminal: one progress line per 10% with step/total, ETA and loss
    assert "8/8 100%" in run.stderr and "ETA" in run.stderr and "loss" in run.stderr
    job_id = run.stdout.split()[0]

    ckpts = json.loads(th("checkpoints", "list", job_id, "--json", url=stack.url, key=api_key).stdout)
    final = next(c for c in ckpts if c["is_final"])
    out = tmp_path / "final.tar"
    dl = th("checkpoints", "download", job_id, final["id"], "-o", str(out), url=stack.url, key=api_key)
    assert dl.returncode == 0 and out.stat().st_size == final["bytes"]
    metrics = th("jobs", "metrics", job_id, url=stack.url, key=api_key)
    assert metrics.stdout.count("step") == 8

    # a job that fails: wait exits non-zero
    failing = th(
        "jobs",
        "create",
        "--model",
        "tunehouse/tiny-llama",
        "--training-file",
        file_id,
        "-p",
        "max_length=8",
        "--wait",
        url=stack.url,
        key=api_key,
    )
    assert failing.returncode == 1 and "failed" in failing.stdout
