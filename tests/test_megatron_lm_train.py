"""Megatron-LM's own, unmodified ``pretrain_gpt.py`` with the ``--topo-align*`` flags, end to end on
CPU: 4 gloo ranks as 2 virtual nodes x 2 (topology file ``configs/topologies/virtual-2x2.json``, or
the launch script's ``--virtual-nodes``), a 2-layer GPT, 6 iterations of 2 micro-batches per rank.

Every run goes through the project's launcher (``python -m topo_integrations.megatron``, here via
tests/_megatron_lm_probe.py, which records per-step invariants and the final parameters; one run
through ``scripts/pretrain_gpt_megatron.sh --megatron-lm DIR``, which uses torchrun). One probe
server imports Megatron-LM once and forks the 4 ranks of each of its runs, and every run has
``TORCH_COMPILE_DISABLE=1`` (see ``_env``). A run still costs many seconds on 2 cores, so there are
seven, each checked for several things:

=========== ============================================== ===========================================
run         what                                           checked
=========== ============================================== ===========================================
stock       no --topo-align, plain DDP, --mock-data        reference parameters; loss falls
hier-script hierarchical, plain DDP, the launch script     parameters == stock (1e-6), via --save
hier-dopt   hierarchical, --use-distributed-optimizer      parameters == stock (1e-6); the instance
            without --num-distributed-optimizer-instances  count derived from the topology (logged)
sel-ddp     selective, plain DDP, indexed dataset, async   invariants every step; loss falls; save
            reconcile every 2 steps, --save at 4 (in       reconciles (all ranks equal)
            flight)
sel-ddp-res --load at 4 of sel-ddp                         parameters == sel-ddp's (bitwise)
sel-dopt    selective, distributed optimizer (instances    invariants every step; save reconciles
            given explicitly, = groups), as sel-ddp
sel-dopt-res --load at 4 of sel-dopt                       parameters == sel-dopt's (bitwise)
=========== ============================================== ===========================================

Skipped, with one line, only when no Megatron-LM tree is found (tests/_megatron_lm_tree.py).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from _megatron_lm_tree import ROOT, SKIP_REASON, megatron_lm_tree

MLM = megatron_lm_tree()
pytestmark = [pytest.mark.multirank, pytest.mark.skipif(MLM is None, reason=SKIP_REASON)]

PROBE = ROOT / "tests" / "_megatron_lm_probe.py"
TOPOLOGY = str(ROOT / "configs" / "topologies" / "virtual-2x2.json")
ITERS = 6
# docs/megatron.md ("On CPU"): the flags a CPU run needs, a tiny GPT, no dropout (a resumed run then
# draws nothing an uninterrupted one would not), a constant learning rate (the last step moves the
# parameters too, so a resumed run that saw other data would end elsewhere).
CPU = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-persist-layer-norm",
       "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
       "--no-bias-dropout-fusion", "--no-rope-fusion"]
MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-workers", "0", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
         "64", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", str(ITERS),
         "--eval-iters", "0", "--eval-interval", "1000", "--lr", "3e-3", "--lr-decay-style", "constant",
         "--log-interval", "1",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
SELECTIVE = ["--topo-align", "--topo-align-mode", "selective", "--topo-align-topology", TOPOLOGY,
             "--topo-align-reconcile-interval", "2", "--topo-align-async-reconcile",
             "--topo-align-sync-last-n-layers", "1", "--topo-align-top-fraction", "0"]
DOPT = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


class Run:
    def __init__(self, name: str, out: Path, rc: int, log: str):
        self.name, self.out, self.rc, self.log = name, out, rc, log

    def ok(self) -> "Run":
        assert self.rc == 0, f"{self.name} failed (rc {self.rc}):\n{self.log[-6000:]}"
        return self

    def losses(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in LOSS.findall(self.log)}

    def jsonl(self, name: str) -> list[dict]:
        with open(self.out / name, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh]

    def params(self, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"params_rank{rank}.pt")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC"))}
    # TORCH_COMPILE_DISABLE: Megatron-LM warms its torch.compile fusions up at start (initialize.py,
    # _warmup_jit_function) although the --no-*-fusion flags keep them out of the model; compiling
    # them on CPU costs seconds per rank. Disabled for every run alike (the stock reference too), so
    # the runs compute what they computed before.
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_COMPILE_DISABLE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), MLM, os.environ.get("PYTHONPATH")])))
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(name)``: start that run once (and what it depends on); runs after the first use are cached."""
    base = tmp_path_factory.mktemp("mlm")
    data = base / "stdlib"

    def dataset() -> list[str]:
        if not (base / "stdlib.idx").exists():
            from topo_integrations.train.data import build_indexed_dataset, collect_stdlib_corpus

            build_indexed_dataset(data, collect_stdlib_corpus(150_000))  # byte tokens: 256 = EOD
        return ["--data-path", str(data), "--split", "100,0,0", "--data-cache-path", str(base / "cache")]

    # One probe server for the module's runs: it imports Megatron-LM once (4 of a run's 6 to 10 CPU
    # seconds) and forks each run's 4 ranks from it (the launch script's run below still goes
    # through torchrun's own interpreters).
    server = subprocess.Popen([sys.executable, str(PROBE), "--serve", "4"], cwd=ROOT, env=_env(), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(base / "server.log", "w"),
                              start_new_session=True)

    def probe(name: str, flags: list[str]) -> Run:
        out, log = base / name, base / f"{name}.log"
        argv = [str(out), os.path.join(MLM, "pretrain_gpt.py"), *CPU, *MODEL, *flags]
        server.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        server.stdin.flush()
        if select.select([server.stdout], [], [], 240)[0]:
            line = server.stdout.readline()
            rc = json.loads(line)["rc"] if line else -1
            why = "" if line else "the probe server ended:\n" + (base / "server.log").read_text()
        else:  # the server and its ranks are one process group (start_new_session)
            os.killpg(server.pid, signal.SIGKILL)
            rc, why = -1, "timed out after 240 s"
        return Run(name, out, rc, (log.read_text() if log.exists() else "") + why)

    def script(name: str, flags: list[str]) -> Run:
        # The launch script runs `.venv/bin/python` of the checkout it lives in: a scratch checkout
        # whose .venv is this interpreter (as tests/test_docs_commands.py does).
        repo = base / "repo"
        if not repo.exists():
            repo.mkdir()
            (repo / "scripts").symlink_to(ROOT / "scripts")
            if sys.prefix != sys.base_prefix:  # a virtual environment: the whole of it
                (repo / ".venv").symlink_to(sys.prefix)
            else:
                (repo / ".venv" / "bin").mkdir(parents=True)
                (repo / ".venv" / "bin" / "python").symlink_to(sys.executable)
        out = base / name
        cmd = ["bash", str(repo / "scripts" / "pretrain_gpt_megatron.sh"), "--skip-setup", "--megatron-lm", MLM,
               *CPU, *MODEL, *flags, "--save", str(out), "--save-interval", "1000", "--ckpt-format", "torch"]
        proc = subprocess.run(cmd, cwd=repo, env=_env(), capture_output=True, text=True, timeout=240)
        return Run(name, out, proc.returncode, proc.stdout + proc.stderr)

    specs = {
        "stock": lambda: probe("stock", ["--mock-data"]),
        "hier-script": lambda: script("hier-script", ["--mock-data", "--topo-align", "--topo-align-mode",
                                                      "hierarchical"]),
        "hier-dopt": lambda: probe("hier-dopt", ["--mock-data", "--topo-align", "--topo-align-mode", "hierarchical",
                                                 "--topo-align-topology", TOPOLOGY,
                                                 "--use-distributed-optimizer"]),
        "sel-ddp": lambda: probe("sel-ddp", [*dataset(), *SELECTIVE, "--save", str(base / "ck-ddp"),
                                             "--save-interval", "4"]),
        "sel-ddp-res": lambda: probe("sel-ddp-res", [*dataset(), *SELECTIVE, "--load", str(base / "ck-ddp"),
                                                     "--ckpt-step", "4"]),
        "sel-dopt": lambda: probe("sel-dopt", ["--mock-data", *SELECTIVE, *DOPT, "--save", str(base / "ck-dopt"),
                                               "--save-interval", "4"]),
        "sel-dopt-res": lambda: probe("sel-dopt-res", ["--mock-data", *SELECTIVE, *DOPT, "--load",
                                                       str(base / "ck-dopt"), "--ckpt-step", "4"]),
    }
    needs = {"sel-ddp-res": "sel-ddp", "sel-dopt-res": "sel-dopt"}

    @lru_cache(maxsize=None)
    def get(name: str) -> Run:
        if name in needs:
            get(needs[name]).ok()
        return specs[name]()

    yield get
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1).double() for _, p in sorted(params.items())])


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    fa, fb = _flat(a), _flat(b)
    return float((fa - fb).norm() / fb.norm())


def _falls(losses: dict[int, float], by: float) -> None:
    assert sorted(losses) == list(range(1, ITERS + 1)), losses
    assert losses[ITERS] < losses[1] - by and losses[ITERS - 1] < losses[2] - by, losses


@pytest.mark.timeout(600)
def test_stock_reference_trains_on_mock_data(run):
    r = run("stock").ok()
    _falls(r.losses(), 0.3)
    steps = r.jsonl("steps.jsonl")
    assert [s["iteration"] for s in steps] == list(range(1, ITERS + 1))
    assert all(s["all_equal"] and s["type"] == "DistributedDataParallel" for s in steps)


@pytest.mark.timeout(600)
def test_hierarchical_through_the_launch_script_equals_stock(run):
    r, ref = run("hier-script").ok(), run("stock").ok()
    assert "TopoAlignDDP active, mode 'hierarchical': 2 islands of 2 ranks" in r.log
    saved = torch.load(r.out / f"iter_{ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    want = ref.params(0)
    got = {k: saved["model"][k].float() for k in want}
    assert _rel(got, want) <= 1e-6
    assert r.losses() and max(abs(r.losses()[i] - ref.losses()[i]) for i in ref.losses()) < 1e-5


@pytest.mark.timeout(600)
def test_hierarchical_with_the_distributed_optimizer_equals_stock(run):
    r, ref = run("hier-dopt").ok(), run("stock").ok()
    # No --num-distributed-optimizer-instances: derived and said once (TopoAlignDDP refuses any count but 2).
    assert r.log.count("--num-distributed-optimizer-instances not set: using 2, the number of topology groups") == 1
    steps = r.jsonl("steps.jsonl")
    assert all(s["all_equal"] and s["type"] == "TopoAlignDDP" for s in steps)
    assert _rel(r.params(0), ref.params(0)) <= 1e-6


def _invariants(r: Run) -> None:
    """docs/design.md, the invariants: LOCAL equal inside each island every step, SYNC equal everywhere every
    step, the islands apart between reconciliations (a positive control), and every parameter equal
    on every rank after the reconciliation a save forces (the probe looks inside save_checkpoint)."""
    steps = r.jsonl("steps.jsonl")
    assert [s["iteration"] for s in steps] == list(range(1, ITERS + 1))
    assert all(s["islands_equal"] and s["sync_equal"] and s["type"] == "TopoAlignDDP" for s in steps), steps
    assert all(s["n_local"] > 0 and s["n_sync"] > 0 for s in steps)
    assert not all(s["all_equal"] for s in steps)  # LOCAL parameters did drift apart between reconciliations
    assert steps[-1]["reconciles"] >= 3  # every 2 steps (async) + the one the save forced
    assert r.jsonl("saves.jsonl")[0] == {"iteration": 4, "all_equal": True}


@pytest.mark.timeout(600)
def test_selective_plain_ddp_keeps_the_invariants_and_learns_an_indexed_dataset(run):
    r = run("sel-ddp").ok()
    _invariants(r)
    _falls(r.losses(), 0.3)


@pytest.mark.timeout(600)
def test_selective_distributed_optimizer_keeps_the_invariants(run):
    r = run("sel-dopt").ok()
    _invariants(r)
    _falls(r.losses(), 0.3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["sel-ddp", "sel-dopt"])
def test_resume_from_megatron_lm_checkpoint_equals_uninterrupted(run, name):
    """Saved at iteration 4 with an asynchronous reconciliation in flight (started at step 4), resumed
    with --load through Megatron-LM's own torch_dist checkpointing (plugin state per rank in
    iter_0000004/topo_align/): every rank ends with bitwise the parameters of the run that went on."""
    ref, res = run(name).ok(), run(f"{name}-res").ok()
    ck = ref.out.parent / ("ck-ddp" if name == "sel-ddp" else "ck-dopt")
    assert re.search(rf"successfully loaded checkpoint from {re.escape(str(ck))} .* at iteration 4", res.log)
    assert sorted(os.listdir(ck / "iter_0000004" / "topo_align")) == [f"rank{r}.pt" for r in range(4)]
    assert [s["iteration"] for s in res.jsonl("steps.jsonl")] == [5, 6]
    for rank in range(4):
        a, b = ref.params(rank), res.params(rank)
        assert all(torch.equal(a[k], b[k]) for k in a), (rank, [k for k in a if not torch.equal(a[k], b[k])])
    # Megatron-LM logs another loss at the LAST iteration of a resumed run than of the uninterrupted
    # one, with stock Megatron too (6.213849 vs 6.179495, bitwise equal parameters after that step):
    # its logging, not the training; the iterations before it must match.
    assert sorted(res.losses()) == [5, 6] and res.losses()[5] == ref.losses()[5]
