"""`EmulatedCluster`: a multi-node cluster on one Linux host, as a context manager.

    with EmulatedCluster(load_topology_file("configs/topologies/virtual-2x2.json")) as cl:
        before = cl.counters()
        proc = cl.popen("node1", ["python", "train.py"], env=...)
        cl.set_link("node1", rate_mbit=20)      # a slow link, mid-run
        cl.link_down("node1"); cl.link_up("node1")
        cl.kill_rank(3)                         # SIGKILL rank 3's process
        cl.spine_down("leaf1"); cl.spine_up("leaf1")   # partition a leaf (multi-leaf presets)
        print(cl.counters().minus(before).cross_node_bytes)

Building it (phases):
  1. namespaces: ``<prefix>-sw`` (the switches) and ``<prefix>-n<i>`` per node, IPv6 off, ``lo`` up;
  2. bridges in the switch namespace: ``l<j>`` per leaf, ``sp`` (spine) when there are several leaves;
  3. node uplinks: veth ``eth0`` (node) <-> ``n<i>`` (on its leaf bridge), address 10.213.j.k/16;
  4. spine links: veth ``u<j>`` (on leaf bridge j) <-> ``d<j>`` (on the spine bridge);
  5. shaping: HTB (+ netem delay where available) on both ends of every link (layout.py has the numbers).
Any failure while building tears down what was made. Leaving the ``with`` block (normally, by an
exception, or by KeyboardInterrupt) kills every process still inside the namespaces and deletes them,
which removes every link, bridge and qdisc; an ``atexit`` hook covers an interpreter that exits
with a cluster still open. A run killed with SIGKILL leaves its namespaces behind:
``topo-align emulate --cleanup`` removes them.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import subprocess
import sys
import weakref
from typing import Mapping, Sequence

from ..topology.model import Topology
from . import runner
from .counters import CounterSnapshot, snapshot
from .layout import NODE_IFACE, Layout, NodeSpec, plan_layout
from .netns import (
    HOSTNAME_RE,
    EmulationError,
    EmulationUnavailable,
    add_namespace,
    delete_namespace,
    namespace_pids,
    ns_exec_argv,
    run_ip,
    unavailable_reason,
    write_etc_file,
)
from .procs import kill_groups, ranked_pids
from .shaping import LinkShape, apply_shape, change_shape, netem_available

__all__ = ["EmulatedCluster"]

_SEQ = itertools.count()
_LIVE: "weakref.WeakSet[EmulatedCluster]" = weakref.WeakSet()


@atexit.register
def _destroy_live() -> None:
    for cl in list(_LIVE):
        cl.close()


class EmulatedCluster:
    """Namespaces, links and shaping for ``topology``; see the module docstring."""

    def __init__(self, topology: Topology, *, mtu: int = 9000, shape: bool = True, uplink_mbit: float | None = None,
                 prefix: str | None = None):
        self.topology = topology
        self.layout: Layout = plan_layout(topology, prefix or f"ta{os.getpid()}-{next(_SEQ)}", mtu=mtu,
                                          uplink_mbit=uplink_mbit)
        self.shape = shape
        self.notes: list[str] = []
        """Things the emulation could not reproduce (e.g. delays on a kernel without netem)."""
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._shapes: dict[str, LinkShape] = {}
        self._open = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise EmulationUnavailable(f"cannot emulate a cluster: {reason}")
        _LIVE.add(self)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        lay = self.layout
        sw = lay.switch_ns
        for ns in lay.namespaces():
            self._created.append(ns)
            add_namespace(ns)
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{n.address} {n.host}\n" for n in lay.nodes if HOSTNAME_RE.fullmatch(n.host))
        for node in lay.nodes:
            write_etc_file(node.ns, "hosts", hosts)
        for br in [*lay.leaf_bridges.values(), *([lay.spine_bridge] if lay.spine_bridge else [])]:
            run_ip(["link", "add", br, "mtu", str(lay.mtu), "type", "bridge", "stp_state", "0"], ns=sw)
            run_ip(["link", "set", br, "up"], ns=sw)
        for node in lay.nodes:
            run_ip(["link", "add", NODE_IFACE, "netns", node.ns, "mtu", str(lay.mtu), "type", "veth",
                    "peer", "name", node.switch_port, "netns", sw, "mtu", str(lay.mtu)])
            run_ip(["link", "set", node.switch_port, "master", lay.leaf_bridges[node.leaf], "up"], ns=sw)
            run_ip(["addr", "add", f"{node.address}/16", "dev", NODE_IFACE], ns=node.ns)
            run_ip(["link", "set", NODE_IFACE, "up"], ns=node.ns)
        for sp in lay.spines:
            run_ip(["link", "add", sp.leaf_port, "mtu", str(lay.mtu), "type", "veth",
                    "peer", "name", sp.spine_port, "mtu", str(lay.mtu)], ns=sw)
            run_ip(["link", "set", sp.leaf_port, "master", lay.leaf_bridges[sp.leaf], "up"], ns=sw)
            run_ip(["link", "set", sp.spine_port, "master", lay.spine_bridge, "up"], ns=sw)
        if self.shape:
            for node in lay.nodes:
                self._shape_pair(node.host, node.ns, NODE_IFACE, sw, node.switch_port, node.uplink)
            for sp in lay.spines:
                self._shape_pair(f"{sp.leaf}:spine", sw, sp.leaf_port, sw, sp.spine_port, sp.shape)
            wanted = max([n.uplink.delay_ms for n in lay.nodes] + [s.shape.delay_ms for s in lay.spines])
            if wanted > 0 and netem_available() is False:
                self.notes.append(
                    f"link delays not applied (up to {wanted * 1000:.1f} us per link end): this kernel has no "
                    "netem qdisc (CONFIG_NET_SCH_NETEM); links are rate-shaped only"
                )

    def _shape_pair(self, name: str, ns_a: str, dev_a: str, ns_b: str, dev_b: str, shape: LinkShape) -> None:
        apply_shape(ns_a, dev_a, shape, mtu=self.layout.mtu)
        apply_shape(ns_b, dev_b, shape, mtu=self.layout.mtu)
        self._shapes[name] = shape

    def close(self) -> None:
        """Kill every process started in the cluster and delete its namespaces (idempotent)."""
        if not self._open:
            return
        self._open = False
        errors = []
        # Hold Ctrl-C/SIGTERM until everything is gone: an exception raised by a handler half-way
        # would leave namespaces behind. A signal that arrives meanwhile is delivered right after.
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            kill_groups(self._procs)
            for ns in reversed(self._created):
                try:
                    delete_namespace(ns)
                except Exception as exc:  # noqa: BLE001 - keep deleting the rest
                    errors.append(str(exc))
            self._created.clear()
            _LIVE.discard(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if errors:
            raise EmulationError("; ".join(errors))

    @property
    def is_open(self) -> bool:
        return self._open

    # -- running things ----------------------------------------------------------------------------

    def node(self, key: str | int) -> NodeSpec:
        return self.layout.node(key)

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        return self.layout.nodes

    def exec_argv(self, node: str | int, argv: Sequence[str]) -> list[str]:
        """argv that runs ``argv`` inside ``node``'s namespace, with the node's host name."""
        spec = self.node(node)
        return ns_exec_argv(spec.ns, list(argv), hostname=spec.host)

    def popen(self, node: str | int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``node`` in a new session (its own process group); killed at close()."""
        self._require_open()
        spec = self.node(node)
        full_env = dict(os.environ if env is None else env)
        full_env["TOPO_ALIGN_HOSTNAME"] = spec.host
        full_env["TOPO_ALIGN_EMULATE_RUN"] = self.layout.prefix
        proc = subprocess.Popen(self.exec_argv(node, argv), env=full_env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def fork(self, node: str | int, zygote, module: str, args: Sequence[str], *,
             env: Mapping[str, str] | None = None):
        """Like :meth:`popen` of ``python -u -m MODULE ARGS``, but forked from ``zygote`` (a
        zygote.Zygote that imported the module's dependencies once); killed at close()."""
        self._require_open()
        spec = self.node(node)
        full_env = dict(os.environ if env is None else env)
        full_env["TOPO_ALIGN_HOSTNAME"] = spec.host
        full_env["TOPO_ALIGN_EMULATE_RUN"] = self.layout.prefix
        proc = zygote.start(ns=spec.ns, hostname=spec.host, module=module, args=args, env=full_env)
        self._procs.append(proc)
        return proc

    def run(
        self, node: str | int, argv: Sequence[str], *, timeout: float = 60.0, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``node`` to completion (stdout/stderr captured as text)."""
        proc = self.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise EmulationError(
                f"{' '.join(argv)} on {self.node(node).host} did not finish within {timeout:g} s"
            ) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def measure(self, src: str | int, dst: str | int, *, nbytes: int = 2_000_000, pings: int = 20,
                port: int = 5201, timeout: float = 60.0, probe_timeout: float = 30.0) -> dict:
        """Send ``nbytes`` from ``src`` to ``dst`` over TCP and time it; also the median TCP round trip
        of 1-byte messages. Returns the probe's JSON (``mbit_per_s``, ``seconds``, ``rtt_ms``...)."""
        import json

        d = self.node(dst)
        # The probe runs as a plain script (-S: no site, stdlib only): starts in ~30 ms, not ~1 s.
        probe = [sys.executable, "-S", os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")]
        server = self.popen(dst, [*probe, "serve", "--bind", d.address, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            res = self.run(src, [*probe, "send", "--to", d.address,
                                 "--port", str(port), "--bytes", str(nbytes), "--pings", str(pings),
                                 "--timeout", str(probe_timeout)], timeout=timeout)
            if res.returncode != 0:
                raise EmulationError(f"probe {self.node(src).host} -> {d.host} failed: {res.stderr.strip()[-500:]}")
            return json.loads(res.stdout)
        finally:
            _kill_group(server)

    def launch(self, command: Sequence[str], *, mode: str = "per-rank", timeout: float | None = None,
               port: int = 29500, **kwargs):
        """Run ``command`` on every rank (or, ``mode="torchrun"``, node) and supervise it; see
        runner.launch. Returns a ``RunResult`` (exit_code, elapsed_s, reason, codes)."""
        self._require_open()
        return runner.launch(self, command, mode=mode, timeout=timeout, port=port, **kwargs)

    def counters(self) -> CounterSnapshot:
        """Interface counters of every link now (see counters.py); subtract two with ``minus``."""
        self._require_open()
        return snapshot(self.layout)

    # -- faults ------------------------------------------------------------------------------------

    def set_link(self, node: str | int, *, rate_mbit: float | None = None, delay_ms: float | None = None) -> LinkShape:
        """Change ``node``'s uplink in place, both directions; running connections survive.
        ``delay_ms`` is the delay each end adds to its egress, so one way through this link gains
        ``delay_ms`` and a round trip ``2 * delay_ms``. None keeps the current value."""
        spec = self.node(node)
        return self._change(spec.host, spec.ns, NODE_IFACE, spec.switch_port, spec.uplink, rate_mbit, delay_ms)

    def set_spine(self, leaf: str, *, rate_mbit: float | None = None, delay_ms: float | None = None) -> LinkShape:
        """Change the link between ``leaf`` and the spine, both directions (as :meth:`set_link`)."""
        sp = self._spine(leaf)
        return self._change(f"{leaf}:spine", self.layout.switch_ns, sp.leaf_port, sp.spine_port, sp.shape,
                            rate_mbit, delay_ms)

    def _change(self, name: str, ns_a: str, dev_a: str, dev_b: str, planned: LinkShape,
                rate_mbit: float | None, delay_ms: float | None) -> LinkShape:
        self._require_open()
        if not self.shape:
            raise EmulationError(f"cannot change link {name}: the cluster was built without shaping (shape=False)")
        old = self._shapes.get(name, planned)
        new = LinkShape(old.rate_mbit if rate_mbit is None else rate_mbit,
                        old.delay_ms if delay_ms is None else delay_ms)
        explicit = delay_ms is not None
        change_shape(ns_a, dev_a, new, mtu=self.layout.mtu, delay_explicit=explicit)
        change_shape(self.layout.switch_ns, dev_b, new, mtu=self.layout.mtu, delay_explicit=explicit)
        self._shapes[name] = new
        return new

    def link_shape(self, link: str | int) -> LinkShape:
        """Current shape of a node's uplink (by node) or of a spine link (``"<leaf>:spine"``)."""
        if isinstance(link, str) and link in self._shapes:
            return self._shapes[link]
        return self._shapes[self.node(link).host]

    def link_down(self, node: str | int) -> None:
        """Cut ``node``'s cable: its switch port goes down (the node sees carrier loss)."""
        self._require_open()
        run_ip(["link", "set", self.node(node).switch_port, "down"], ns=self.layout.switch_ns)

    def link_up(self, node: str | int) -> None:
        self._require_open()
        run_ip(["link", "set", self.node(node).switch_port, "up"], ns=self.layout.switch_ns)

    def spine_down(self, leaf: str) -> None:
        """Partition ``leaf``: its link to the spine goes down. Its nodes still reach each other
        through the leaf's bridge; nothing crosses to or from the other leaves until :meth:`spine_up`."""
        self._require_open()
        run_ip(["link", "set", self._spine(leaf).spine_port, "down"], ns=self.layout.switch_ns)

    def spine_up(self, leaf: str) -> None:
        self._require_open()
        run_ip(["link", "set", self._spine(leaf).spine_port, "up"], ns=self.layout.switch_ns)

    def _spine(self, leaf: str):
        sp = next((s for s in self.layout.spines if s.leaf == leaf), None)
        if sp is None:
            raise KeyError(f"no spine link for leaf {leaf!r}; spine links: {[s.leaf for s in self.layout.spines]}")
        return sp

    def rank_pids(self, rank: int) -> list[int]:
        """The live processes of global rank ``rank`` (per-rank processes and torchrun's workers:
        ``RANK=<rank>`` in their environment, inside the rank's node), without their own children."""
        self._require_open()
        spec = self.node(self.topology.ranks[rank].host)
        return ranked_pids(namespace_pids(spec.ns), rank)

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` (default SIGKILL: the process dies without a word) to rank ``rank``'s
        processes; returns their pids (empty when the rank is not running)."""
        pids = self.rank_pids(rank)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def _require_open(self) -> None:
        if not self._open:
            raise EmulationError(f"emulated cluster {self.layout.prefix} is not running (use it inside `with`)")


def _kill_group(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    kill_groups([proc], grace_s)
