"""The python grader's sandbox (trainers/rewards/sandbox.py) attacked by issue 56's probes
(tests/trainers/rewards/sandbox_probes.py): in it each is denied and nothing it started outlives the run;
without it (the operator's unsafe flag) each gets through, so a probe that could not succeed would show.
The victim is a real process holding a secret in its environment, beside the test's real PostgreSQL and
Redis, a data dir with another tenant's file and this checkout as the installation dir."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import PG_SERVER, REDIS
from tests.trainers.rewards import sandbox_probes
from tests.trainers.rewards.sandbox_probes import PROBES, lingering, run_probe
from trainers.rewards import sandbox

ROOT = Path(__file__).resolve().parents[3]
SERVICE_UID = 4242  # an unprivileged service's uid, for the run without root


def _sandboxes() -> list[int]:
    """The bubblewrap processes this test process started that are still alive (a sandbox left behind)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        state, ppid = rest.split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and name == "bwrap":
            found.append(int(entry))
    return found


def _context(data_dir: Path, marker: str) -> dict[str, Any]:
    return sandbox_probes.context(
        data_dir,
        marker,
        install_dir=ROOT,
        postgres_port=make_url(PG_SERVER).port or 5432,
        redis_port=urlsplit(REDIS).port or 6379,
    )


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    given = _context(tmp_path_factory.mktemp("data"), f"probe-{os.urandom(4).hex()}")
    victim = sandbox_probes.victim(given["secret"], given["marker"])
    shm_id, remove = sandbox_probes.shared_memory()
    yield {**given, "shm_id": shm_id}
    remove()
    victim.kill()
    victim.wait()


def test_the_host_provides_the_sandbox() -> None:
    assert sandbox.unavailable() is None


@pytest.mark.parametrize("name", list(PROBES))
def test_each_probe_is_denied_in_the_sandbox(name: str, context: dict[str, Any]) -> None:
    outcome = run_probe(name, context, sandboxed=True)
    assert outcome.startswith("denied: "), outcome
    assert _sandboxes() == [] and lingering(context) == []


def test_without_the_sandbox_the_probes_get_through(context: dict[str, Any]) -> None:
    """The operator's unsafe flag: what issue 56 found. The memory cap is an rlimit either way."""
    outcomes = {name: run_probe(name, context, sandboxed=False) for name in PROBES}
    through = {name for name, outcome in outcomes.items() if outcome.startswith("got through")}
    assert through == set(PROBES) - {"allocate 2 GB"}, outcomes


@pytest.fixture
def service_home() -> Iterator[Path]:
    """A folder the unprivileged service's uid can reach (pytest's own are under a 0700 folder of root)."""
    home = Path(tempfile.mkdtemp(prefix="tunehouse-service-"))
    home.chmod(0o755)
    yield home
    shutil.rmtree(home)


def test_an_unprivileged_service_gets_the_same_sandbox(service_home: Path) -> None:
    """Run as a uid other than root, bubblewrap builds the sandbox in a user namespace of its own (the
    other branch of sandbox.command): the probes are denied there too. The service runs from a copy of
    the stdlib-only code it needs (this checkout may sit where that uid cannot read), with the system's
    interpreter (this one lives under /root), and its files are its own uid's, as they would be."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    if python is None:
        pytest.skip("no system python3 an unprivileged uid can run")
    cached = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "trainers", service_home / "trainers", ignore=cached)
    probes = service_home / "tests" / "trainers" / "rewards" / "sandbox_probes.py"
    probes.parent.mkdir(parents=True)
    shutil.copy(sandbox_probes.__file__, probes)
    context = _context(service_home / "data", f"probe-{os.urandom(4).hex()}")
    context["install_dir"] = str(service_home)
    for path in [service_home / "data", *(service_home / "data").rglob("*")]:
        os.chown(path, SERVICE_UID, SERVICE_UID)
    (service_home / "data").chmod(0o700)
    as_service: dict[str, Any] = {"user": SERVICE_UID, "group": SERVICE_UID, "extra_groups": []}
    victim = sandbox_probes.victim(context["secret"], context["marker"], python, **as_service)
    context["shm_id"], remove = sandbox_probes.shared_memory()
    try:
        proc = subprocess.run(
            [python, "-I", str(probes), json.dumps(context)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            **as_service,
        )
    finally:
        remove()
        victim.kill()
        victim.wait()
    assert proc.returncode == 0, proc.stderr
    outcomes = json.loads(proc.stdout)
    assert all(outcome.startswith("denied: ") for outcome in outcomes.values()), outcomes
    assert "uid 65534, no capabilities" in outcomes["run as root or hold capabilities"]
    assert lingering(context) == []


def test_the_sandbox_is_refused_where_namespaces_are() -> None:
    """A host that forbids the namespaces (here: an unprivileged uid in a user namespace whose nested user
    namespaces are disabled, as a container's seccomp profile would) is told why."""
    check = "from trainers.rewards.sandbox import unavailable; print(unavailable())"
    # bubblewrap itself sets up that host: the checkout and interpreter visible, no user namespaces
    host = ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid"]
    host += ["--unshare-user", "--disable-userns", "--uid", str(SERVICE_UID), "--gid", str(SERVICE_UID)]
    proc = subprocess.run(
        [*host, "--chdir", str(ROOT), sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("bubblewrap could not build the sandbox: bwrap: "), proc.stdout


def test_a_host_without_bubblewrap_is_told_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert sandbox.unavailable() == (
        "bubblewrap is not installed (no `bwrap` on PATH; Debian: apt-get install bubblewrap)"
    )
