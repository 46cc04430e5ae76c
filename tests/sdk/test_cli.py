"""The CLI as a user runs it: subprocesses against live servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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
        "--gpus",
        "2",
        "--strategy",
        "fsdp",
        "--json",
        url=api_url,
        key=api_key,
    )
    assert created.returncode == 0, created.stderr
    job = json.loads(created.stdout)
    assert (job["resources"]["gpus"], job["resources"]["strategy"]) == (2, "fsdp")
    assert job["method"]["supervised"]["hyperparameters"]["n_epochs"] == 2
    assert job["method"]["supervised"]["hyperparameters"]["lora"] is False
    assert job["id"] in th("jobs", "list", url=api_url, key=api_key).stdout
    assert "queued" in th("jobs", "get", job["id"], url=api_url, key=api_key).stdout
    assert "Validating training file" in th("jobs", "events", job["id"], url=api_url, key=api_key).stdout
    # no worker on this server, so the job is still queued: it pauses at once
    assert "paused" in th("jobs", "pause", job["id"], url=api_url, key=api_key).stdout
    again = th("jobs", "pause", job["id"], url=api_url, key=api_key)
    assert again.returncode == 1 and "error 409" in again.stderr and "already" not in again.stderr
    assert "is paused" in again.stderr
    assert "queued" in th("jobs", "resume", job["id"], url=api_url, key=api_key).stdout
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


def test_base_url_and_api_key_flags_win_over_the_environment(api_url: str, api_key: str) -> None:
    # the environment points at nothing and holds a wrong key: only the flags can make this work
    flags = ("--base-url", api_url, "--api-key", api_key)
    listed = th("files", "list", "--json", *flags, url="http://127.0.0.1:9", key="th-wrong")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    # a wrong key given as a flag is used (and refused) even with a good key in the environment
    refused = th("files", "list", "--api-key", "th-wrong", url=api_url, key=api_key)
    assert refused.returncode == 1 and "error 401" in refused.stderr
    # a flag URL ending in /v1 (as OpenAI's clients take it) is the same server
    v1 = th("jobs", "list", "--json", "--base-url", f"{api_url}/v1", url="http://127.0.0.1:9", key=api_key)
    assert v1.returncode == 0 and json.loads(v1.stdout) == [], v1.stderr


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


def test_keys_list_revoke_and_expiry(api_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The key commands run in this process (`main([...])`, as the console script does; subprocesses
    are covered above) against the live server's database; the server is what must refuse a key."""
    from service.auth import create_api_key
    from service.config import get_settings
    from service.db import session_scope
    from tunehouse.cli import main

    tenant = f"cli-keys-{os.getpid()}"

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    def files_status(k: str) -> tuple[int, str]:
        response = httpx.get(f"{api_url}/v1/files", headers={"Authorization": f"Bearer {k}"})
        return response.status_code, response.json().get("error", {}).get("code", "")

    key = json.loads(cli("keys", "create", "--tenant", tenant, "--name", "ci", "--json")[1])["api_key"]
    hourly = cli("keys", "create", "--tenant", tenant, "--expires-in", "1h", "--json")[1]
    hourly_key = json.loads(hourly)["api_key"]
    code, _, err = cli("keys", "create", "--tenant", tenant, "--expires-in", "soon")
    assert code == 2 and "--expires-in" in err
    assert files_status(key)[0] == 200 and files_status(hourly_key)[0] == 200

    code, listed, _ = cli("keys", "list", "--tenant", tenant, "--json")
    rows = json.loads(listed)
    assert [r["status"] for r in rows] == ["active", "active"] and rows[0]["name"] == "ci"
    assert rows[0]["prefix"] == "-".join(key.split("-")[:2]) and rows[0]["expires_at"] is None
    assert 3500 < rows[1]["expires_at"] - time.time() <= 3600
    table = cli("keys", "list", "--tenant", tenant)[1]
    assert rows[0]["id"] in table and rows[0]["prefix"] in table
    for secret in (key, hourly_key):  # never a secret, in either format
        assert secret.split("-", 2)[2] not in listed + table

    # revoked by its prefix (in this process): the running server, which caches keys for
    # auth_cache_seconds, refuses the key within that time
    code, out, _ = cli("keys", "revoke", rows[0]["prefix"])
    assert code == 0 and rows[0]["id"] in out
    revoked = time.monotonic()
    while (status := files_status(key)) != (401, "invalid_api_key"):
        assert status[0] == 200, status
        assert time.monotonic() - revoked < get_settings().auth_cache_seconds + 10, "still accepted"
        time.sleep(0.2)
    code, _, err = cli("keys", "revoke", "key-doesnotexist")
    assert code == 2 and "no API key" in err

    # expiry, without waiting an hour: a key made to expire in two seconds (at least one left)
    with session_scope() as session:
        _, brief_key = create_api_key(session, tenant_name=tenant, expires_in_seconds=2)
    assert files_status(brief_key)[0] == 200
    time.sleep(2.2)
    assert files_status(brief_key) == (401, "expired_api_key")
    statuses = json.loads(cli("keys", "list", "--tenant", tenant, "--json")[1])
    assert [r["status"] for r in statuses] == ["revoked", "active", "expired"]


CLIENT_ONLY = """
import sys
# a client-only install (`pip install tunehouse`: httpx and pydantic): the server's packages are absent
for name in ("fastapi", "sqlalchemy", "alembic", "celery", "uvicorn", "pydantic_settings", "torch"):
    sys.modules[name] = None
from tunehouse.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [["up", "--no-demo"], ["keys", "list"], ["models", "add", "org/name"]])
def test_a_client_only_install_says_what_to_install(command: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT_ONLY, *command, "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "install tunehouse[server] (pip install 'tunehouse[server]')" in done.stderr, done.stderr
