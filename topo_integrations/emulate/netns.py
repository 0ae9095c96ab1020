"""Thin, checked wrappers around `ip` for network namespaces, veth pairs and bridges.

Everything the emulator creates lives inside namespaces named ``ta<pid>-<seq>-<role>``: veth pairs
are created directly in their target namespaces (``ip link add ... netns A type veth peer ...
netns B``), bridges inside the switch namespace, so nothing is ever added to the caller's own
network namespace and no emulated address can route anywhere outside. Deleting the namespaces
(after killing whatever still runs in them) removes every link, bridge and qdisc with them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = [
    "EmulationError", "EmulationUnavailable", "NS_PREFIX_RE", "run_ip", "unavailable_reason",
    "add_namespace", "delete_namespace", "namespace_pids", "list_namespaces", "kill_namespace_processes",
    "cleanup_leftovers", "ns_exec_argv", "LeftoverReport", "write_etc_file", "remove_etc_files",
]

# ta<pid>-<seq>-<role>: the pid of the process that made it, so `--cleanup` can tell leftovers of
# dead runs from namespaces of a run still in progress.
NS_PREFIX_RE = re.compile(r"^ta(\d+)-(\d+)-[a-z0-9]+$")


class EmulationError(RuntimeError):
    """An emulated-cluster operation failed; the message names the command and the kernel's answer."""


class EmulationUnavailable(EmulationError):
    """Namespaces cannot be made on this machine (not root, no `ip`, kernel without netns)."""


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here, or None when it can (cheap checks; no namespace made)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in a container with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not on PATH"
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces (/proc/self/ns/net is missing)"
    return None



def probe_unavailable_reason() -> str | None:
    """Like :func:`unavailable_reason`, then really make and delete one namespace (some containers
    pass the cheap checks but refuse ``ip netns add``). For tests and ``doctor``-style checks."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    reason = unavailable_reason()
    if reason:
        return reason
    name = f"ta{os.getpid()}-999-probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None

def run_ip(args: list[str], *, ns: str | None = None, tool: str = "ip", check: bool = True,
           timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run ``ip``/``tc`` (optionally ``-n NS``); raise :class:`EmulationError` with its stderr on failure."""
    argv = [tool] + (["-n", ns] if ns else []) + list(args)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise EmulationUnavailable(f"the `{tool}` command (iproute2) is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise EmulationError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        raise EmulationError(f"`{' '.join(argv)}` failed: {err[-1] if err else f'exit {proc.returncode}'}")
    return proc


def add_namespace(name: str) -> None:
    if not NS_PREFIX_RE.match(name):
        raise ValueError(f"namespace name {name!r} does not match {NS_PREFIX_RE.pattern}")
    run_ip(["netns", "add", name])
    # IPv6 off: router solicitations and MLD reports would show up in the byte counters.
    # /proc/sys/net is per namespace, so this must run inside it.
    subprocess.run(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
                    "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
                   capture_output=True, timeout=20)
    run_ip(["link", "set", "lo", "up"], ns=name)


def list_namespaces() -> list[str]:
    proc = run_ip(["netns", "list"], check=False)
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    proc = run_ip(["netns", "pids", name], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def kill_namespace_processes(name: str, grace_s: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process still inside namespace ``name`` (all were started by
    the emulator: nothing else runs in a namespace it created). Returns the pids it found."""
    pids = namespace_pids(name)
    if not pids:
        return []
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    return pids


def delete_namespace(name: str) -> None:
    """Kill what runs inside, then delete it and its /etc/netns/<name> files; a namespace that is
    already gone is not an error."""
    kill_namespace_processes(name)
    proc = run_ip(["netns", "delete", name], check=False)
    remove_etc_files(name)
    if proc.returncode != 0 and name in list_namespaces():
        raise EmulationError(f"cannot delete namespace {name}: {proc.stderr.strip()}")


ETC_NETNS = "/etc/netns"


def write_etc_file(name: str, filename: str, text: str) -> None:
    """``ip netns exec`` bind-mounts /etc/netns/<name>/<file> over /etc/<file> for the command:
    this gives each emulated node its own /etc/hosts (node names resolve to emulated addresses)."""
    if not NS_PREFIX_RE.match(name):
        raise ValueError(f"namespace name {name!r} does not match {NS_PREFIX_RE.pattern}")
    d = os.path.join(ETC_NETNS, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, filename), "w", encoding="utf-8") as fh:
        fh.write(text)


def remove_etc_files(name: str) -> None:
    if NS_PREFIX_RE.match(name):  # never touch a directory the emulator did not make
        shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)


@dataclass
class LeftoverReport:
    removed: list[str]
    kept_live: list[str]
    """Namespaces of an emulator process that is still running (left alone)."""


def cleanup_leftovers(*, include_pid: int | None = None) -> LeftoverReport:
    """Delete ``ta<pid>-*`` namespaces whose creating process is gone (or whose pid is ``include_pid``)."""
    removed, kept = [], []
    names = list_namespaces()
    # /etc/netns/<name> of a namespace that is already gone (a run killed between the two deletions)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            m = NS_PREFIX_RE.match(name)
            if m and name not in names and not _owned_by_live_run(int(m.group(1)), include_pid):
                remove_etc_files(name)
    for name in names:
        m = NS_PREFIX_RE.match(name)
        if not m:
            continue
        if _owned_by_live_run(int(m.group(1)), include_pid):
            kept.append(name)
            continue
        delete_namespace(name)
        removed.append(name)
    return LeftoverReport(removed, kept)


def ns_exec_argv(ns: str, argv: list[str], *, hostname: str | None = None) -> list[str]:
    """The argv that runs ``argv`` inside namespace ``ns``; with ``hostname``, in its own UTS
    namespace with that host name (so ``socket.gethostname()`` tells the emulated nodes apart).
    Every step execs, so the returned process's pid is the command's own pid."""
    out = ["ip", "netns", "exec", ns]
    if hostname and shutil.which("unshare") and HOSTNAME_RE.fullmatch(hostname):
        out += ["unshare", "--uts", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", hostname]
    return out + list(argv)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # A zombie has exited; only its parent's wait() is missing.
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _owned_by_live_run(owner: int, include_pid: int | None) -> bool:
    return owner != include_pid and owner != os.getpid() and _is_emulator(owner)


HOSTNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}")


def _is_emulator(pid: int) -> bool:
    """Is ``pid`` alive and a Python process (the emulator is one)? Guards against deleting the
    namespaces of a run that is still in progress; a recycled pid only delays cleanup."""
    if not _alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"python" in fh.read()
    except OSError:
        return False
