"""``topo_integrations.train.pretrain_megatron`` (megatron-core on CPU, TopoAlignDDP) on 4 gloo ranks
(2 virtual nodes x 2): every mode briefly, output files, and an interrupted run resumed from its
per-rank checkpoint (tests/_pretrain_world.py)."""

from __future__ import annotations

import os

import pytest

from topo_integrations.testing import run_world

from _pretrain_world import assert_mode_runs, csv_losses, ok, rank_main

pytestmark = pytest.mark.multirank
MODULE = "topo_integrations.train.pretrain_megatron"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    runs = str(tmp_path_factory.mktemp("mg-runs"))
    return run_world(4, rank_main, MODULE, runs, timeout=540), runs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, reducer", [("selective", True), ("hierarchical", True), ("flat", False),
                                           ("stock", False)])
def test_mode_trains_and_reports_bytes(world, name, reducer):
    results, runs = world
    assert_mode_runs(results, runs, name, reducer=reducer)
    s = ok(results, name)
    assert s["mode"] == name and s["framework"] == "megatron-core"


@pytest.mark.timeout(600)
def test_per_rank_checkpoints_and_tensorboard(world):
    results, runs = world
    d = os.path.join(runs, "selective")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(d, "tensorboard")))
    with open(os.path.join(d, "checkpoints", "latest")) as fh:
        assert fh.read().strip() == "6"
    assert sorted(os.listdir(os.path.join(d, "checkpoints", "step_0000006"))) == \
        [f"rank_{r:05d}.pt" for r in range(4)]
    assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ["latest", "step_0000004", "step_0000006"]


@pytest.mark.timeout(600)
def test_resume_continues_from_the_last_checkpoint_exactly(world):
    results, runs = world
    assert ok(results, "killed") == {"stopped_at": 5}
    res, ref = ok(results, "resumed"), ok(results, "selective")
    assert res["start_step"] == 4 and res["steps"] == 6
    got, want = (
        csv_losses(os.path.join(runs, "res", "metrics.csv")),
        csv_losses(os.path.join(runs, "selective", "metrics.csv")),
    )
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got == want
    assert (res["first_val_loss"], res["final_val_loss"]) == (ref["first_val_loss"], ref["final_val_loss"])
