"""Hugging Face ``transformers.Trainer`` and ``accelerate`` with a "topo_align" block (issue 32).

4 gloo ranks (CPU, ``DS_ACCELERATOR=cpu``) start ONCE for the module, as 2 virtual nodes x 2 ranks
(``TOPO_ALIGN_HOSTNAME`` per rank; ``topology.source`` left at its default, ``auto``). Each rank calls
``topo_integrations.deepspeed.install()`` and then runs, unchanged, what a user runs: a tiny Llama
causal LM through ``Trainer(args=TrainingArguments(deepspeed=<configs/hf/*.json>))`` and through
``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``. The tests assert on what the
ranks return: the engine is topo-align's, hierarchical equals stock DeepSpeed, selective keeps its
invariants on every step and puts fewer bytes on the slow tier than a flat all-reduce.

Skipped only where transformers or accelerate is not installed (both are pinned in
constraints.txt and installed by scripts/setup_env.sh, the "hf" extra).
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from topo_integrations.testing import run_world  # noqa: E402

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {mode: ROOT / "configs" / "hf" / f"zero2-{mode}.json" for mode in ("hierarchical", "selective")}
STEPS = 8


def _stock(path: Path) -> dict:
    """The same DeepSpeed config without its "topo_align" block: stock DeepSpeed."""
    ds = json.loads(path.read_text())
    ds.pop("topo_align")
    return ds


def _flat_params(engine):
    from topo_integrations.deepspeed import harness as H

    return H.flat_params(engine)


def _summary(engine, received: dict | None) -> dict:
    """What a test needs from an engine: its class, the block DeepSpeed received, the statistics."""
    out = {"engine": type(engine).__name__, "optimizer": type(engine.optimizer).__name__,
           "received_block": copy.deepcopy((received or {}).get("topo_align")),
           "n_params": sum(p.numel() for p in engine.module.parameters() if p.requires_grad)}
    if hasattr(engine, "topo_align_stats"):
        stats = engine.topo_align_stats()
        out.update(mode=engine.topo_align.cfg.mode, bytes=stats["total"]["bytes"], steps=engine.topo_align.steps,
                   sync_fraction=engine.topo_align.sync_fraction())
    return out


def _trainer(rank, tmp):
    from topo_integrations.deepspeed import harness as H
    from topo_integrations.deepspeed import hf_harness as HF

    out = {}
    runs = {"stock": _stock(CONFIGS["hierarchical"]), "hierarchical": str(CONFIGS["hierarchical"])}
    for name, ds in runs.items():
        tr = HF.train_trainer(HF.tiny_causal_lm(), ds, os.path.join(tmp, name), STEPS)
        eng = tr.model_wrapped
        out[name] = dict(_summary(eng, tr.accelerator.deepspeed_config), params=_flat_params(eng),
                         loss=tr.state.log_history[-1].get("train_loss"))
    records: list = []
    tr = HF.train_trainer(HF.tiny_causal_lm(), str(CONFIGS["selective"]), os.path.join(tmp, "selective"), STEPS,
                          check=H.selective_checker(records))
    out["selective"] = dict(_summary(tr.model_wrapped, tr.accelerator.deepspeed_config), records=records,
                            dp_world=tr.model_wrapped.dp_world_size)
    return out


def _accelerate(rank):
    from topo_integrations.deepspeed import harness as H
    from topo_integrations.deepspeed import hf_harness as HF

    out = {}
    stock_eng, _, _ = HF.train_accelerate(HF.tiny_causal_lm(), _stock(CONFIGS["hierarchical"]), STEPS)
    out["stock"] = dict(_summary(stock_eng, None), params=_flat_params(stock_eng))
    # A config file path, as `accelerate launch --deepspeed_config_file` hands it over.
    eng, acc, losses = HF.train_accelerate(HF.tiny_causal_lm(), str(CONFIGS["hierarchical"]), STEPS)
    out["hierarchical"] = dict(_summary(eng, acc.deepspeed_config), params=_flat_params(eng), losses=losses)
    records: list = []
    eng, acc, losses = HF.train_accelerate(HF.tiny_causal_lm(), str(CONFIGS["selective"]), STEPS,
                                           check=H.selective_checker(records))
    out["selective"] = dict(_summary(eng, acc.deepspeed_config), records=records, losses=losses)
    return out


def _rank_main(rank, world, tmp):
    warnings.filterwarnings("ignore", category=FutureWarning)
    from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

    os.environ[HOSTNAME_ENV] = f"vnode{rank // 2}"  # 2 virtual nodes x 2 ranks
    import deepspeed.utils.groups as dg

    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness as H
    from topo_integrations.testing import released_groups, thread_count

    H.prepare_cpu()
    tds.install()  # the one line: Trainer and Accelerator call deepspeed.initialize from here on
    out: dict = {"_times": {}}
    from _hf_paths import accelerate_paths, trainer_paths  # issue 39 items 2-3: DDP, FSDP2, the callback

    for name, fn, args in (("trainer", _trainer, (rank, tmp)), ("accelerate", _accelerate, (rank,)),
                           ("accelerate_paths", accelerate_paths, (rank, tmp)),
                           ("trainer_paths", trainer_paths, (rank, tmp))):
        # No per-section try/except: a rank that raises fails the whole world at once (run_world).
        t0 = time.perf_counter()
        # idle gloo groups cost CPU: a section's engines and groups go with it
        with released_groups(keep_held_by=(dg,)), H.released_engines():
            out[name] = fn(*args)
        out["_times"][name] = (round(time.perf_counter() - t0, 1), thread_count())
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf4"))
    t0 = time.perf_counter()
    out = run_world(4, _rank_main, tmp, timeout=480, pg_timeout=120,
                    env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    print(f"hf world: {time.perf_counter() - t0:.1f} s wall; sections (rank 0): {out[0]['_times']}")
    return out


def _rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


# -- no ranks: the ready configs --------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", sorted(CONFIGS))
def test_ready_hf_config_is_valid(mode):
    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed.support import check_supported

    ds = json.loads(CONFIGS[mode].read_text())
    cfg = tds.read_block(ds)
    assert cfg is not None and cfg.enabled and cfg.mode == mode
    check_supported(ds, cfg)
    # HF fills these from TrainingArguments; a config without "auto" would have to match them.
    assert all(ds[k] == "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    # accelerate treats the string "auto" anywhere in the config as its placeholder and stops
    # ("`topo_align.topology.source` not found in kwargs"): the block leaves source at its default.
    assert '"auto"' not in json.dumps(ds["topo_align"])


# -- Trainer ----------------------------------------------------------------------------------------

@pytest.mark.timeout(500)
@pytest.mark.parametrize("front", ["trainer", "accelerate"])
def test_block_reaches_deepspeed_and_the_engine_is_topo_aligns(world, front):
    for mode in ("hierarchical", "selective"):
        rec = world[0][front][mode]
        want = json.loads(CONFIGS[mode].read_text())["topo_align"]
        assert rec["received_block"] == want, rec["received_block"]  # not stripped, not rewritten
        assert rec["engine"] == "TopoAlignDeepSpeedEngine" and rec["optimizer"].startswith("TopoAlign"), rec
        assert rec["mode"] == mode and rec["steps"] == STEPS, rec
    assert world[0][front]["stock"]["engine"] == "DeepSpeedEngine"


@pytest.mark.timeout(500)
@pytest.mark.parametrize("front", ["trainer", "accelerate"])
def test_hierarchical_equals_stock(world, front):
    errs = [_rel_err(out[front]["hierarchical"]["params"], out[front]["stock"]["params"]) for out in world]
    print(f"{front}: hierarchical vs stock, relative parameter error per rank: {errs}")
    # fp32: the hierarchical sum differs from DeepSpeed's one all-reduce only in summation order
    assert max(errs) <= 1e-6, errs
    b = world[0][front]["hierarchical"]["bytes"]
    # the slow tier carried 1/k of what the fast tier did (k = 2 ranks per island)
    assert b["inter"]["sync"] > 0 and b["intra"]["sync"] > b["inter"]["sync"], b


@pytest.mark.timeout(500)
@pytest.mark.parametrize("front", ["trainer", "accelerate"])
def test_selective_invariants_every_step(world, front):
    for r, out in enumerate(world):
        steps = out[front]["selective"]["records"]
        assert [s["step"] for s in steps] == list(range(STEPS)), r
        for s in steps:
            assert s["sync_equal"], (r, s)         # SYNC bitwise identical on all 4 ranks
            assert s["island_equal"], (r, s)       # LOCAL identical inside each island
            assert s["norm_agree"] and s["overflow_agree"], (r, s)
            if s["reconciled"]:
                assert s["all_equal_after_reconcile"], (r, s)
    rec = world[0][front]["selective"]
    # the shipped config leaves `sync` at `auto`: at these 2 groups every tensor is SYNC (int8 wire),
    # so nothing is LOCAL (the engine counts itself synchronised every step) and every rank holds the
    # same parameters after every step
    assert rec["sync_fraction"] == 1.0, rec["sync_fraction"]
    assert all(s["reconciled"] and s["all_equal_after_reconcile"] for s in rec["records"]), rec["records"]
    assert max(s["local_spread"] for s in rec["records"]) == 0.0


@pytest.mark.timeout(500)
@pytest.mark.parametrize("front", ["trainer", "accelerate"])
def test_selective_slow_tier_bytes_below_flat(world, front):
    rec = world[0][front]["selective"]
    inter = sum(rec["bytes"]["inter"].values())
    # the flat reference: one fp32 all-reduce of every gradient per step (topo_integrations/train/metrics.py)
    flat = 4 * rec["n_params"] * STEPS
    hier = sum(world[0][front]["hierarchical"]["bytes"]["inter"].values())
    print(f"{front}: slow-tier bytes over {STEPS} steps: selective {inter}, hierarchical {hier}, flat {flat}")
    assert 0 < inter < hier < flat, (inter, hier, flat)


@pytest.mark.timeout(500)
def test_selective_at_zero2_shards_inside_the_island(world):
    # DeepSpeed's data-parallel group is the island (docs/deepspeed.md, "selective at ZeRO-1/2"),
    # also when HF filled train_batch_size for the 4-rank world
    assert world[0]["trainer"]["selective"]["dp_world"] == 2


# -- issue 39 item 2: every path Accelerate takes (tests/_hf_paths.py, the same world) ---------------

def _paths(world):
    return [out["accelerate_paths"] for out in world]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("path", ["ddp", "fsdp2"])
def test_accelerate_path_hierarchical_equals_stock(world, path):
    from _hf_paths import STEPS

    for r, out in enumerate(_paths(world)):
        rec, stock = out[path], out[f"stock_{path}"]
        assert rec["path"] == path and stock["path"] is None, (r, rec["path"], stock["path"])
        assert rec["model"] == stock["model"], (rec["model"], stock["model"])  # DistributedDataParallel / FSDP...
        # 2 micro-steps per optimizer step (accelerate's no_sync / set_requires_gradient_sync); fp32
        err = float((rec["params"] - stock["params"]).abs().max())
        assert err <= 1e-6, (r, path, err)
        assert max(abs(a - b) for a, b in zip(rec["losses"], stock["losses"])) <= 1e-5, (rec["losses"], stock["losses"])
        f = rec["figures"]
        assert f["topo_align/method"] == "hierarchical" and f["topo_align/steps"] == STEPS, f
        assert f["topo_align/slow_tier_bytes"] > 0, f
    ddp = _paths(world)[0]["ddp"]
    # the hook ran on the last micro-step of each optimizer step only (DDP calls no hook in no_sync)
    assert ddp["buckets_reduced"] == STEPS * ddp["ddp_buckets"], ddp


@pytest.mark.timeout(500)
def test_accelerate_ddp_local_class_invariants(world):
    from _hf_paths import STEPS

    for r, out in enumerate(_paths(world)):
        rec = out["ddp_local"]
        assert [s["step"] for s in rec["records"]] == list(range(STEPS)), r
        assert all(s["error"] is None for s in rec["records"]), (r, rec["records"])
        f = rec["figures"]
        assert f["topo_align/method"] == "selective" and 0 < f["topo_align/sync_share"] < 1, f
        assert f["topo_align/reconciles"] >= 1, f
    # LOCAL changes the optimizer's semantics: the loss stays within 2 % of stock at every step
    for out in _paths(world):
        for a, b in zip(out["ddp_local"]["losses"], out["stock_ddp"]["losses"]):
            assert abs(a - b) <= 0.02 * b, (out["ddp_local"]["losses"], out["stock_ddp"]["losses"])


@pytest.mark.timeout(500)
def test_accelerate_save_state_round_trips_the_engine(world):
    outs = _paths(world)
    for r, out in enumerate(outs):
        st = out["save_state"]
        assert st["files"] == [f"rank{i}.pt" for i in range(4)], st["files"]
        assert st["moved"] == st["saved_step"] + 1 and st["same"], (r, st["moved"], st["saved_step"], st["same"])
        # save_state reconciled first: every rank saved the same parameters
        assert bool((st["params"] == outs[0]["save_state"]["params"]).all()), r


@pytest.mark.timeout(500)
def test_accelerate_says_once_where_it_cannot_act(world):
    out = _paths(world)[0]
    assert not out["own_hook"]["attached"] and out["own_hook"]["model"] == "DistributedDataParallel"
    refusals = [ln for ln in out["lines"] if ln.startswith("topo-align: not active")]
    assert refusals == ["topo-align: not active on Accelerate DDP (MULTI_CPU): " + _cannot("comm_hook")], refusals
    starts = [ln for ln in out["lines"] if ln.startswith("topo-align: active on")]
    # one start line per prepared model: DDP hierarchical, FSDP2 hierarchical, DDP selective
    assert [s.split(",")[0] for s in starts] == ["topo-align: active on Accelerate DDP (MULTI_CPU)",
                                                 "topo-align: active on Accelerate FSDP2",
                                                 "topo-align: active on Accelerate DDP (MULTI_CPU)"], starts
    assert "4 ranks = 2 islands x 2; mode selective: SYNC" in starts[2] and "LOCAL reconciled every 2" in starts[2]
    for other in _paths(world)[1:]:  # rank 0 only
        assert not [ln for ln in other["lines"] if ln.startswith(("topo-align: active", "topo-align: not active"))]


def _cannot(kind):
    from topo_integrations.hf import CANNOT

    return CANNOT[kind]


# -- issue 39 item 3: the Trainer (DDP path, the callback, checkpoints) -------------------------------

def _tr(world):
    return [out["trainer_paths"] for out in world]


FIGURES = ("topo_align/method", "topo_align/sync_share", "topo_align/slow_tier_bytes_per_step",
           "topo_align/reconciles")


@pytest.mark.timeout(500)
def test_trainer_logs_carry_the_figures(world):
    out = _tr(world)[0]
    cbs = out["local"]["callbacks"]
    # after the flow callback (should_save is decided), before the integrations and the user's callbacks
    assert cbs.index("TopoAlignCallback") == cbs.index("DefaultFlowCallback") + 1, cbs
    assert cbs.index("TopoAlignCallback") < cbs.index("TensorBoardCallback") < cbs.index("Reporter"), cbs
    logs = [h for h in out["local"]["history"] if "loss" in h]
    seen = [h for h in out["seen"]["local"] if "loss" in h]
    assert len(logs) == len(seen) == 3, (logs, seen)  # logging_steps 2 over 6 steps
    for h in logs + seen:
        assert all(k in h for k in FIGURES), h
        assert h["topo_align/method"] == "selective" and 0 < h["topo_align/sync_share"] < 1, h
        assert h["topo_align/slow_tier_bytes_per_step"] > 0, h
    assert [h["topo_align/steps"] for h in logs] == [2, 4, 6]
    assert logs[-1]["topo_align/reconciles"] >= 2, logs[-1]
    assert "topo_align/method" not in str(out["seen"]["stock"])  # no install, no callback
    # the agreed clip norm: every rank logged the same gradient norm
    norms = [[h["grad_norm"] for h in o["local"]["history"] if "loss" in h] for o in _tr(world)]
    assert all(n == norms[0] for n in norms), norms


@pytest.mark.timeout(500)
def test_trainer_tensorboard_shows_the_figures(world, tmp_path_factory):
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logdir = Path(world[0]["trainer_paths"]["tb_dir"])
    acc = tb.EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for k in ("sync_share", "slow_tier_bytes_per_step", "reconciles"):
        assert f"train/topo_align/{k}" in tags, tags
    assert [e.step for e in acc.Scalars("train/topo_align/sync_share")][:3] == [2, 4, 6]


@pytest.mark.timeout(500)
def test_trainer_local_class_loss_against_stock(world):
    from _hf_paths import SAVE_AT

    for out in _tr(world):
        local = [h["loss"] for h in out["local"]["history"] if "loss" in h]
        stock = [h["loss"] for h in out["stock"]["history"] if "loss" in h]
        # a pinned LOCAL class (sync.top_fraction 0.15, reconciled every 2 steps) changes the
        # optimizer's semantics: the logged loss stays within 2 % of stock DDP's (measured: 0.3 %)
        assert len(local) == len(stock) == 3 and all(abs(a - b) <= 0.02 * b for a, b in zip(local, stock)), \
            (local, stock)
        assert out["local"]["model"] == out["stock"]["model"] == "DistributedDataParallel"
        assert out["local"]["checkpoint_files"] == [f"rank{r}.pt" for r in range(4)], out["local"]["checkpoint_files"]
    assert any("restored from" in ln and f"checkpoint-{SAVE_AT}" in ln for ln in _tr(world)[0]["lines"])


@pytest.mark.timeout(500)
def test_trainer_resume_is_bitwise_the_uninterrupted_run(world):
    for r, out in enumerate(_tr(world)):
        a, b = out["local"]["params"], out["resumed"]["params"]
        assert a.dtype == b.dtype and torch_equal(a, b), (r, float((a - b).abs().max()))
        final = [h for h in out["resumed"]["history"] if "loss" in h][-1]
        assert final["loss"] == [h for h in out["local"]["history"] if "loss" in h][-1]["loss"], final


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


# -- no ranks: which path, and the words where topo-align cannot act (paths.py) ----------------------

def _acc(kind, *, fsdp_version=None, fp8="NO", comm_hook="no", pc=None, ds_config=None):
    from types import SimpleNamespace as NS

    state = NS(fsdp_plugin=NS(fsdp_version=fsdp_version) if fsdp_version else None, parallelism_config=pc,
               deepspeed_plugin=NS(deepspeed_config=ds_config) if ds_config is not None else None)
    return NS(distributed_type=kind, state=state, fp8_backend=fp8, ddp_handler=NS(comm_hook=comm_hook))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("acc, path, kind", [
    (_acc("MULTI_GPU"), "DDP (MULTI_GPU)", "ddp"),
    (_acc("MULTI_CPU"), "DDP (MULTI_CPU)", "ddp"),
    (_acc("FSDP", fsdp_version=2), "FSDP2", "fsdp2"),
    (_acc("DEEPSPEED", ds_config={"topo_align": {}}), "DeepSpeed", "deepspeed"),
    (_acc("FSDP", fsdp_version=1), "FSDP1", "fsdp1"),
    (_acc("MULTI_GPU", fp8="MSAMP"), "DDP (MULTI_GPU)", "msamp"),
    (_acc("DEEPSPEED", fp8="MSAMP", ds_config={"topo_align": {}}), "DeepSpeed", "msamp"),
    (_acc("MEGATRON_LM"), "Megatron-LM", "megatron"),
    (_acc("XLA"), "XLA", "xla"),
    (_acc("MULTI_GPU", comm_hook="fp16"), "DDP (MULTI_GPU)", "comm_hook"),
    (_acc("FSDP", fsdp_version=2, pc=__import__("types").SimpleNamespace(tp_enabled=True)), "FSDP2", "parallelism"),
    (_acc("NO"), "one process", "one_process"),
])
def test_decide_names_the_path_and_why(acc, path, kind):
    from topo_integrations import TopoAlignConfig
    from topo_integrations.hf import CANNOT, decide

    d = decide(acc, TopoAlignConfig.model_validate({"mode": "hierarchical"}))
    assert (d.path, d.kind, d.act) == (path, kind, kind in ("ddp", "fsdp2", "deepspeed")), d
    assert d.why == ("" if d.act else CANNOT[kind])


@pytest.mark.timeout(60)
def test_decide_without_a_block():
    from topo_integrations import TopoAlignConfig
    from topo_integrations.hf import decide

    assert decide(_acc("MULTI_GPU"), None).kind == "no_config"
    assert decide(_acc("DEEPSPEED", ds_config={}), None).kind == "no_block"
    # the DeepSpeed config's own block is enough; install()'s block fills a config without one
    assert decide(_acc("DEEPSPEED", ds_config={"topo_align": {}}), None).act
    assert decide(_acc("DEEPSPEED", ds_config={}), TopoAlignConfig()).act
    assert decide(_acc("FSDP", fsdp_version=2), TopoAlignConfig.model_validate({"enabled": False})).kind == "disabled"


@pytest.mark.timeout(60)
def test_a_deepspeed_config_without_a_block_gets_installs_block():
    from topo_integrations.deepspeed import read_block
    from topo_integrations.hf import read_config
    from topo_integrations.hf.prepare import inject_block

    cfg = read_config({"mode": "selective", "sync": {"dtype": "auto", "top_fraction": 0.15},
                       "local": {"reconcile_interval": 4}})
    acc = _acc("DEEPSPEED", ds_config={"train_micro_batch_size_per_gpu": "auto"})
    inject_block(acc, cfg)
    ds = acc.state.deepspeed_plugin.deepspeed_config
    # accelerate takes any "auto" for its placeholder: an explicit "auto" is left out (its default)
    assert ds["topo_align"] == {"mode": "selective", "sync": {"top_fraction": 0.15}, "local": {"reconcile_interval": 4}}
    assert read_block(ds) == cfg


@pytest.mark.timeout(60)
def test_read_config(tmp_path, monkeypatch):
    from topo_integrations.config import ConfigError
    from topo_integrations.hf import CONFIG_ENV, read_config

    assert read_config({"mode": "hierarchical"}).mode == "hierarchical"
    assert read_config({"topo_align": {"mode": "flat"}}).mode == "flat"  # a framework config holding it
    f = tmp_path / "block.json"
    f.write_text(json.dumps({"sync": {"top_fraction": 0.15}}))
    monkeypatch.setenv(CONFIG_ENV, str(f))
    assert read_config().sync.top_fraction == 0.15
    monkeypatch.delenv(CONFIG_ENV)
    assert read_config() is None
    with pytest.raises(ConfigError, match="mode"):
        read_config({"mode": "fast"})


# -- the accelerate launch CLI with a config file (4 CPU processes as 2 virtual nodes x 2) -------------

def _accelerate_cli() -> list[str]:
    import shutil
    import sys

    exe = Path(sys.executable).parent / "accelerate"
    return [str(exe)] if exe.exists() else [shutil.which("accelerate") or "accelerate"]


LAUNCHES = {"ddp": ("accelerate-ddp.yaml", "topo-align-selective.json"),
            "fsdp2": ("accelerate-fsdp2.yaml", "topo-align-hierarchical.json")}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``accelerate launch --config_file configs/hf/<yaml> scripts/hf_accelerate_example.py --config
    configs/hf/<block>`` for each path, both started at once (their single-threaded start-up phases
    overlap; on 2 cores that saves a third of the wall time). The script calls
    ``topo_integrations.hf.install(<block>)`` and trains 3 steps of 2 micro-steps after a stock run of
    the same steps (--compare-stock); a torch-only LM (no transformers import: launch time)."""
    import subprocess

    tmp = tmp_path_factory.mktemp("launch")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs, t0 = {}, time.perf_counter()
    from topo_integrations.testing import free_port

    for path, (launch, block) in LAUNCHES.items():
        # Each its own rendezvous port: both run at once, and the other pytest worker may hold 29500
        # (accelerate's default) for a torchrun of its own.
        cmd = _accelerate_cli() + ["launch", "--main_process_port", str(free_port()),
                                   "--config_file", str(ROOT / "configs" / "hf" / launch),
                                   str(ROOT / "scripts" / "hf_accelerate_example.py"), "--config",
                                   str(ROOT / "configs" / "hf" / block), "--model", "tiny", "--steps", "3",
                                   "--compare-stock", "--out", str(tmp / f"{path}.json")]
        procs[path] = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    out = {}
    for path, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(1.0, 280 - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        rep = tmp / f"{path}.json"
        out[path] = (proc.returncode, err, json.loads(rep.read_text()) if rep.exists() else None)
    print(f"accelerate launch (ddp and fsdp2 at once): {time.perf_counter() - t0:.1f} s wall")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", sorted(LAUNCHES))
def test_accelerate_launch_cli(launches, path):
    rc, stderr, rep = launches[path]
    assert rc == 0, stderr[-4000:]
    assert rep["world"] == 4 and rep["path"] == path and rep["figures"]["topo_align/steps"] == 3, rep
    label = {"ddp": "Accelerate DDP (MULTI_CPU)", "fsdp2": "Accelerate FSDP2"}[path]
    starts = [ln for ln in stderr.splitlines() if ln.startswith("topo-align: active on")]
    assert len(starts) == 1 and starts[0].startswith(f"topo-align: active on {label}, 4 ranks = 2 islands x 2"), \
        starts  # the line users see, once (rank 0)
    if rep["figures"]["topo_align/method"] == "hierarchical":
        assert rep["max_param_diff_vs_stock"] <= 1e-6, rep
    else:  # a pinned LOCAL class: within 2 % of stock's loss at every step
        assert rep["figures"]["topo_align/sync_share"] < 1 and rep["figures"]["topo_align/reconciles"] >= 1, rep
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(rep["losses"], rep["stock_losses"])), rep
