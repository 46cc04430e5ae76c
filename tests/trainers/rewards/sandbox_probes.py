"""A hostile tenant's python graders (issue 56): each probe's `grade` returns 1.0 when its attack got
through and raises (the OS' error) when it was denied. tests/trainers/rewards/test_sandbox.py runs them
in the sandbox, where each must be denied, and without it, where each gets through (so a probe that
cannot succeed would show). Stdlib only: it also runs as `python -I` under an unprivileged uid.

    python tests/trainers/rewards/sandbox_probes.py '<context json>' [--unsandboxed]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# a `sleep` detached from the run (its own session, its parent gone), as a daemon would leave it
_GRANDCHILD = """
import os
def grade(sample, item):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv('/usr/bin/sleep', ['sleep', item['linger']])
        os._exit(0)
    os.wait()
"""

# Each probe reads what it attacks from `item` (the test's context): the secret in another process'
# environment, the data dir and a file of another tenant there, the installation dir, the PostgreSQL and
# Redis ports, and a marker to find what it left behind.
PROBES: dict[str, str] = {
    "read /proc/*/environ of the service": """
import glob
def grade(sample, item):
    readable = []
    for path in glob.glob('/proc/[0-9]*/environ'):
        try:
            readable.append(open(path, 'rb').read())
        except OSError:
            pass
    if any(item['secret'].encode() in env for env in readable):
        return 1.0
    raise PermissionError(f"no environment holds the secret ({len(readable)} of "
                          f"{len(glob.glob('/proc/[0-9]*'))} processes' readable)")
""",
    "see the service's processes": """
import glob
def grade(sample, item):
    for path in glob.glob('/proc/[0-9]*/cmdline'):
        try:
            if item['marker'].encode() in open(path, 'rb').read():
                return 1.0
        except OSError:
            pass
    raise LookupError(f"{len(glob.glob('/proc/[0-9]*'))} processes visible, none of the service's")
""",
    "see the service's shared memory": """
def grade(sample, item):
    segments = open('/proc/sysvipc/shm').read().splitlines()[1:]
    if any(line.split()[1] == str(item['shm_id']) for line in segments):
        return 1.0
    raise LookupError(f"{len(segments)} System V shared memory segments visible, not the service's")
""",
    "list the data dir": """
import os
def grade(sample, item):
    os.listdir(item['data_dir'])
    return 1.0
""",
    "read another tenant's file": """
def grade(sample, item):
    return float(open(item['tenant_file']).read() == 'tenant B')
""",
    "connect to PostgreSQL": """
import socket
def grade(sample, item):
    socket.create_connection(('127.0.0.1', item['postgres_port']), timeout=2).close()
    return 1.0
""",
    "run a Redis command": """
import socket
def grade(sample, item):
    with socket.create_connection(('127.0.0.1', item['redis_port']), timeout=2) as sock:
        sock.sendall(b'PING\\r\\n')
        return float(sock.recv(16).startswith(b'+PONG'))
""",
    "reach a network interface": """
import socket
def grade(sample, item):
    names = [name for _, name in socket.if_nameindex()]
    if names != ['lo']:
        return 1.0
    socket.create_connection(('192.0.2.1', 80), timeout=2)  # TEST-NET-1: routed only where there is a network
    return 1.0
""",
    "read the installed packages": """
import os, sysconfig
def grade(sample, item):
    if os.listdir(sysconfig.get_paths()['purelib']):
        return 1.0
    raise FileNotFoundError('site-packages is empty')
""",
    "write into the installation dir": """
import os
def grade(sample, item):
    open(os.path.join(item['install_dir'], item['marker'] + '.written'), 'w').write('x')
    return 1.0
""",
    "write into the data dir": """
import os
def grade(sample, item):
    open(os.path.join(item['data_dir'], item['marker'] + '.written'), 'w').write('x')
    return 1.0
""",
    "write outside the temp dir": """
import os, tempfile
def grade(sample, item):
    errors = []
    for folder in ('/', '/usr', '/dev', '/var/tmp', os.path.dirname(os.__file__)):
        try:
            open(os.path.join(folder, item['marker'] + '.written'), 'w').write('x')
            return 1.0
        except OSError as exc:
            errors.append(f'{folder}: {exc.strerror}')
    open(os.path.join(tempfile.gettempdir(), 'scratch'), 'w').write('x')  # its own temp dir: allowed
    raise PermissionError('; '.join(errors))
""",
    "run as root or hold capabilities": """
def grade(sample, item):
    status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
    uids, caps = status['Uid'].split(), int(status['CapEff'], 16)
    if '0' in uids or caps:
        return 1.0
    raise PermissionError(f"uid {uids[0]}, no capabilities")
""",
    "make a user namespace": """
import ctypes, os
def grade(sample, item):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER: capabilities over a namespace of its own
        return 1.0
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
""",
    "fork 30 processes": """
import os, time
def grade(sample, item):
    children = []
    try:
        for _ in range(30):
            pid = os.fork()
            if pid == 0:
                time.sleep(1)
                os._exit(0)
            children.append(pid)
    finally:
        for pid in children:
            os.waitpid(pid, 0)
    return 1.0
""",
    # run_probe looks for the grandchild once the run is over: after its reply, and after its timeout
    "leave a detached grandchild": _GRANDCHILD + "    return 0.0\n",
    "leave a detached grandchild past the timeout": _GRANDCHILD + "    while True:\n        pass\n",
    "allocate 2 GB": """
def grade(sample, item):
    block = bytearray(2 << 30)
    return float(len(block) > 0)
""",
}


def context(
    data_dir: Path, marker: str, *, install_dir: Path, postgres_port: int, redis_port: int
) -> dict[str, Any]:
    """What the probes attack, as their `item`: a data dir holding another tenant's file (made here), the
    installation dir, the database's and Redis' ports, the secret a victim's environment holds and the
    marker of its command line (`victim`), and the `sleep` argument of what a probe leaves behind."""
    (data_dir / "blobs" / "tenant-b").mkdir(parents=True)
    (data_dir / "blobs" / "tenant-b" / "train.jsonl").write_text("tenant B")
    return {
        "secret": f"s3cret-{marker}",
        "marker": marker,
        "data_dir": str(data_dir),
        "tenant_file": str(data_dir / "blobs" / "tenant-b" / "train.jsonl"),
        "install_dir": str(install_dir),
        "postgres_port": postgres_port,
        "redis_port": redis_port,
        "linger": f"{3000 + int(marker[-4:], 16) % 1000}.25",
    }


def victim(secret: str, marker: str, python: str = sys.executable, **popen: Any) -> subprocess.Popen[bytes]:
    """A stand-in for the API or a worker: its environment holds the database password (`secret`), its
    command line `marker`."""
    env = {"TUNEHOUSE_DATABASE_URL": f"postgresql://tunehouse:{secret}@db/tunehouse"}
    return subprocess.Popen([python, "-c", "import time; time.sleep(600)", marker], env=env, **popen)


def shared_memory() -> tuple[int, Callable[[], None]]:
    """A System V shared memory segment of the service's (IPC namespaces keep them apart): its id and
    the function that removes it."""
    libc = ctypes.CDLL(None, use_errno=True)
    shm_id = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    assert shm_id >= 0, os.strerror(ctypes.get_errno())
    return shm_id, lambda: libc.shmctl(shm_id, 0, None)  # IPC_RMID


def lingering(context: dict[str, Any]) -> list[int]:
    """The pids of processes a probe left behind (found by the `sleep` argument it gave them)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read().split(b"\0")
        except OSError:
            continue
        if cmdline[:2] == [b"sleep", context["linger"].encode()]:
            found.append(int(entry))
    return found


def _clean_up(context: dict[str, Any]) -> list[str]:
    """Remove what the probes wrote and kill what they left running; what there was."""
    import signal
    import sysconfig

    left = []
    folders = (context["install_dir"], context["data_dir"], "/", "/usr", "/dev", "/var/tmp")
    for folder in (*folders, sysconfig.get_paths()["stdlib"]):
        path = os.path.join(folder, context["marker"] + ".written")
        if os.path.exists(path):
            os.remove(path)
            left.append(f"wrote {path}")
    for pid in lingering(context):
        os.kill(pid, signal.SIGKILL)
        left.append(f"left pid {pid} running")
    return left


def run_probe(name: str, context: dict[str, Any], *, sandboxed: bool, timeout: float = 3) -> str:
    """ "got through: ..." or "denied: <the grader's error>"; a file written or a process left running
    counts as through, and is removed."""
    from trainers.rewards.graders import GraderError, build_grader

    grader = build_grader(
        {"type": "python", "name": "probe", "source": PROBES[name]},
        allow_python=True,
        python_timeout=timeout,
        python_memory_mb=256,
        python_sandbox=sandboxed,
    )
    try:
        score = grader(["q"], ["a"], **{key: [value] for key, value in context.items()})
        outcome = "got through" if score == [1.0] else "denied: nothing outlived the run"
    except GraderError as exc:
        outcome = "denied: " + str(exc).removeprefix("python grader 'probe' ")
    if left := _clean_up(context):
        outcome = "got through: " + ", ".join(left)
    return outcome


if __name__ == "__main__":
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../..")))
    given = json.loads(sys.argv[1])
    sandboxed = "--unsandboxed" not in sys.argv
    print(json.dumps({name: run_probe(name, given, sandboxed=sandboxed) for name in PROBES}))
