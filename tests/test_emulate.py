"""The emulated multi-node cluster (topo_integrations/emulate, docs/emulation.md).

Pure tests (layout, argument checks, refusal) always run. The `emulated` tests build real network
namespaces, veth links, bridges and tc shaping, run real gloo traffic across them and read the
kernel's interface counters; they skip with the reason when namespaces cannot be made (not root,
no `ip`, no netns support). Budget: about 40 s on the 2-core development machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topo_integrations.emulate import DelayUnsupported, EmulatedCluster, EmulationError, LinkShape, plan_layout
from topo_integrations.emulate import cli as emulate_cli
from topo_integrations.emulate.netns import (
    NS_PREFIX_RE,
    list_namespaces,
    namespace_pids,
    probe_unavailable_reason,
)
from topo_integrations.emulate.runner import launch, node_env, rank_env
from topo_integrations.emulate.shaping import netem_available
from topo_integrations.emulate.zygote import Zygote
from topo_integrations.topology.file_source import load_topology_file

ROOT = Path(__file__).resolve().parents[1]
TOPO_2X2 = ROOT / "configs" / "topologies" / "virtual-2x2.json"
TOPO_2LEAF = ROOT / "configs" / "topologies" / "virtual-2leaf.json"
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


_REASON = probe_unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster unavailable: {_REASON}")


def _emulate(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "topo_integrations.emulate", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _ours(pid: int) -> list[str]:
    """Namespaces made by the emulator process ``pid``."""
    return [n for n in list_namespaces() if n.startswith(f"ta{pid}-")]


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries TOPO_ALIGN_EMULATE_RUN=<marker>... (started in a cluster)."""
    needle = f"TOPO_ALIGN_EMULATE_RUN={marker}".encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as fh:
                    if any(v.startswith(needle) for v in fh.read().split(b"\0")):
                        out.append(int(d))
            except OSError:
                pass
    return out


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _assert_nothing_left(pid: int, links_before: set[str]) -> None:
    assert _ours(pid) == [], f"namespaces left behind: {_ours(pid)}"
    assert _marked_pids(f"ta{pid}-") == [], "processes left behind"
    assert not any(Path("/etc/netns").glob(f"ta{pid}-*")), "/etc/netns files left behind"
    assert _root_links() == links_before, "links were added to the host namespace"


# -- pure: layout and arguments ----------------------------------------------------------------------


def test_layout_maps_tiers_to_links():
    lay = plan_layout(load_topology_file(TOPO_2X2), "ta1-0")
    assert [(n.host, n.ns, n.address, n.ranks) for n in lay.nodes] == [
        ("node0", "ta1-0-n0", "10.213.0.1", (0, 1)), ("node1", "ta1-0-n1", "10.213.0.2", (2, 3))]
    # leaf 0.0125 GB/s per GPU x 2 GPUs = 0.025 GB/s = 200 Mbit/s; 500 us leaf latency -> 0.25 ms per end
    assert [n.uplink for n in lay.nodes] == [LinkShape(200.0, 0.25)] * 2
    assert lay.spines == () and lay.spine_bridge is None and lay.master.host == "node0"
    assert all(NS_PREFIX_RE.match(ns) for ns in lay.namespaces())

    two = plan_layout(load_topology_file(TOPO_2LEAF), "ta1-1")
    assert [n.address for n in two.nodes] == ["10.213.0.1", "10.213.0.2", "10.213.1.1", "10.213.1.2"]
    # spine 0.025 GB/s x 2 ranks under the leaf / 2.0 oversubscription = 200 Mbit/s; (1000-500)/2 us per end
    assert [(s.leaf, s.shape) for s in two.spines] == [
        ("leaf0", LinkShape(200.0, 0.25)),
        ("leaf1", LinkShape(200.0, 0.25)),
    ]
    assert [n.uplink.rate_mbit for n in plan_layout(load_topology_file(TOPO_2X2), "ta1-2", uplink_mbit=200).nodes] == [
        200,
        200,
    ]


def test_rank_environment():
    cl = EmulatedCluster(load_topology_file(TOPO_2X2))  # not started: the environment is pure
    env = rank_env(cl, 3, base={"OMP_NUM_THREADS": "2"})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TOPO_ALIGN_HOSTNAME", "OMP_NUM_THREADS")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
        "MASTER_ADDR": "10.213.0.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth0",
        "TOPO_ALIGN_HOSTNAME": "node1", "OMP_NUM_THREADS": "2"}
    assert "RANK" not in node_env(cl, 0, base={}) and node_env(cl, 0, base={})["OMP_NUM_THREADS"] == "1"
    with pytest.raises(EmulationError, match="is not running"):
        cl.counters()


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"rate_mbit = -1; expected a number in \[0.01, 1e7\] \(Mbit/s\)"):
        LinkShape(-1)
    with pytest.raises(ValueError, match=r"mtu = 100; expected an integer in \[576, 65535\]"):
        plan_layout(load_topology_file(TOPO_2X2), "ta1-0", mtu=100)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "/nonexistent.json", "--", "true"], "cannot read topology file"),
        (["--topology", str(TOPO_2X2)], "no command given; put it after `--`"),
        (
            ["--topology", str(TOPO_2X2), "--timeout", "-3", "--", "true"],
            "--timeout = -3.0; expected a number of seconds > 0",
        ),
        (["--", "true"], "--topology FILE is required"),
    ],
)
def test_cli_bad_input_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(emulate_cli, "unavailable_reason", lambda: None)  # reach the input checks as non-root too
    assert emulate_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("topo-align emulate: ") and message in err


def test_cli_refuses_without_root(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert emulate_cli.main(["--topology", str(TOPO_2X2), "--", "true"]) == 2
    assert capsys.readouterr().err == (
        "topo-align emulate: cannot emulate a cluster: network namespaces need root (run as root, e.g. in a "
        "container with CAP_SYS_ADMIN and CAP_NET_ADMIN)\n")


def test_cli_refuses_without_ip(tmp_path):
    env = {**ENV, "PATH": str(tmp_path)}  # no `ip` on PATH
    p = subprocess.run([PY, "-m", "topo_integrations.emulate", "--topology", str(TOPO_2X2), "--", "true"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] in (
        "topo-align emulate: cannot emulate a cluster: the `ip` command (iproute2) is not on PATH",
        "topo-align emulate: cannot emulate a cluster: network namespaces need root (run as root, e.g. in a "
        "container with CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    assert "Traceback" not in p.stderr


# -- emulated: a real gloo job across a 2 x 2 cluster --------------------------------------------------

NUMEL, ITERS = 1_000_000, 3  # 4 MB of fp32 per all-reduce


@pytest.fixture(scope="module")
def allreduce_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulate") / "bytes.json"
    links_before = _root_links()
    p = _emulate("--topology", str(TOPO_2X2), "--timeout", "120", "--bytes-json", str(out), "--",
                 PY, str(ROOT / "scripts" / "emulate_allreduce.py"), "--numel", str(NUMEL), "--iters", str(ITERS))
    stdout, stderr = p.communicate(timeout=150)
    ranks = [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines() if '"phases"' in line]
    return {"code": p.returncode, "stdout": stdout, "stderr": stderr, "ranks": ranks, "pid": p.pid,
            "bytes": json.loads(out.read_text()) if out.exists() else None, "links_before": links_before}


def _ring_cross_node_bytes(hosts: list[str], payload: int) -> float:
    """gloo's ring all-reduce: rank r sends 2(n-1)/n of the payload to rank r+1 (mod n)."""
    n = len(hosts)
    crossing = sum(hosts[r] != hosts[(r + 1) % n] for r in range(n))
    return crossing * 2 * (n - 1) / n * payload


@needs_netns
@pytest.mark.emulated
@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_gloo_job_runs_on_the_emulated_nodes(allreduce_run):
    assert allreduce_run["code"] == 0, allreduce_run["stderr"][-3000:] + allreduce_run["stdout"][-3000:]
    assert sorted((r["rank"], r["host"]) for r in allreduce_run["ranks"]) == [
        (0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")]  # UTS host name = the node's name


@needs_netns
@pytest.mark.emulated
@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_measured_cross_node_bytes_match_the_algorithms(allreduce_run):
    assert allreduce_run["code"] == 0
    payload = NUMEL * 4 * ITERS
    hosts = ["node0", "node0", "node1", "node1"]
    flat = _ring_cross_node_bytes(hosts, payload)  # 2 crossing edges x 1.5 S = 3 S
    # hierarchical: every rank all-reduces a 1/k shard over its rail of m nodes: n x 2(m-1)/m x S/k = 2 S
    hier = 4 * 2 * (2 - 1) / 2 * payload / 2
    per_node = {}
    for r in allreduce_run["ranks"]:
        per_node.setdefault(r["host"], r["phases"])
    for phase, expected in (("flat", flat), ("hierarchical", hier)):
        measured = sum(p[phase]["node_tx_bytes"] for p in per_node.values())
        assert abs(measured - expected) <= 0.10 * expected, (phase, measured, expected)
    # The emulator's own per-link counters over the whole run (rendezvous and barriers included).
    rep = allreduce_run["bytes"]
    total = rep["totals"]["cross_node_bytes"]
    assert abs(total - (flat + hier)) <= 0.10 * (flat + hier), (total, flat + hier)
    uplinks = {c["link"]: c for c in rep["links"] if c["kind"] == "uplink"}
    assert set(uplinks) == {"node0", "node1"} and sum(c["tx_bytes"] for c in uplinks.values()) == total
    # what one node sends the other receives (one bridge, no other traffic)
    assert abs(uplinks["node0"]["tx_bytes"] - uplinks["node1"]["rx_bytes"]) <= 0.01 * total
    # intra-node traffic stays on loopback: far more than zero, none of it on the uplinks
    assert rep["totals"]["intra_node_bytes"] > payload
    assert rep["exit_code"] == 0 and rep["nodes"][0]["uplink_mbit"] == 200.0


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_job_leaves_nothing_behind(allreduce_run):
    _assert_nothing_left(allreduce_run["pid"], allreduce_run["links_before"])


@needs_netns
@pytest.mark.emulated
@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_torchrun_mode(tmp_path):
    # The workers only report what torchrun gave them (the gloo job itself runs in the per-rank test):
    # the two agents still rendezvous over the emulated link.
    worker = tmp_path / "worker.py"
    # One write per line: with PYTHONUNBUFFERED, print() writes text and newline separately, and the
    # two workers of a node share one pipe, so their lines could interleave.
    worker.write_text("import json, os, socket, sys\n"
                      "sys.stdout.write(json.dumps({k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', "
                      "'WORLD_SIZE', 'GLOO_SOCKET_IFNAME')} | {'host': socket.gethostname()}) + '\\n')\n")
    links_before = _root_links()
    p = _emulate("--topology", str(TOPO_2X2), "--torchrun", "--timeout", "100", "--", str(worker))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:] + out[-3000:]
    got = sorted(tuple(json.loads(line.split("] ", 1)[1]).values()) for line in out.splitlines() if '"RANK"' in line)
    assert got == [("0", "0", "4", "eth0", "node0"), ("1", "1", "4", "eth0", "node0"),
                   ("2", "0", "4", "eth0", "node1"), ("3", "1", "4", "eth0", "node1")]
    assert all(line.startswith(("[node0] ", "[node1] ")) for line in out.splitlines())
    _assert_nothing_left(p.pid, links_before)


# -- emulated: the cluster object (shaping, counters, faults) ----------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster(load_topology_file(TOPO_2X2)) as cl:
        yield cl
    assert not cl.is_open


def _kernel_rate_mbit(ns: str, dev: str) -> float:
    """The HTB rate the kernel enforces on ``dev`` in namespace ``ns`` (``tc class show``), Mbit/s.

    Measured throughput is capped by the shaper but lowered by CPU contention from other jobs on a
    shared machine, so the tests assert only its upper bound, and check the configured rate here."""
    import re

    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "class", "show", "dev", dev], capture_output=True,
                         text=True, timeout=20, check=True).stdout
    m = re.search(r"\brate (\d+(?:\.\d+)?)([KMG]?)bit", out)
    assert m, out
    return float(m.group(1)) * {"K": 1e-3, "": 1e-6, "M": 1.0, "G": 1e3}[m.group(2)]


def _uplink_rates(cl: EmulatedCluster, host: str) -> tuple[float, float]:
    """(node side, switch side) kernel rates of ``host``'s uplink."""
    n = cl.layout.node(host)
    return _kernel_rate_mbit(n.ns, "eth0"), _kernel_rate_mbit(cl.layout.switch_ns, n.switch_port)


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_zygote_forks_each_rank_into_its_node(cluster):
    """The bench's ranks, forked from one process that imported their modules (emulate/zygote.py):
    each runs in its node's network namespace (its route picks the node's address) with the node's
    host name, its argv and its own session; a failing rank's status ends the run and the others are
    killed; a hanging one is killed at the timeout; nothing is left in the namespaces."""
    import io

    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    with Zygote(["colorsys", "no_such_module_here"], env=env) as z:
        assert z.preloaded == ["colorsys"]  # one that is not installed is left out
        out = io.StringIO()
        res = launch(cluster, [PY, "-u", "-m", "_zygote_rank", "ok"], zygote=z, out=out, timeout=30)
        assert res.exit_code == 0, out.getvalue()
        rows = sorted((json.loads(ln.split("] ", 1)[1]) for ln in out.getvalue().splitlines() if "] {" in ln),
                      key=lambda r: r["rank"])
        want = [{"rank": r, "host": cluster.layout.node(p.host).host, "addr": cluster.layout.node(p.host).address,
                 "argv": ["ok"], "preloaded": True, "own_session": True}
                for r, p in enumerate(cluster.topology.ranks)]
        assert rows == want
        res = launch(cluster, [PY, "-m", "_zygote_rank", "fail"], zygote=z, out=io.StringIO(), timeout=30)
        assert (res.exit_code, res.reason) == (3, "failed: node1 r3 exited 3"), res
        t0 = time.monotonic()
        res = launch(cluster, [PY, "-m", "_zygote_rank", "hang"], zygote=z, out=io.StringIO(), timeout=1.5)
        assert res.exit_code == 124 and time.monotonic() - t0 < 15, res
        assert all(code is not None and code < 0 for code in res.codes.values()), res.codes  # killed
        assert [namespace_pids(n.ns) for n in cluster.layout.nodes] == [[] for _ in cluster.layout.nodes]
    with pytest.raises(ValueError, match="a zygote runs `python \\[-u\\] -m MODULE ...` commands, not"):
        launch(cluster, [PY, "-c", "pass"], zygote=z)


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_shaped_bandwidth_and_counters(cluster):
    assert cluster.link_shape("node0") == LinkShape(200.0, 0.25)
    assert _uplink_rates(cluster, "node0") == (200.0, 200.0)
    before = cluster.counters()
    nbytes = 4_000_000
    res = cluster.measure("node0", "node1", nbytes=nbytes)
    delta = cluster.counters().minus(before)
    # 200 Mbit/s = 25 MB/s: 4 MB takes ~160 ms. The shaper caps the rate (an unshaped veth runs at
    # GB/s); how far below the cap a transfer runs depends on the machine's load, so only the cap is
    # asserted.
    assert 0 < res["mbit_per_s"] <= 1.2 * 200, res
    up0 = delta.link("node0")
    assert nbytes <= up0.tx_bytes <= 1.03 * nbytes + 20_000, up0  # payload + headers at MTU 9000
    assert abs(delta.link("node1").rx_bytes - up0.tx_bytes) <= 2_000
    assert delta.cross_leaf_bytes == 0 and res["rtt_ms"] < 50


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(90)
def test_set_link_and_link_down_up(cluster):
    try:
        cluster.set_link("node1", rate_mbit=40)
        assert cluster.link_shape("node1").rate_mbit == 40
        assert _uplink_rates(cluster, "node1") == (40.0, 40.0)
        slow = cluster.measure("node0", "node1", nbytes=1_500_000, pings=5)
        assert 0 < slow["mbit_per_s"] <= 1.25 * 40, slow
        # the other direction is shaped too (the switch port's egress)
        back = cluster.measure("node1", "node0", nbytes=1_500_000)
        assert back["mbit_per_s"] <= 1.25 * 40, back
    finally:
        cluster.set_link("node1", rate_mbit=200)
    cluster.link_down("node1")
    try:
        with pytest.raises(EmulationError, match="probe node0 -> node1 failed"):
            cluster.measure("node0", "node1", nbytes=100_000, pings=1, probe_timeout=1.5, timeout=20)
    finally:
        cluster.link_up("node1")
    assert _uplink_rates(cluster, "node1") == (200.0, 200.0)  # back to full speed
    ok = cluster.measure("node0", "node1", nbytes=1_000_000, pings=2)  # and the cable carries data again
    assert 0 < ok["mbit_per_s"] <= 1.2 * 200, ok


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_set_link_delay(cluster):
    base = cluster.measure("node0", "node1", nbytes=10_000, pings=10)["rtt_ms"]
    if netem_available() is False:
        # This kernel lacks netem: the request is refused by name and nothing changes.
        with pytest.raises(
            DelayUnsupported,
            match=r"cannot set delay_ms=5 on eth0 in ta\d+-\d+-n1: this kernel "
            r"has no netem qdisc \(CONFIG_NET_SCH_NETEM\); rate shaping still works",
        ):
            cluster.set_link("node1", delay_ms=5)
        assert cluster.link_shape("node1") == LinkShape(200.0, 0.25)
        return
    try:
        cluster.set_link("node1", delay_ms=5)
        slow = cluster.measure("node0", "node1", nbytes=10_000, pings=10)["rtt_ms"]
        assert slow - base >= 0.8 * 2 * 5, (base, slow)  # each end delays its egress: +2 x 5 ms per round trip
    finally:
        cluster.set_link("node1", delay_ms=0.25)


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_spine_link_carries_cross_leaf_traffic_and_can_be_slowed():
    links_before = _root_links()
    with EmulatedCluster(load_topology_file(TOPO_2LEAF)) as cl:
        assert [n.leaf for n in cl.nodes] == ["leaf0", "leaf0", "leaf1", "leaf1"]
        b = cl.counters()
        cl.measure("node0", "node1", nbytes=1_000_000, pings=2)  # same leaf
        mid = cl.counters()
        cl.measure("node0", "node2", nbytes=1_000_000, pings=2)  # through the spine
        end = cl.counters()
        prefix = cl.layout.prefix
        cl.set_spine("leaf1", rate_mbit=50)  # a degraded leaf uplink
        assert cl.link_shape("leaf1:spine") == LinkShape(50, 0.25)
        sp = next(s for s in cl.layout.spines if s.leaf == "leaf1")
        assert (_kernel_rate_mbit(cl.layout.switch_ns, sp.leaf_port),
                _kernel_rate_mbit(cl.layout.switch_ns, sp.spine_port)) == (50.0, 50.0)
        slow = cl.measure("node3", "node1", nbytes=1_000_000, pings=5)
    assert 0 < slow["mbit_per_s"] <= 1.25 * 50, slow
    assert mid.minus(b).cross_leaf_bytes < 10_000
    across = end.minus(mid)
    assert 1_000_000 <= across.link("leaf0:spine").tx_bytes <= 1_050_000
    assert 1_000_000 <= across.link("node2").rx_bytes <= 1_050_000
    assert [n for n in list_namespaces() if n.startswith(prefix + "-")] == []
    assert _root_links() == links_before


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(90)
def test_partitioned_leaf_and_killed_rank():
    """The fault tools of scripts/fault_soak.py: ``spine_down`` cuts a leaf off the others (its nodes
    still reach each other), ``spine_up`` heals it; ``kill_rank`` SIGKILLs the rank's own process."""
    with EmulatedCluster(load_topology_file(TOPO_2LEAF)) as cl:
        cl.spine_down("leaf1")
        assert cl.measure("node2", "node3", nbytes=100_000, pings=1)["mbit_per_s"] > 0  # inside the island
        with pytest.raises(EmulationError, match="probe node0 -> node2 failed"):
            cl.measure("node0", "node2", nbytes=100_000, pings=1, probe_timeout=2)
        cl.spine_up("leaf1")
        assert cl.measure("node0", "node2", nbytes=100_000, pings=1)["mbit_per_s"] > 0
        # rank 2 with a helper of its own (same environment): only the rank's process is the rank
        job = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(60)']); time.sleep(60)")
        proc = cl.popen("node2", [sys.executable, "-c", job], env={**os.environ, "RANK": "2"})
        deadline = time.monotonic() + 30
        while len(namespace_pids(cl.node("node2").ns)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = cl.rank_pids(2)
        assert len(pids) == 1 and cl.rank_pids(3) == [] and cl.kill_rank(2) == pids
        assert proc.wait(timeout=10) == -signal.SIGKILL or not Path(f"/proc/{pids[0]}").exists()
        prefix = cl.layout.prefix
    assert [n for n in list_namespaces() if n.startswith(prefix + "-")] == []


# -- emulated: every exit path cleans up -------------------------------------------------------------


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_failing_rank_ends_the_run_and_cleans_up():
    links_before = _root_links()
    job = ("import os, sys, time; r = int(os.environ['RANK']); "
           "time.sleep(0.5) if r == 1 else time.sleep(60); sys.exit(3 if r == 1 else 0)")
    t0 = time.monotonic()
    p = _emulate("--topology", str(TOPO_2X2), "--", PY, "-c", job)
    _, err = p.communicate(timeout=50)
    assert p.returncode == 3, err
    assert time.monotonic() - t0 < 30  # the sleeping ranks were killed, not waited for
    assert "failed: node0 r1 exited 3 (exit 3)" in err
    _assert_nothing_left(p.pid, links_before)


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_timeout_kills_and_cleans_up():
    links_before = _root_links()
    p = _emulate("--topology", str(TOPO_2X2), "--timeout", "1.5", "--", "sleep", "60")
    _, err = p.communicate(timeout=50)
    assert p.returncode == 124, err
    assert "timeout after 1.5 s" in err
    _assert_nothing_left(p.pid, links_before)


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_emulate_cleans_up(sig):
    links_before = _root_links()
    p = _emulate("--topology", str(TOPO_2X2), "--", "sleep", "60")
    deadline = time.monotonic() + 30
    while len(_marked_pids(f"ta{p.pid}-")) < 4:  # all four ranks are running inside the namespaces
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.1)
    assert len(_ours(p.pid)) == 3  # switch + 2 nodes
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig, err
    assert f"topo-align emulate: stopped by signal {int(sig)} after " in err and "Traceback" not in err
    _assert_nothing_left(p.pid, links_before)


@needs_netns
@pytest.mark.emulated
@pytest.mark.timeout(60)
def test_cleanup_removes_leftovers_of_a_killed_run():
    # A run killed with SIGKILL cannot clean up: emulate that with a cluster whose owner pid is dead.
    dead = 4_000_000
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    cl = EmulatedCluster(load_topology_file(TOPO_2X2), prefix=f"ta{dead}-0")
    cl.start()
    sleeper = cl.popen("node0", ["sleep", "60"])
    cl._open = False  # forget it, as a SIGKILLed emulator would  # noqa: SLF001
    assert len([n for n in list_namespaces() if n.startswith(f"ta{dead}-")]) == 3
    p = subprocess.run([PY, "-m", "topo_integrations.emulate", "--cleanup"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("removed ") and f"ta{dead}-0-n0" in p.stdout
    assert [n for n in list_namespaces() if n.startswith(f"ta{dead}-")] == []
    sleeper.wait(timeout=10)  # killed by the cleanup (it ran inside a leftover namespace)
    assert not any(Path("/etc/netns").glob(f"ta{dead}-*"))
