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
    import topo_integrations.deepspeed as tds
    from topo_integrations.deepspeed import harness as H

    H.prepare_cpu()
    tds.install()  # the one line: Trainer and Accelerator call deepspeed.initialize from here on
    out: dict = {"_times": {}}
    for name, fn, args in (("trainer", _trainer, (rank, tmp)), ("accelerate", _accelerate, (rank,))):
        # No per-section try/except: a rank that raises fails the whole world at once (run_world).
        t0 = time.perf_counter()
        out[name] = fn(*args)
        out["_times"][name] = round(time.perf_counter() - t0, 1)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf4"))
    t0 = time.perf_counter()
    out = run_world(4, _rank_main, tmp, timeout=400, pg_timeout=120,
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
