"""A real Ray cluster of separate processes for the tests: a head (`ray start --head`) and worker nodes
(`ray start --address=...`), each with its own temp dir, on loopback addresses only.

Loopback only: Ray maps `127.0.0.1` (and `localhost`) to the host's outward address
(`ray._private.services.resolve_ip_for_localhost`), so `--node-ip-address=127.0.0.1` still registers a
node under eth0's address and a driver connecting to 127.0.0.1 is sent there. Other addresses of
127.0.0.0/8 are taken as given and are loopback all the same: the head is 127.0.0.2, node i is
127.0.0.(2+i), and the driver joins the head's node as 127.0.0.2 (`TUNEHOUSE_RAY_NODE_IP_ADDRESS`).
Distinct addresses also make the nodes look like distinct hosts to Ray's scheduler.
`outside_connections` lists every TCP connection of the cluster's processes that leaves 127.0.0.0/8.

Token auth (on for local clusters since Ray 2.59): the cluster's processes and the driver share
`RAY_AUTH_MODE=token` and a fresh `RAY_AUTH_TOKEN`, so nothing is written to ~/.ray.

Memory: each node gets a small object store (the job moves no objects through it) and explicit CPUs.
Stopping: every process whose command line names one of the cluster's temp dirs, and their children,
by pid (never a global `ray stop`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port

RAY = str(Path(sys.executable).parent / "ray")
HEAD_IP = "127.0.0.2"
OBJECT_STORE_BYTES = 80 * 1024 * 1024


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process (Linux /proc)."""
    found: dict[int, tuple[int, str]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        found[int(proc.name)] = (ppid, cmd)
    return found


def pids_of(mark: str) -> set[int]:
    """The processes whose command line contains `mark`, and all their descendants."""
    procs = _processes()
    roots = {pid for pid, (_, cmd) in procs.items() if mark in cmd and pid != os.getpid()}
    found, todo = set(roots), list(roots)
    while todo:
        parent = todo.pop()
        for pid, (ppid, _) in procs.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def kill(pids: set[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class RayCluster:
    root: Path
    port: int = field(default_factory=free_port)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    nodes: list[Path] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What every process of the cluster, and its driver, runs with. The GCS checks each node every
        0.5 s and calls it dead after 2 misses: a killed node's rank fails the survivor's gloo collective at
        once, and with Ray's default checks (seconds apart) the restarted job's driver could still count
        the dead node alive and not wait for a replacement (tests/ray/test_multi_node_jobs.py's killed
        node; a deployment wants its health checks faster than a job's restart, docs/ray.md)."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_health_check_period_ms": "500",
            "RAY_health_check_timeout_ms": "500",
            "RAY_health_check_failure_threshold": "2",
        }

    def _start(self, args: list[str], temp: Path) -> None:
        temp.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                RAY,
                "start",
                *args,
                f"--temp-dir={temp}",
                f"--object-store-memory={OBJECT_STORE_BYTES}",
                "--num-gpus=0",
                "--disable-usage-stats",
            ],
            env={**os.environ, **self.env},
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=120,
        )

    def start_head(self, cpus: int = 1) -> None:
        head = self.root / "head"
        self._start(
            [
                "--head",
                f"--node-ip-address={HEAD_IP}",
                f"--port={self.port}",
                f"--num-cpus={cpus}",
                "--include-dashboard=false",
            ],
            head,
        )
        self.nodes.append(head)

    def add_node(self, cpus: int = 1) -> str:
        """Start another worker node; returns its address."""
        ip = f"127.0.0.{2 + len(self.nodes)}"
        node = self.root / f"node{len(self.nodes)}"
        self._start([f"--address={self.address}", f"--node-ip-address={ip}", f"--num-cpus={cpus}"], node)
        self.nodes.append(node)
        return ip

    def kill_node(self, node: Path) -> None:
        """The node dies: its raylet and every process under it (the job's rank among them) are SIGKILLed
        at once. (Killing the raylet alone left its workers running for a while: on a quiet machine the
        job could finish its last steps before the rank noticed.)"""
        procs = _processes()
        [raylet] = [p for p, (_, cmd) in procs.items() if "raylet/raylet " in cmd and f"{node}/" in cmd]
        kill({raylet} | pids_of(f"{node}/"))

    def wait_nodes(self, alive: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(
                [RAY, "status", f"--address={self.address}"],
                env={**os.environ, **self.env},
                capture_output=True,
                text=True,
            ).stdout
            active = out.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if active.count("node_") >= alive:
                return
            time.sleep(1)
        raise TimeoutError(f"fewer than {alive} Ray nodes alive")

    def stop(self) -> None:
        doomed = pids_of(str(self.root))
        kill(doomed, signal.SIGTERM)
        time.sleep(1)
        kill(pids_of(str(self.root)))
        shutil.rmtree(self.root, ignore_errors=True)

    def outside_connections(self) -> list[str]:
        """Every TCP connection (and listener bound to one address) of the cluster's processes whose
        local or peer address is outside 127.0.0.0/8 (`ss -tanp`: all states, with the owning pid)."""
        ours = pids_of(str(self.root))
        out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True).stdout
        bad = []
        for line in out.splitlines():
            pids = {int(chunk.split(",")[0]) for chunk in line.split("pid=")[1:]}
            if not pids & ours:
                continue
            cols = line.split()
            for address in (cols[3], cols[4]):
                host = address.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
                if host in ("*", "0.0.0.0", "::"):
                    continue  # a listener on every interface: no traffic by itself
                if not ipaddress.ip_address(host).is_loopback:
                    bad.append(line)
        return bad
