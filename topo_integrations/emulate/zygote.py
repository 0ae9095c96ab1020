"""Ranks of an emulated job forked from one process that imported their modules once.

Why: a bench rank started as ``ip netns exec NS python -m MODULE`` is a fresh interpreter that
imports torch, numpy, DeepSpeed and megatron-core before its first step, 3 to 5 CPU seconds a rank:
on a 2-core machine the quick bench's 16 ranks spent most of their time importing. The zygote
imports them once; each rank is a fork of it that enters its node's network namespace and runs its
module as ``__main__``, as ``python -u -m MODULE ARGS`` would.

What a forked rank keeps of ``ip netns exec``: its node's network namespace (so its traffic crosses
the shaped links and the kernel's counters), a UTS namespace with the node's host name, its own
session (process group: ``procs.kill_groups`` ends it), stdout and stderr to the launcher's pipe,
its environment and argv. What differs: no mount namespace, so no ``/etc/netns/<ns>`` files (a
bench rank addresses nodes by IP); and ``/proc/<pid>/environ`` shows the zygote's environment at
its start, so the fault injector (``procs.ranked_pids``, which reads it) is for ranks the emulate
CLI started, not forked ones. Modules a rank imports read their import-time settings from the
zygote's environment, which is the launcher's (a rank's own variables, ``RANK``, ``MASTER_ADDR``,
the socket interface, are read when it initialises torch.distributed, after the fork).

Communication (a Unix ``SOCK_SEQPACKET`` pair; one JSON object per message):
  1. the launcher starts ``python -m topo_integrations.emulate.zygote FD MODULE...``; the zygote
     imports the modules (one that is not installed is left out) and answers ``{"ready": [...]}``;
  2. per rank, the launcher sends the request and the write end of a pipe (SCM_RIGHTS); the zygote
     forks, answers ``{"id", "pid"}``, and the child runs the module with stdout/stderr on the pipe;
  3. the zygote reaps its children and sends ``{"exit": pid, "code": c}`` (``-N`` for signal N, as
     ``subprocess.Popen.returncode``), which ``ForkedRank.poll()`` reads;
  4. when the launcher closes its end the zygote SIGKILLs the groups of children still running and
     exits.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

__all__ = ["Zygote", "ForkedRank", "ZygoteError"]

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
NETNS_DIR = "/var/run/netns"
_MSG = 1 << 20
"""The largest message: a request carries the rank's whole environment."""


class ZygoteError(RuntimeError):
    """The zygote did not start, or stopped answering."""


class ForkedRank:
    """The part of ``subprocess.Popen`` that the launcher and ``procs.kill_groups`` use, for a rank
    the zygote forked (it is the zygote's child, so its exit status comes from the zygote)."""

    def __init__(self, zygote: "Zygote", pid: int, args: list[str], stdout) -> None:
        self._zygote, self.pid, self.args, self.stdout = zygote, pid, args, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._zygote.exit_code(self.pid)
            except ZygoteError:
                # The zygote is gone, and its exit report with it: a rank that no longer exists was
                # reaped by init; say it was killed rather than wait for a status that cannot come.
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


class Zygote:
    """Start the zygote (it imports ``preload``); :meth:`start` forks a rank of it. Close it (or use
    it as a context manager) when the job is done."""

    def __init__(self, preload: Sequence[str], *, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 180.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock, self._lock = ours, threading.Lock()
        self._exits: dict[int, int] = {}
        self._next = 0
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "topo_integrations.emulate.zygote", str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()], env=dict(os.environ if env is None else env),
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        try:
            ready = self._recv(timeout=start_timeout_s)
        except ZygoteError:
            self.close()
            raise
        if ready is None or "ready" not in ready:
            self.close()
            raise ZygoteError(f"the zygote did not start within {start_timeout_s:g} s" if ready is None
                              else f"the zygote did not start: {ready.get('error', ready)}")
        self.preloaded: list[str] = ready["ready"]

    # -- the launcher's side -------------------------------------------------------------------------

    def start(self, *, ns: str, hostname: str | None, module: str, args: Sequence[str], env: Mapping[str, str],
              cwd: str | None = None) -> ForkedRank:
        """Fork a rank that enters namespace ``ns`` (and a UTS namespace named ``hostname``) and runs
        ``module`` as ``__main__`` with ``args`` and environment ``env``."""
        r, w = os.pipe()
        with self._lock:
            self._next += 1
            req = {"id": self._next, "ns": ns, "hostname": hostname, "module": module, "args": list(args),
                   "env": dict(env), "cwd": cwd or os.getcwd()}
            try:
                socket.send_fds(self._sock, [json.dumps(req).encode()], [w])
            except OSError as exc:
                os.close(r)
                raise ZygoteError(f"the zygote is gone ({exc})") from None
            finally:
                os.close(w)
            while True:  # exits of other ranks may come first
                msg = self._recv(timeout=60.0)
                if msg is None:
                    os.close(r)
                    raise ZygoteError("the zygote did not answer a start request within 60 s")
                if msg.get("id") == req["id"]:
                    break
        if "error" in msg:
            os.close(r)
            raise ZygoteError(msg["error"])
        stdout = open(r, encoding="utf-8", errors="replace", newline=None)  # noqa: SIM115 - the caller reads it
        return ForkedRank(self, int(msg["pid"]), ["-m", module, *args], stdout)

    def exit_code(self, pid: int) -> int | None:
        """The exit status of forked rank ``pid``, or None while it runs."""
        with self._lock:
            while self._recv(timeout=0.0) is not None:
                pass
            return self._exits.get(pid)

    def close(self) -> None:
        """Close our end: the zygote kills the ranks still running and exits."""
        try:
            self._sock.close()
        finally:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _recv(self, timeout: float) -> dict | None:
        """One message (an exit is recorded, and returned too), or None when none came in time."""
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(_MSG)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError as exc:
            raise ZygoteError(f"the zygote is gone ({exc})") from None
        if not data:  # end of stream: no message of ours is empty
            raise ZygoteError(f"the zygote exited ({self._proc.poll()})")
        msg = json.loads(data)
        if "exit" in msg:
            self._exits[int(msg["exit"])] = int(msg["code"])
        return msg


# -- the zygote's side -------------------------------------------------------------------------------

def _enter(ns: str, hostname: str | None) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    if hostname:
        if libc.unshare(CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), f"unshare(UTS): {os.strerror(ctypes.get_errno())}")
        socket.sethostname(hostname)


def _child(req: dict, out_fd: int) -> None:
    """In the forked rank: become ``python -u -m MODULE ARGS`` in its node; never returns."""
    import atexit
    import io
    import runpy
    import signal
    import traceback

    # What the zygote imported is never garbage in the rank: frozen, a collection (DeepSpeed's and
    # megatron-core's gc.collect() calls, the automatic ones) walks only what the rank made.
    gc.freeze()
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a new interpreter's, not the zygote's
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        # -u: unbuffered text streams on the new descriptors
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
        _enter(req["ns"], req.get("hostname"))
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = [req["module"], *req["args"]]
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - printed as an interpreter would, exit 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what an interpreter's exit runs
    except BaseException:  # noqa: BLE001 - the fork must never return into the zygote's loop
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(fd: int, preload: Sequence[str]) -> int:
    """The zygote's loop (phases 1 to 4 of the module docstring)."""
    import importlib
    import signal

    # Ctrl-C reaches the launcher's whole process group: the launcher ends the ranks and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    loaded = []
    for name in preload:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except ImportError:
            pass
    # A fork copies the calling thread only: nothing imported may have started one.
    if threading.active_count() != 1:
        sock.send(json.dumps({"error": f"threads after import: {threading.enumerate()}"}).encode())
        return 1
    sock.send(json.dumps({"ready": loaded}).encode())
    children: set[int] = set()
    sock.settimeout(0.05)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MSG, 1)
        except TimeoutError:
            msg, fds = None, []
        except OSError:
            msg, fds = b"", []
        if msg == b"":  # the launcher closed its end (or died): end what is still running, and reap it
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            for pid in children:
                os.waitpid(pid, 0)
            return 0
        if msg is not None:
            req = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(req, fds[0])
            os.close(fds[0])
            children.add(pid)
            sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2:]))
