"""The one seam through which topology discovery reads the machine: files under ``/sys`` and
``/etc``, the commands ``nvidia-smi`` and ``rocm-smi``, NVML, the Slurm environment, the host name.

Live (the default), a `Machine` reads the real paths and runs the real commands. With a root --
``Machine(root)`` or the environment variable ``TOPO_ALIGN_SYSROOT`` -- it replays a captured node
(``topo-align capture DIR`` writes one; docs/topology-format.md, "Captured nodes"):

    DIR/sys/class/infiniband/<dev>/ports/<p>/{rate,state,phys_state,link_layer}
    DIR/sys/class/net/<if>/{speed,operstate,device}
    DIR/etc/hostname                       the node's host name
    DIR/etc/slurm/topology.conf            Slurm's switch tree (when the job ran under Slurm)
    DIR/env.json                           the SLURM_* variables discovery reads
    DIR/commands/<argv joined by _>.txt    a command's stdout (absent: the command is not installed)
    DIR/commands/<argv joined by _>.failed a command that exited non-zero, with its message

Replaying never touches the live machine (no NVML, no commands), so a test can give every rank of
one job a different node. Every problem reading is a `TopologyError` naming the path or command.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from typing import Any, Sequence

from .model import TopologyError

__all__ = ["Machine", "SYSROOT_ENV", "HOSTNAME_ENV", "ENV_KEYS", "command_file", "MAX_READ_BYTES",
           "COMMAND_TIMEOUT_S"]

SYSROOT_ENV = "TOPO_ALIGN_SYSROOT"
HOSTNAME_ENV = "TOPO_ALIGN_HOSTNAME"
"""Overrides the host name (live and replayed); the emulator and multi-rank tests fake nodes with it."""
ENV_KEYS = ("SLURM_JOB_ID", "SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN", "SLURM_CONF")
"""The environment variables discovery reads (and a capture records)."""
MAX_READ_BYTES = 4 * 1024 * 1024
COMMAND_TIMEOUT_S = 60.0


def command_file(argv: Sequence[str]) -> str:
    """``["nvidia-smi", "topo", "-m"]`` -> ``nvidia-smi_topo_-m`` (the name in a capture's commands/)."""
    return "_".join(a.replace("/", "-").replace(" ", "-") for a in argv)


class Machine:
    """Reads of one node, live (``root=None``) or replayed from a captured tree (``root=DIR``)."""

    def __init__(self, root: str | None = None):
        self.root = root
        if root is not None and not os.path.isdir(root):
            raise TopologyError(f"{SYSROOT_ENV}={root!r}: not a directory; expected a tree written by "
                                "`topo-align capture DIR`")

    @classmethod
    def from_env(cls) -> Machine:
        """Live, unless ``$TOPO_ALIGN_SYSROOT`` names a captured node to replay."""
        return cls(os.environ.get(SYSROOT_ENV) or None)

    @property
    def replaying(self) -> bool:
        return self.root is not None

    def describe(self) -> str:
        return f"captured node {self.root}" if self.root else "this machine"

    def path(self, path: str) -> str:
        """Where an absolute machine path lives (under the root when replaying)."""
        if self.root is None:
            return path
        return os.path.join(self.root, path.lstrip("/"))

    # -- files -------------------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.path(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(self.path(path))

    def listdir(self, path: str) -> list[str]:
        """Sorted entries of a directory; [] when it does not exist."""
        real = self.path(path)
        if not os.path.isdir(real):
            return []
        try:
            return sorted(os.listdir(real))
        except OSError as exc:
            raise TopologyError(f"{real}: cannot list ({exc.strerror or exc})") from None

    def read(self, path: str, *, missing_ok: bool = False) -> str | None:
        """Stripped text of a file (None when absent and ``missing_ok``); unreadable or not UTF-8 is a
        `TopologyError` naming the path."""
        real = self.path(path)
        if missing_ok and not os.path.lexists(real):
            return None
        try:
            with open(real, "rb") as fh:
                raw = fh.read(MAX_READ_BYTES + 1)
        except OSError as exc:
            raise TopologyError(f"{real}: cannot read ({exc.strerror or exc})") from None
        if len(raw) > MAX_READ_BYTES:
            raise TopologyError(f"{real}: more than {MAX_READ_BYTES} bytes; expected a small text file")
        try:
            return raw.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise TopologyError(f"{real}: not UTF-8 text (byte {exc.start})") from None

    # -- commands, NVML, environment ---------------------------------------------------------------

    def command(self, argv: Sequence[str]) -> str | None:
        """stdout of ``argv``; None when the command is not installed (or was not captured). A command
        that fails or times out is a `TopologyError` naming it."""
        what = " ".join(argv)
        if self.root is not None:
            base = os.path.join(self.root, "commands", command_file(argv))
            if os.path.exists(base + ".failed"):
                msg = self.read(os.path.relpath(base + ".failed", self.root))
                raise TopologyError(f"`{what}` failed on the captured node {self.root}: {msg}")
            return self.read(os.path.relpath(base + ".txt", self.root), missing_ok=True)
        exe = shutil.which(argv[0])
        if exe is None:
            return None
        try:
            res = subprocess.run([exe, *argv[1:]], capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise TopologyError(f"`{what}` did not finish within {COMMAND_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise TopologyError(f"`{what}` cannot run ({exc.strerror or exc})") from None
        out = res.stdout.decode("utf-8", "replace")
        if res.returncode != 0:
            err = " ".join((res.stderr.decode("utf-8", "replace") or out).split())[:300]
            raise TopologyError(f"`{what}` exited {res.returncode}: {err}")
        return out

    def nvml(self) -> Any | None:
        """The `pynvml` module, initialised, when importable and live; None otherwise."""
        if self.root is not None:
            return None
        try:
            import pynvml  # optional (nvidia-ml-py); not a dependency of the package
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no driver: fall back to the commands
            return None
        return pynvml

    def env(self, name: str) -> str | None:
        """An environment variable of the node (the captured ``env.json`` when replaying)."""
        if self.root is None:
            return os.environ.get(name) or None
        data = self._captured_env()
        value = data.get(name)
        return value if isinstance(value, str) and value else None

    def _captured_env(self) -> dict:
        text = self.read("/env.json", missing_ok=True)
        if text is None:
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{self.path('/env.json')}: not JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise TopologyError(f"{self.path('/env.json')}: expected a JSON object of variables")
        return data

    def hostname(self) -> str:
        """``$TOPO_ALIGN_HOSTNAME``, else the captured ``etc/hostname`` when replaying, else the live name."""
        name = os.environ.get(HOSTNAME_ENV)
        if not name and self.root is not None:
            name = self.read("/etc/hostname", missing_ok=True)
            if name is None:
                raise TopologyError(f"{self.path('/etc/hostname')}: missing; a captured node names its host there")
        name = (name or socket.gethostname()).strip()
        if not name or len(name) > 255 or any(c.isspace() for c in name):
            raise TopologyError(f"host name {name!r} ({self.describe()}); expected a non-empty name without spaces")
        return name
