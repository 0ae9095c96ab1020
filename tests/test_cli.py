"""`topo-align` end to end: subprocess runs for exit codes and the one-line error contract, in-process
`main()` runs for the output of each subcommand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from topo_integrations.cli import main
from topo_integrations.topology.hostfile import parse_hostfile


def make_sysfs(root: Path) -> Path:
    """The DGX A100 sysfs of ib-discovery-examples.txt: 9 healthy HDR ports, mlx5_5 down."""
    for i in range(10):
        p = root / f"mlx5_{i}" / "ports" / "1"
        p.mkdir(parents=True)
        down = i == 5
        (p / "state").write_text("1: DOWN\n" if down else "4: ACTIVE\n")
        (p / "phys_state").write_text("3: Disabled\n" if down else "5: LinkUp\n")
        (p / "rate").write_text("10 Gb/sec (4X SDR)\n" if down else "200 Gb/sec (4X HDR)\n")
        (p / "link_layer").write_text("Ethernet\n" if down else "InfiniBand\n")
    return root

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).parents[1]
FIX = Path(__file__).parent / "fixtures" / "topology"
SUPERPOD = ROOT / "configs" / "topologies" / "dgx-a100-superpod-960.json"


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, COLUMNS="200")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "topo_integrations.cli", *args], capture_output=True, text=True,
                          env=e, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["plan", "bogus"], "source 'bogus': expected KIND:PATH"),
        (["plan", "file:/nonexistent.json"], "cannot read topology file"),
        (["show", f"nvidia-smi:{FIX / 'topology.conf'}"], "no header row starting with 'GPU0'"),
        (["plan", "--group-by", "rack", f"file:{SUPERPOD}"], "argument --group-by: invalid choice: 'rack'"),
        (
            ["plan", "--min-tier-ratio", "0.5", f"file:{SUPERPOD}"],
            "--min-tier-ratio 0.5; expected a number in [1, 1000000]",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
        (["hostfile", "--slots", "0", f"file:{SUPERPOD}"], "--slots 0; expected an integer in [1, 4096]"),
        (["show", "--plot", "/tmp/x.svg", f"file:{SUPERPOD}"], "expected a file name ending in .png"),
        (["doctor", "--sysfs-root", "/nonexistent-dir"], "--sysfs-root '/nonexistent-dir': not a directory"),
    ],
)
def test_bad_input_exit_2_one_line_no_traceback(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("topo-align: error: "), r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr and r.stdout == ""


def test_plan_json_superpod_subprocess():
    r = run_cli("plan", f"file:{SUPERPOD}", "--json", "--middle-level")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["shape"]["intra_groups"] == {"count": 120, "sizes": [8]}
    assert out["shape"]["inter_groups"] == {"count": 8, "sizes": [120]}
    assert out["shape"]["leaf_rails"] == {"count": 48, "sizes": [20]}
    assert out["shape"]["spine_rails"] == {"count": 160, "sizes": [6]}
    assert out["plan"]["hierarchical"] is True and out["plan"]["middle_level"] is True
    assert out["topology"]["world_size"] == 960


def test_optional_subcommands_not_built(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def fake(name, *a, **k):
        if name.startswith(("topo_integrations.sim", "topo_integrations.emulate", "topo_integrations.bench")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    for cmd in ("simulate", "emulate", "bench"):
        assert main([cmd, "--anything", "x"]) == 2
        assert capsys.readouterr().err.strip() == f"topo-align {cmd}: not built yet"


def test_plan_table_and_sources_in_process(capsys):
    assert (
        main(["plan", f"slurm:{FIX / 'topology.conf'},dgx[001-040]", f"nccl-xml:{FIX / 'nccl-topo-dgx-a100.xml'}"]) == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "hierarchical -- 40 islands of 8 ranks" in out and "intra_groups" in out


@pytest.mark.parametrize("sources,opts,islands,size", [
    ([f"nvidia-smi:{FIX / 'nvidia-smi-topo-dgx-a100.txt'}"], ["--nodes", "4"], 4, 8),
    ([f"nvidia-smi:{FIX / 'nvidia-smi-topo-dgx-h100.txt'}"], ["--nodes", "16"], 16, 8),
    ([f"nvidia-smi:{FIX / 'nvidia-smi-topo-dgx1v-mlx5.txt'}"], ["--nodes", "dgx1-[01-03]"], 3, 8),
    ([f"nvidia-smi:{FIX / 'nvidia-smi-topo-bridged-pairs.txt'}"], ["--nodes", "2"], 4, 2),
    ([f"nccl-xml:{FIX / 'nccl-topo-dgx-a100.xml'}"], ["--nodes", "2"], 2, 8),
    ([f"slurm:{FIX / 'topology.conf'}"], [], 120, 8),
])
def test_plan_json_for_fixtures(capsys, sources, opts, islands, size):
    assert main(["plan", *sources, *opts, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shape"]["intra_groups"] == {"count": islands, "sizes": [size]}
    assert out["shape"]["inter_groups"] == {"count": size, "sizes": [islands]}


def test_show_json_and_plot(tmp_path, capsys):
    png = tmp_path / "t.png"
    assert (
        main(["show", f"file:{ROOT / 'configs/topologies/bridged-pairs-8x4.json'}", "--json", "--plot", str(png)]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["topology"]["islands"] == 16 and out["topology"]["island_sizes"] == [2]
    assert out["leaves"] == [{"hosts": "ws[01-08]", "leaf": "leaf0", "n_hosts": 8, "pod": "pod0", "ranks": 32}]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["show", f"file:{SUPERPOD}"]) == 0
    assert "dgx[001-020]" in capsys.readouterr().out


def test_hostfile_writes_recommended_order(tmp_path, capsys):
    conf = FIX / "topology.conf"
    assert main(["hostfile", f"slurm:{conf},dgx[041,001,042,002]", "--gpus-per-node", "4"]) == 0
    text = capsys.readouterr().out
    assert text == "dgx041 slots=4\ndgx042 slots=4\ndgx001 slots=4\ndgx002 slots=4\n"
    out = tmp_path / "hostfile"
    assert main(["hostfile", f"slurm:{conf},dgx[041,001]", "--slots", "8", "-o", str(out)]) == 0
    assert [(h.host, h.gpus) for h in parse_hostfile(out.read_text())] == [("dgx041", 8), ("dgx001", 8)]


def test_schema(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "TopoAlignConfig" and "topology" in schema["properties"]


def test_doctor_flags_bad_settings(tmp_path, capsys, monkeypatch):
    root = make_sysfs(tmp_path / "ib")
    for k in list(os.environ):
        if k.startswith(("NCCL_", "UCX_", "TORCH_NCCL_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NCCL_ALGO", "TOPO_AWARE")
    monkeypatch.setenv("NCCL_TIMEOUT", "600s")
    monkeypatch.setenv("NCCL_NSOCKS_PERTHREAD", "8")
    monkeypatch.setenv("NCCL_SOCKET_NTHREADS", "4")
    monkeypatch.setenv("UCX_TLS", "rc_x")
    rc = main(["doctor", "--json", "--sysfs-root", str(root), f"file:{SUPERPOD}"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["errors"] == 1
    by = {f["what"]: f for f in out["findings"]}
    assert by["NCCL_ALGO"]["level"] == "error" and "'TOPO_AWARE' is not an NCCL algorithm" in by["NCCL_ALGO"]["detail"]
    assert "leave NCCL_ALGO unset" in by["NCCL_ALGO"]["fix"]
    assert by["NCCL_TIMEOUT"]["level"] == "warn" and "init_process_group(timeout=" in by["NCCL_TIMEOUT"]["fix"]
    assert by["NCCL_NSOCKS_PERTHREAD,NCCL_SOCKET_NTHREADS"]["level"] == "warn"
    assert "no effect on NCCL" in by["UCX_TLS"]["detail"]
    assert by["mlx5_5 port 1"]["level"] == "warn" and by["mlx5_0 port 1"]["level"] == "ok"
    assert len(out["ib_ports"]) == 10
    assert by["tiers (group_by island)"]["level"] == "ok"
    assert by["tiers (group_by leaf)"]["level"] == "info"  # 1:1 spine: leaf and spine do not differ


def test_doctor_clean_env(tmp_path, capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("NCCL_", "UCX_", "TORCH_NCCL_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NCCL_ALGO", "allreduce:ring,tree;allgather:^nvls")
    monkeypatch.setenv("NCCL_SOCKET_NTHREADS", "17")
    assert main(["doctor", "--json", "--sysfs-root", str(tmp_path)]) == 1
    by = {f["what"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert by["NCCL_ALGO"]["level"] == "info"
    assert by["NCCL_SOCKET_NTHREADS"]["detail"] == "NCCL_SOCKET_NTHREADS=17 > 16 (NCCL's maximum)"
    assert by["infiniband"]["detail"] == f"no InfiniBand devices under {tmp_path}"
    monkeypatch.delenv("NCCL_SOCKET_NTHREADS")
    assert main(["doctor", "--sysfs-root", str(tmp_path)]) == 0
    assert "doctor" in capsys.readouterr().out


def test_doctor_reports_unequal_islands_as_a_finding(tmp_path, capsys):
    topo = tmp_path / "t.json"
    topo.write_text(json.dumps({"leaves": [{"hosts": ["a", {"host": "b", "gpus": 4}]}]}))
    assert main(["doctor", "--json", "--sysfs-root", str(tmp_path), f"file:{topo}"]) in (0, 1)
    by = {f["what"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert by["tiers (group_by island)"]["level"] == "warn"
    assert "unequal sizes (1 x 8, 1 x 4 ranks" in by["tiers (group_by island)"]["detail"]


def test_show_and_hostfile_with_unequal_islands(tmp_path, capsys):
    topo = tmp_path / "t.json"
    topo.write_text(json.dumps({"leaves": [{"name": "L1", "hosts": ["a", {"host": "b", "gpus": 4}]},
                                           {"name": "L0", "hosts": "c"}]}))
    png = tmp_path / "u.png"
    assert main(["show", f"file:{topo}", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["topology"]["island_sizes"] == [4, 8] and "unequal sizes" in out["plan_error"]
    assert png.exists()
    assert main(["hostfile", f"file:{topo}"]) == 0
    assert capsys.readouterr().out == "a slots=8\nb slots=4\nc slots=8\n"
    assert main(["plan", f"file:{topo}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("topo-align: error: ") and "(2 x 8, 1 x 4 ranks" in err[0]


@pytest.mark.parametrize("source", ["file:/dev/zero", "nvidia-smi:/dev/zero", "nccl-xml:/dev/urandom"])
def test_endless_files_are_refused(capsys, source):
    assert main(["plan", source]) == 2
    assert "more than" in capsys.readouterr().err
