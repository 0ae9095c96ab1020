"""The pretraining pipeline's single-process parts: corpus, tokenizer, indexed dataset, batches,
flags, schedule, metrics files. (The entry points themselves: test_pretrain_deepspeed.py,
test_pretrain_megatron.py, test_pretrain_scripts.py.)"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

import numpy as np
import pytest

from topo_integrations.train import common
from topo_integrations.train.data import (
    STDLIB_LICENSE,
    ByteTokenizer,
    DataError,
    GlobalBatches,
    build_gpt_datasets,
    build_indexed_dataset,
    collect_stdlib_corpus,
    collect_text_corpus,
    prepare_dataset,
)
from topo_integrations.train.metrics import TrainLogger, tier_bytes
from topo_integrations.train.model import GPT, PRESETS, PresetError, preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    common.add_common_args(ap)
    ns = ap.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.timeout(60)
def test_byte_tokenizer_round_trip_and_special_ids():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text
    assert (tok.eod, tok.pad, tok.vocab_size) == (256, 257, 258)


@pytest.mark.timeout(60)
def test_stdlib_corpus_is_deterministic_sorted_capped_and_skips_tests():
    a = collect_stdlib_corpus(300_000)
    b = collect_stdlib_corpus(300_000)
    assert a == b
    names = [n for n, _ in a]
    assert names == sorted(names)
    total = sum(len(r) for _, r in a)
    assert total >= 300_000 and total - len(a[-1][1]) < 300_000  # stops right after the cap
    assert not any(part in ("test", "tests", "site-packages") for n in names for part in n.split("/"))
    assert all(n.endswith(".py") for n in names)
    assert "PSF" in STDLIB_LICENSE


@pytest.mark.timeout(60)
def test_text_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match=r"--corpus '.*nope': no such file or folder"):
        collect_text_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no non-empty UTF-8 text files"):
        collect_text_corpus(tmp_path / "empty")


@pytest.mark.timeout(120)
def test_indexed_dataset_round_trip_and_cache(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [("a.txt", b"hello\n"), ("b.txt", "caf\u00e9".encode())]
    n = build_indexed_dataset(str(tmp_path / "ds"), docs)
    ds = IndexedDataset(str(tmp_path / "ds"))
    assert n == 6 + 1 + 5 + 1 and len(ds) == 2
    assert list(ds[0]) == list(b"hello\n") + [256]
    assert list(ds[1]) == list("caf\u00e9".encode()) + [256]
    assert ds[0].dtype == np.uint16

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"document {i}\n" * 50)
    prefix, manifest = prepare_dataset(tmp_path / "out", corpus=str(corpus))
    assert manifest["documents"] == 3 and manifest["tokens"] == manifest["bytes"] + 3
    mtime = os.path.getmtime(prefix + ".bin")
    prefix2, manifest2 = prepare_dataset(tmp_path / "out", corpus=str(corpus))
    assert prefix2 == prefix and os.path.getmtime(prefix + ".bin") == mtime  # reused, not rebuilt
    assert manifest2["sha256"] == manifest["sha256"]
    with pytest.raises(DataError, match="--corpus-max-bytes 0: must be a positive number"):
        prepare_dataset(tmp_path / "out", corpus=str(corpus), max_bytes=0)


@pytest.fixture(scope="module")
def gpt_splits(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    small, _ = prepare_dataset(d / "small", corpus="stdlib", max_bytes=200_000)
    with pytest.raises(DataError, match="documents leave the validation split empty with split '98,2,0'"):
        build_gpt_datasets(small, seq_length=32, seed=7, train_samples=8, valid_samples=8,
                           cache_dir=str(d / "cache"))
    prefix, _ = prepare_dataset(d, corpus="stdlib", max_bytes=1_500_000)
    return build_gpt_datasets(prefix, seq_length=32, seed=7, train_samples=64, valid_samples=16,
                              cache_dir=str(d / "cache"))


@pytest.mark.timeout(120)
def test_gpt_dataset_samples_are_next_token_pairs(gpt_splits):
    train, valid = gpt_splits
    s = train[0]
    assert s["tokens"].shape == (32,) and s["labels"].shape == (32,)
    assert (s["tokens"][1:] == s["labels"][:-1]).all()  # labels are the tokens shifted by one
    assert int(s["tokens"].max()) <= 256 and float(s["loss_mask"].min()) == 1.0
    assert len(valid) >= 16


@pytest.mark.timeout(120)
def test_global_batches_partition_is_independent_of_world_size(gpt_splits):
    train, _ = gpt_splits
    one = GlobalBatches(train, micro_batch=4, dp_size=1, dp_rank=0, accum=2)
    two = [GlobalBatches(train, micro_batch=2, dp_size=2, dp_rank=r, accum=2) for r in range(2)]
    for step in (0, 3):
        ref = sorted(tuple(row.tolist()) for m in range(2) for row in one.micro(step, m)["tokens"])
        got = sorted(tuple(row.tolist()) for b in two for m in range(2) for row in b.micro(step, m)["tokens"])
        assert got == ref
    a, b = two[0].micro(5, 1)["tokens"], two[0].micro(5, 1)["tokens"]
    assert (a == b).all()  # a step's batch never depends on history


@pytest.mark.timeout(60)
def test_model_presets_and_layer_names():
    assert set(PRESETS) == {"tiny", "125M", "1.3B", "175B"}
    tiny = preset("tiny")
    assert 1_000_000 <= tiny.num_params() <= 3_000_000
    assert 150e9 < PRESETS["175B"].num_params() < 180e9
    m = GPT(tiny)
    names = [n for n, _ in m.named_parameters()]
    assert sum(p.numel() for p in m.parameters()) == tiny.num_params()
    assert "layers.3.fc.weight" in names and "lm_head.weight" in names
    with pytest.raises(PresetError, match="--model 'huge': unknown preset; accepted: tiny, 125M, 1.3B, 175B"):
        preset("huge")


@pytest.mark.timeout(60)
def test_topo_block_from_flags():
    assert common.topo_block(_args(no_topo_align=True)) is None
    # the tiny preset's last_n_layers 1 shapes a LOCAL class: only with a top_fraction below 1 (the
    # default makes every tensor SYNC, where the engine refuses LOCAL-class keys set for nothing)
    b = common.topo_block(_args())
    assert b["mode"] == "selective" and "sync" not in b and "local" not in b
    b = common.topo_block(_args(set=["sync.top_fraction=0.15"]))
    assert b["sync"] == {"top_fraction": 0.15, "last_n_layers": 1}
    b = common.topo_block(_args(set=["sync.top_fraction=1"]), defaults={"local.async_reconcile": False})
    assert b["sync"] == {"top_fraction": 1} and "local" not in b
    b = common.topo_block(_args(set=["sync.top_fraction=0.3"]), defaults={"local.async_reconcile": False})
    assert b["local"] == {"async_reconcile": False} and b["sync"]["last_n_layers"] == 1
    b = common.topo_block(_args(model="125M", topo_align_mode="hierarchical",
                                set=["local.reconcile_interval=8", "sync.last_n_layers=3"]))
    assert (b["mode"], b["local"]["reconcile_interval"], b["sync"]["last_n_layers"]) == ("hierarchical", 8, 3)
    topo = os.path.join(ROOT, "tests", "fixtures")
    with pytest.raises(common.UsageError, match="unknown field 'local.nope'"):
        common.topo_block(_args(set=["local.nope=1"]))
    with pytest.raises(common.UsageError, match="expected KEY=VALUE"):
        common.topo_block(_args(set=["local.reconcile_interval"]))
    with pytest.raises(common.UsageError, match="--topology '.*missing.json': no such file"):
        common.topo_block(_args(topology=os.path.join(topo, "missing.json")))
    with pytest.raises(common.UsageError, match="--virtual-nodes 3: must divide the world size 4"):
        common.virtual_hostname(0, 4, 3)
    assert [common.virtual_hostname(r, 4, 2) for r in range(4)] == ["node0", "node0", "node1", "node1"]


@pytest.mark.timeout(60)
def test_selective_label_says_what_auto_took():
    e = {"sync_elements": 30, "local_elements": 0, "sync_dtype": "int8"}
    assert common.selective_label([e, e]) == "every tensor SYNC, int8 wire"
    assert common.selective_label([e, {**e, "local_elements": 90, "sync_dtype": "bfloat16"}]) == \
        "40% of elements SYNC on the bfloat16/int8 wire, the rest LOCAL"


@pytest.mark.timeout(60)
def test_lr_schedule_warmup_then_cosine_to_floor():
    a = _args(lr=1.0, warmup_steps=10, train_steps=110, min_lr_ratio=0.1)
    assert common.lr_at(0, a) == pytest.approx(0.1) and common.lr_at(9, a) == pytest.approx(1.0)
    assert common.lr_at(60, a) == pytest.approx(0.55)
    assert common.lr_at(110, a) == pytest.approx(0.1)


@pytest.mark.timeout(60)
def test_tier_bytes_reads_both_adapters_formats():
    ds = {"steps": 3, "total": {"inter/sync/bytes": 10.0, "inter/reconcile/bytes": 5.0, "intra/local/bytes": 7.0,
                                "inter/sync/seconds": 0.1, "dp/agree/bytes": 8.0}}
    assert tier_bytes(ds) == {"inter": 15.0, "intra": 7.0, "dp": 8.0}
    mg = {"step": 2, "totals": {"sync": {"inter": {"bytes": 4, "seconds": 0.1}, "intra": {"bytes": 9, "seconds": 0}},
                                "reconcile": {"inter": {"bytes": 6, "seconds": 0.2}}}}
    assert tier_bytes(mg) == {"inter": 10.0, "intra": 9.0}
    assert tier_bytes(None) == {}


@pytest.mark.timeout(60)
def test_logger_csv_drops_rows_after_the_resumed_checkpoint(tmp_path):
    def steps(log_from, upto, start):
        lg = TrainLogger(str(tmp_path), rank=0, total_steps=10, start_step=start, tokens_per_step=100,
                         flat_bytes=400, tensorboard=False, stream=open(os.devnull, "w"))
        lg.baseline({"total": {"inter/sync/bytes": 100.0 * start}})  # counters as restored
        for s in range(log_from, upto + 1):
            lg.step(s, 1.0 / s, 0.1, 0.01, {"total": {"inter/sync/bytes": 100.0 * s}})
        out = lg.summary(steps_done=upto)
        lg.close()
        return out

    steps(1, 7, 0)        # "killed" after step 7
    s = steps(5, 10, 4)   # resumed from the checkpoint of step 4
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = [int(r["step"]) for r in csv.DictReader(fh)]
    assert rows == list(range(1, 11))
    assert s["bytes_per_step"] == {"inter": 100.0} and s["inter_vs_flat"] == 0.25


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env, message", [
    ({"NCCL_ALGO": "TOPO_AWARE"}, "'TOPO_AWARE' is not an NCCL algorithm"),
    ({"NCCL_TIMEOUT": "600"}, "NCCL_TIMEOUT does not exist in NCCL"),
])
def test_launch_script_refuses_invalid_nccl_settings(env, message):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_deepspeed.sh"), "--skip-setup"],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # starts the entry point, which imports torch and DeepSpeed before reading its flags
@pytest.mark.timeout(120)
def test_entry_point_bad_flag_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "topo_integrations.train.pretrain_deepspeed", "--runs-dir",
                        str(tmp_path), "--set", "sync.top_fraction=7"],
                       capture_output=True, text=True, timeout=100, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 2
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "sync.top_fraction" in err[0] and "Traceback" not in r.stderr


@pytest.mark.slow  # a process of its own: the rank ends with os._exit
@pytest.mark.timeout(120)
def test_a_collective_error_ends_the_rank_at_once_with_exit_3():
    """docs/reliability.md, "What the job does on a CollectiveError": the entry points' main prints the
    error in one line and exits 3 without the teardown (barrier, destroy) that would wait on a dead peer,
    so torchrun --max-restarts restarts the job from its last checkpoint."""
    code = ("import argparse, sys\n"
            "from topo_integrations.train import common\n"
            "from topo_integrations.reducer import CollectiveError\n"
            "def run(args):\n"
            "    raise CollectiveError('topo_align: all_reduce on the inter group (global ranks 0, 2) failed')\n"
            "sys.exit(common.run_main(argparse.Namespace(check_args=False), None, run))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == common.EXIT_COLLECTIVE == 3
    assert r.stderr.strip().splitlines() == [
        "CollectiveError: topo_align: all_reduce on the inter group (global ranks 0, 2) failed"]


@pytest.mark.timeout(60)
def test_attempt_store_keeps_each_torchrun_attempt_apart(monkeypatch):
    import datetime

    import torch.distributed as dist

    from topo_integrations.testing import free_port

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert common.attempt_store(datetime.timedelta(seconds=5)) is None  # not under torchrun
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the agent hosts the store
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    store = common.attempt_store(datetime.timedelta(seconds=5))
    store.set("rank_1", "10.0.0.2:1234")
    assert server.get("topo_align/attempt_2/rank_1") == b"10.0.0.2:1234"
    assert not server.check(["rank_1"])  # a later attempt cannot read this one's peer addresses
