"""The operating-system sandbox a ``python`` grader's tenant code runs in: bubblewrap, as Flatpak uses it.

Why bubblewrap (``bwrap``, Debian package ``bubblewrap``): it is the sandbox Flatpak runs every desktop
app in, kept by the containers project, packaged by every distribution, and it does one thing: build
namespaces and a filesystem view from its command line, then run a command there. nsjail does the same
from a config file but is not packaged by Debian 12 (it would be built from source); namespaces and
mounts made by hand would be a sandbox of our own, which is what a sandbox must not be.

The policy is data, declared once (``POLICY``, and the per-run ``Limits``); ``command`` turns it into
bubblewrap's (and util-linux ``setpriv``'s) argv, ``limits_json`` into the rlimits the runner sets
before the tenant's code runs. What a run gets:

- its own PID, network, IPC, UTS and cgroup namespaces: no other process visible (``/proc`` is its own),
  no network interface but a loopback nobody listens on;
- a filesystem of the read-only runtime only (``/usr`` and the interpreter's own prefix, its
  ``site-packages`` covered by an empty folder) plus a private ``/tmp`` of ``tmp_mb``, the only place it
  can write; no data dir, no installation dir, no ``/etc``, no home, an empty environment;
- uid/gid 65534 (nobody) with no capabilities and ``no_new_privs``, in a user namespace of its own in
  which no further user namespace can be made. As root, bubblewrap builds the other namespaces and the
  mounts, ``setpriv`` (util-linux) drops to uid 65534 on the host and a second, unprivileged bubblewrap
  adds the user namespace; as any other user, one unprivileged bubblewrap does it all (the service's
  uid on the host, 65534 inside);
- rlimits: ``processes`` (threads count) in its user namespace, and per process ``memory_mb`` of
  address space, the run's seconds of CPU, ``open_files``, files of at most ``tmp_mb``, no core files;
- ``--die-with-parent`` and a PID namespace: when the run ends (its reply, a crash, or the caller
  killing bubblewrap at the timeout) the namespace's init exits and the kernel kills every process left
  in it, a detached (``setsid``, double-forked) one included.

``unavailable()`` says why this host cannot provide it (no ``bwrap``, namespaces refused), or None; the
API and the workers refuse to start with python graders enabled when it is not None
(``service.graders.service.require_python_grader_sandbox``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "POLICY",
    "Limits",
    "Policy",
    "SandboxUnavailable",
    "command",
    "interpreter",
    "limits_json",
    "unavailable",
]


class SandboxUnavailable(RuntimeError):
    """bubblewrap could not build the sandbox (a fault of the host, not of the tenant's code)."""


@dataclass(frozen=True)
class Policy:
    """What tenant code may see and do; everything not granted here is absent or denied."""

    uid: int
    gid: int
    namespaces: tuple[str, ...]  # bwrap --unshare-<name>, and a user namespace of its own (`command`)
    runtime: tuple[str, ...]  # bound read-only at the same path (what the interpreter needs)
    hidden: tuple[str, ...]  # folders under the runtime covered by an empty read-only tmpfs
    tmp: str  # the private temp dir: the working directory and the only writable place
    tmp_mb: int
    processes: int  # RLIMIT_NPROC: processes and threads of the sandbox's uid in its user namespace
    open_files: int


def _interpreter_runtime() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The folders the base interpreter runs from, and its site-packages (hidden: the service's deps and,
    in the image, the editable install pointing at the installation dir)."""
    prefixes = {os.path.realpath(p) for p in ("/usr", sys.base_prefix, sys.base_exec_prefix)}
    runtime = tuple(sorted(p for p in prefixes if p == "/usr" or not p.startswith("/usr/")))
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    hidden = {os.path.realpath(paths[key]) for key in ("purelib", "platlib")}
    return runtime, tuple(sorted(p for p in hidden if os.path.isdir(p)))


_RUNTIME, _HIDDEN = _interpreter_runtime()

# The one declaration of the sandbox (docs/operations.md#python-graders describes it for operators).
POLICY = Policy(
    uid=65534,  # nobody
    gid=65534,
    namespaces=("pid", "net", "ipc", "uts", "cgroup"),
    runtime=_RUNTIME,
    hidden=_HIDDEN,
    tmp="/tmp",
    tmp_mb=64,  # a grader's scratch space; tmpfs pages are memory the address-space limit does not count
    processes=8,  # a grader needs one; room for a small multiprocessing pool, not for a fork bomb
    open_files=64,
)


@dataclass(frozen=True)
class Limits:
    """The per-run limits: the operator's settings (python_grader_timeout_seconds, _memory_mb)."""

    seconds: float
    memory_mb: int


def limits_json(limits: Limits, policy: Policy = POLICY) -> str:
    """The rlimits the runner sets on itself before it runs the tenant's code: {name: value}."""
    cpu = max(1, int(limits.seconds + 0.999))
    return json.dumps(
        {
            "RLIMIT_AS": limits.memory_mb << 20,
            "RLIMIT_CPU": cpu,
            "RLIMIT_NPROC": policy.processes,
            "RLIMIT_NOFILE": policy.open_files,
            "RLIMIT_FSIZE": policy.tmp_mb << 20,
            "RLIMIT_CORE": 0,
        }
    )


def interpreter() -> str:
    """The interpreter a sandboxed run starts: the base one (a venv's lives in the installation dir)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _top_level_links() -> list[str]:
    """/bin, /lib, /lib64... as the host has them: symlinks into /usr (merged /usr) or folders."""
    argv: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    return argv


def command(inner: list[str], policy: Policy = POLICY) -> list[str]:
    """bubblewrap's argv that runs `inner` (an argv whose program is in the runtime) under `policy`.

    Raises SandboxUnavailable when bwrap (or, as root, setpriv) is not installed."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap is not installed (no `bwrap` on PATH; Debian: apt-get install bubblewrap)"
        )
    argv = [bwrap, *(f"--unshare-{name}" for name in policy.namespaces)]
    # a user namespace of bubblewrap's own, mapping the sandbox's uid to the caller's, no nested ones
    userns = ["--unshare-user", "--disable-userns", "--uid", str(policy.uid), "--gid", str(policy.gid)]
    if os.geteuid() == 0:
        # A user namespace made by root would map the sandbox's uid to root on the host. So root builds
        # the other namespaces and the mounts (it can read an interpreter under /root), setpriv drops to
        # the unprivileged uid on the host, and a second, unprivileged bubblewrap adds the user namespace
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxUnavailable("util-linux's setpriv is not installed (no `setpriv` on PATH)")
        drop = [
            setpriv,
            f"--reuid={policy.uid}",
            f"--regid={policy.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
            bwrap,
            *userns,
            "--bind",  # the first one's filesystem as it is (its read-only mounts stay read-only)
            "/",
            "/",
            "--die-with-parent",
            "--",
        ]
    else:
        argv += userns
        drop = []
    argv += ["--die-with-parent", "--new-session", "--clearenv"]
    for path in policy.runtime:
        # the folders above it as plain 0755 folders: bwrap would copy their host modes (/root: 0700)
        for parent in reversed(Path(path).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", path, path]
    argv += _top_level_links()
    for path in policy.hidden:
        argv += ["--tmpfs", path, "--remount-ro", path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--perms", "1777", "--size", str(policy.tmp_mb << 20), "--tmpfs", policy.tmp]
    argv += ["--remount-ro", "/", "--chdir", policy.tmp, "--"]
    return argv + drop + inner


def unavailable(policy: Policy = POLICY) -> str | None:
    """Why this host cannot run tenant code under `policy` (bwrap missing, namespaces refused by the
    kernel or the container runtime), or None when a sandboxed interpreter starts and sees itself as
    the sandbox's uid."""
    probe = "import os; print(os.getuid(), os.getgid())"
    try:
        argv = command([interpreter(), "-I", "-S", "-c", probe], policy)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={}, check=False)
    except SandboxUnavailable as exc:
        return str(exc)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not be run: {exc}"
    if proc.returncode != 0 or proc.stdout.split() != [str(policy.uid), str(policy.gid)]:
        said = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return f"bubblewrap could not build the sandbox: {said}"
    return None
