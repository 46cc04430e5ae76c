"""`tunehouse up` stopped by SIGTERM (systemd, docker stop) exits and takes its API, workers, Tinker host
and private redis-server with it: no orphan keeps the port or the embedded database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import free_port


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


def test_up_stops_its_children_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEHOUSE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tunehouse.cli", "up", "--no-demo", "--port", str(port),
         "--data-dir", str(tmp_path / "data")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    children: list[int] = []
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        while not any(line.startswith("tunehouse is running") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        children = _children(proc.pid)
        # its private redis-server, the API, the training worker, the inference worker and the Tinker host
        assert len(children) == 5, children
        assert (tmp_path / "data" / "endpoint.json").exists()  # where the CLI finds this server
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - signalled
        assert proc.returncode == 0, proc.stdout.read()
        leftover = [pid for pid in children if _alive(pid)]
        assert not leftover, f"orphans after SIGTERM: {leftover}"
        assert not (tmp_path / "data" / "endpoint.json").exists()  # the CLI no longer points at it
        with httpx.Client() as client:
            try:
                client.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                raise AssertionError("the port still answers after `tunehouse up` exited")
            except httpx.ConnectError:
                pass
        print(f"\ntunehouse up: SIGTERM -> exit 0 with its API and worker stopped in {took:.1f}s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
