"""scripts/gpu_check.sh and its parts (docs/reliability.md, "GPU check") without a GPU: the arguments,
the refusal on a machine without one, the plan for a given GPU count, the table, how a world's
records become results, the sync attribution and the bandwidth arithmetic; and the adapter cases on
4 gloo ranks on CPU (the code the GPU run executes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the check's modules import each other by name

import gpu_bandwidth  # noqa: E402
import gpu_check  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_sync  # noqa: E402
import gpu_world  # noqa: E402
from gpu_plan import Result  # noqa: E402

# the checkout first; the suite's own entries (tests/site, scripts/test.sh) kept after it
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           DS_ACCELERATOR="cpu", PYTHON=sys.executable)


def _run(*cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _ids(gpus: int, **kw) -> list[str]:
    return [c.id for c, why in gpu_plan.plan(gpus, **kw) if why is None]


# -- arguments ------------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_an_unknown_case_is_refused_before_torch_is_imported():
    code = ("import sys; sys.path.insert(0, 'scripts'); import gpu_check; "
            "rc = gpu_check.main(['--cases', 'streams@nccl1, zero4']); print(rc, 'torch' in sys.modules)")
    out = _run(sys.executable, "-c", code, timeout=50)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert out.stderr == gpu_plan.unknown_message(["zero4"]) + "\n"
    assert out.stderr.startswith("gpu_check: unknown case(s) ['zero4']; expected some of ['wire-bandwidth', "
                                 "'streams@nccl1', ")


def test_the_arguments():
    args = gpu_check.parse_args([])
    assert (args.cases, args.out, args.list, args.device, args.bandwidth_floor) == ("", None, False, "cuda", 0.8)
    assert gpu_check.wanted_cases(" abort@nccl1,streams@nccl1,,abort@nccl1 ") == ["abort@nccl1", "streams@nccl1"]
    args = gpu_check.parse_args(["--out", "x.json", "--device", "cpu", "--bandwidth-floor", "0.5"])
    assert (args.out, args.device, args.bandwidth_floor) == ("x.json", "cpu", 0.5)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "tpu"])


def test_list_prints_every_case(capsys):
    assert gpu_check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.id in out for c in gpu_plan.CASES)
    assert "not run on gloo with CUDA tensors: megatron-ddp-hierarchical:" in out


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_says_so_and_exits_3(tmp_path):
    out = _run("bash", "scripts/gpu_check.sh", "--out", str(tmp_path / "r.json"), timeout=110)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout == ""
    assert out.stderr == gpu_plan.no_gpu_message(torch.__version__, torch.version.cuda) + "\n"
    assert not (tmp_path / "r.json").exists()  # nothing ran: no result to commit


def test_the_messages_without_a_gpu():
    assert gpu_plan.no_gpu_message("2.13.0+cpu", None) == (
        "gpu_check: no GPU: torch 2.13.0+cpu is a CPU build (torch.version.cuda is None); run it where a GPU is "
        "visible, with a CUDA build of torch (PYTHON=/path/to/python bash scripts/gpu_check.sh); nothing was run")
    assert gpu_plan.no_gpu_message("2.13.0+cu128", "12.8") == (
        "gpu_check: no GPU: torch 2.13.0+cu128 (CUDA 12.8) sees no GPU (torch.cuda.is_available() is False); run it "
        "where a GPU is visible, with a CUDA build of torch (PYTHON=/path/to/python bash scripts/gpu_check.sh); "
        "nothing was run")


# -- the plan ---------------------------------------------------------------------------------------------------

ADAPTERS = ("grouped-reducer", "ddp-hook", "deepspeed", "megatron")


def test_one_gpu_plans_world_1_nccl_and_gloo_on_cuda():
    ids = _ids(1)
    assert {f"{a}@nccl1" for a in ADAPTERS} | {f"sync-debug-{a}@nccl1" for a in ADAPTERS} <= set(ids)
    assert {"wire-bandwidth", "streams@nccl1", "abort@nccl1", "grouped-reducer-hierarchical@gloo4",
            "ddp-hook-selective@gloo4", "deepspeed-zero3-hierarchical@gloo4",
            "megatron-ddp-selective@gloo4"} <= set(ids)
    cases = [c for c, _ in gpu_plan.plan(1)]
    assert {(c.backend, c.world) for c in cases} == {("-", 1), ("nccl", 1), ("gloo", 4)}
    assert all(c.gpus_needed == 1 for c in cases)
    assert _ids(0) == []


def test_two_gpus_add_the_nccl_pair_and_four_every_adapter_on_nccl():
    one, two, four = set(_ids(1)), set(_ids(2)), set(_ids(4))
    assert two - one == {"engine@nccl2", "abort-peer@nccl2"} and one <= two
    added = four - two
    assert {c.split("@")[1] for c in added} == {"nccl4"}
    assert {f"sync-debug-{a}@nccl4" for a in ADAPTERS} <= added
    assert {"grouped-reducer-default@nccl4", "deepspeed-zero3-hierarchical@nccl4",
            "megatron-distopt-hierarchical@nccl4", "megatron-distopt-selective@nccl4"} <= added
    assert _ids(8) == _ids(4)
    # the gloo set leaves out what gloo cannot do with CUDA tensors, each with its reason
    assert "megatron-ddp-hierarchical@gloo4" not in one and ("megatron-ddp-hierarchical", "gloo") in gpu_plan.EXCLUDED


def test_a_case_that_cannot_run_here_fails_with_the_reason():
    got = [(c.id, why) for c, why in gpu_plan.plan(1, ["streams@nccl1", "ddp-hook-selective@nccl4", "engine@nccl2"])]
    assert got == [("streams@nccl1", None), ("engine@nccl2", "needs 2 GPUs (one per NCCL rank), found 1"),
                   ("ddp-hook-selective@nccl4", "needs 4 GPUs (one per NCCL rank), found 1")]
    cpu = dict((c.id, why) for c, why in gpu_plan.plan(0, ["streams@nccl1", "ddp-hook-selective@gloo4"], cpu=True))
    assert cpu == {"streams@nccl1": "needs CUDA (--device cpu runs only the gloo adapter cases, on CPU)",
                   "ddp-hook-selective@gloo4": None}
    assert all(c.endswith("@gloo4") for c in _ids(0, cpu=True))


def test_cases_of_one_family_world_and_backend_share_a_world():
    cases = [c for c, _ in gpu_plan.plan(1)]
    worlds = gpu_plan.worlds(cases)
    assert [c for w in worlds for c in w] == cases
    assert all(len({c.key for c in w}) == 1 for w in worlds)
    assert [w[0].id for w in worlds] == ["wire-bandwidth", "streams@nccl1", "sync-debug-grouped-reducer@nccl1",
                                         "abort@nccl1", "grouped-reducer-hierarchical@gloo4",
                                         "deepspeed-zero0-hierarchical@gloo4", "megatron-ddp-selective@gloo4"]
    assert gpu_plan.world_timeout_s(worlds[1]) == sum(c.timeout_s for c in worlds[1]) + gpu_plan.START_S
    assert len({c.id for c in gpu_plan.CASES}) == len(gpu_plan.CASES)


# -- the table, the exit status, the JSON --------------------------------------------------------------------

def _case(case_id: str) -> gpu_plan.Case:
    return next(c for c in gpu_plan.CASES if c.id == case_id)


def test_the_table_and_the_exit_status():
    res = [Result(_case("streams@nccl1"), "PASS", 1.234, "value 3"),
           Result(_case("engine@nccl2"), "FAIL", 0.0, "cannot run here: needs 2 GPUs (one per NCCL rank), found 1")]
    lines = gpu_plan.table(res).splitlines()
    assert lines[0].split() == ["case", "world", "backend", "result", "seconds", "detail"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split()[:6] == ["streams@nccl1", "1", "nccl", "PASS", "1.2", "value"]
    assert lines[3].split()[:5] == ["engine@nccl2", "2", "nccl", "FAIL", "0.0"] and lines[3].endswith("found 1")
    assert lines[2].index("value") == lines[0].index("detail") == lines[3].index("cannot")
    assert gpu_plan.summary_line(res, 61.2) == "gpu_check: 1 passed, 1 failed in 61 s"
    assert gpu_plan.exit_code(res) == 1 and gpu_plan.exit_code(res[:1]) == 0 and gpu_plan.exit_code([]) == 1
    long = Result(_case("abort@nccl1"), "PASS", 0.0, "x" * 300)
    assert gpu_plan.table([long]).splitlines()[2].endswith("x" * 97 + "...")
    assert res[1].as_dict() == {"case": "engine@nccl2", "name": "engine", "world": 2, "backend": "nccl",
                                "result": "FAIL", "seconds": 0.0, "detail": res[1].detail, "data": {}}


def test_a_worlds_records_become_results():
    cases = [_case(i) for i in ("streams@nccl1", "grouped-reducer@nccl1", "ddp-hook@nccl1", "deepspeed@nccl1")]
    cases = [gpu_plan.Case(c.name, c.family, 2, c.backend, c.timeout_s, c.what) for c in cases]  # two ranks
    a, b, c, d = (x.id for x in cases)

    def end(case, status, detail, s=1.0):
        return {"case": case, "event": "end", "status": status, "detail": detail, "seconds": s, "data": {"k": 1}}

    start = lambda case: {"case": case, "event": "start"}  # noqa: E731
    records = [[start(a), end(a, "PASS", "ok 0"), start(b), end(b, "PASS", "ok"), start(c)],
               [start(a), end(a, "PASS", "ok 1", 2.0), start(b), end(b, "FAIL", "bad: x")]]
    done, left = gpu_world.merge(cases, records, "rank 1 died with exit code 124")
    assert [(r.case.id, r.result, r.detail, r.seconds) for r in done] == [
        (a, "PASS", "ok 0", 2.0), (b, "FAIL", "bad: x [rank 1]", 1.0),
        (c, "FAIL", "ranks [0, 1] did not finish it: rank 1 died with exit code 124", 0.0)]
    assert done[0].data == {"k": 1} and left == [cases[3]]


def stand_in(name: str, rank: int, dev):
    """A rank-side runner for the test below: ``hang`` outlives its limit, ``boom`` raises."""
    import time

    if name == "hang":
        time.sleep(60)
    if name == "boom":
        raise ValueError("boom\nsecond line")
    return "PASS", f"{name} on {dev}", {"rank": rank}


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_case_past_its_limit_fails_and_the_rest_run_in_a_new_world():
    fam = "test_gpu_check:stand_in"
    limits = (("hang", 3.0), ("ok", 120.0), ("boom", 120.0))  # x4 on the CPU (gpu_world.CPU_LIMIT_SCALE)
    cases = [gpu_plan.Case(n, fam, 1, "gloo", limit, "") for n, limit in limits]
    seen = []
    res = gpu_world.run_cases(cases, kind="cpu", env={"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'scripts'}"},
                              report=seen.append)
    got = [(r.case.name, r.result, r.detail) for r in res]
    assert got == [("hang", "FAIL", "timed out: still running after the case's limit of 12 s [rank 0]"),
                   ("ok", "PASS", "ok on cpu"), ("boom", "FAIL", "ValueError: boom [rank 0]")], got
    assert seen == res and res[1].data == {"rank": 0}


# -- the sync attribution and the bandwidth arithmetic ----------------------------------------------------------

def test_a_synchronisation_is_owned_by_the_innermost_frame_outside_torch():
    rules = [("/r/scripts", "harness"), ("/r/topo_integrations/megatron/testing.py", "harness"),
             ("/r/topo_integrations", "topo-align"), ("/sp/deepspeed", "deepspeed")]
    skip = ["/sp/torch"]
    loop, ours = ("/r/scripts/gpu_sync.py", 10, "step"), ("/r/topo_integrations/reducer/engine/engine.py", 5, "f")
    torch_fn, ds = ("/sp/torch/optim/adam.py", 7, "step"), ("/sp/deepspeed/runtime/engine.py", 9, "step")
    inner = ("/sp/torch/optim/_functional.py", 2, "adam")
    assert gpu_sync.owner([loop, ours], rules, skip) == ("topo-align", f"{ours[0]}:5 f")
    assert gpu_sync.owner([loop, ours, torch_fn], rules, skip) == ("topo-align", f"{ours[0]}:5 f")
    assert gpu_sync.owner([loop, ds, torch_fn], rules, skip) == ("deepspeed", f"{ds[0]}:9 step")
    assert gpu_sync.owner([loop, torch_fn, inner], rules, skip) == ("torch", f"{inner[0]}:2 adam")
    assert gpu_sync.owner([loop], rules, skip) == ("harness", f"{loop[0]}:10 step")
    harness = ("/r/topo_integrations/megatron/testing.py", 3, "run_iteration")
    assert gpu_sync.owner([loop, ours, harness], rules, skip)[0] == "harness"
    assert gpu_sync.owner([("/py/threading.py", 1, "run")], rules, skip)[0] == "harness"


def test_the_sync_verdict():
    status, detail, data = gpu_sync._verdict("warn", [("deepspeed", "a:1 f"), ("deepspeed", "b:2 g")], None)
    assert status == "PASS" and "no synchronisation in topo-align's code; others: deepspeed 2 (first a:1 f)" in detail
    assert data["syncs"] == {"deepspeed": 2}
    status, detail, _ = gpu_sync._verdict("warn", [("topo-align", "t:3 h")], None)
    assert status == "FAIL" and "topo-align synchronised 1x, first at t:3 h" in detail
    status, detail, data = gpu_sync._verdict("error", [], ("torch", "x:1 y"))
    assert status == "FAIL" and detail == "mode 'error': the step synchronised in torch's code at x:1 y"


class _Props:
    def __init__(self, name, clock_khz=0, bus_bits=0):
        self.name, self.memory_clock_rate, self.memory_bus_width = name, clock_khz, bus_bits


def test_the_nominal_hbm_bandwidth_and_the_bytes_charged():
    gbps, source = gpu_bandwidth.nominal_hbm_gbps(_Props("NVIDIA H100 80GB HBM3", 2_619_000, 5120))
    assert round(gbps) == 3352 and source.startswith("device properties: 5120-bit bus at 2619 MHz")
    assert gpu_bandwidth.nominal_hbm_gbps(_Props("NVIDIA H100 80GB HBM3")) == (3350.0, "published figure for "
                                                                               "H100 80GB HBM3")
    assert gpu_bandwidth.nominal_hbm_gbps(_Props("NVIDIA H200"))[0] == 4800.0
    assert gpu_bandwidth.nominal_hbm_gbps(_Props("Tesla T4"))[0] is None
    n = 1 << 20
    assert gpu_bandwidth.min_bytes("pack", n) == 9 * n + n // 64
    assert gpu_bandwidth.min_bytes("unpack", n) == 5 * n + n // 64
    assert gpu_bandwidth.min_bytes("owner-sum", n, members=8) == n + n // 64 + n // 2
    with pytest.raises(ValueError):
        gpu_bandwidth.min_bytes("copy", n)


# -- the adapter cases on CPU ----------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_the_driver_runs_its_cases_on_gloo_and_cpu(tmp_path):
    """Four adapter cases on 4 gloo ranks on CPU: hierarchical equals the flat all-reduce within 1e-6,
    the selective invariants hold, method auto times and chooses; a line each, the table, the summary
    and the JSON."""
    want = ["grouped-reducer-hierarchical@gloo4", "grouped-reducer-auto@gloo4", "ddp-hook-selective@gloo4",
            "deepspeed-zero1-selective@gloo4"]
    out = _run(sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--cases", ",".join(want),
               "--out", str(tmp_path / "r.json"), timeout=590)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert sorted(ln.split(" ")[:2] for ln in lines[:4]) == sorted(["PASS", c] for c in want)
    table = lines[lines.index("") + 1:]
    assert [row.split()[:4] for row in table[2:6]] == [[c, "4", "gloo", "PASS"] for c in want]
    assert "grad rel err vs flat all-reduce" in table[2] and "broken: []" in table[5]
    assert "on every rank True, compute per step" in table[3] and "(timed on t" in table[3]
    assert table[6].startswith("gpu_check: 4 passed, 0 failed in ")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["format"] == "topo-align/gpu-check/v1" and rep["device"] == "cpu" and rep["exit"] == 0
    assert [(r["case"], r["result"]) for r in rep["results"]] == [(c, "PASS") for c in want]
