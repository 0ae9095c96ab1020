"""``topo_integrations.train.pretrain_deepspeed`` on 4 gloo ranks (2 virtual nodes x 2): every mode
briefly, output files, and an interrupted run resumed from its checkpoint (tests/_pretrain_world.py)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from topo_integrations.testing import run_world  # noqa: E402

from _pretrain_world import assert_mode_runs, csv_losses, ok, rank_main  # noqa: E402

pytestmark = pytest.mark.multirank
MODULE = "topo_integrations.train.pretrain_deepspeed"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    runs = str(tmp_path_factory.mktemp("ds-runs"))
    return run_world(4, rank_main, MODULE, runs, timeout=540), runs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, reducer", [("selective", True), ("hierarchical", True), ("flat", False),
                                           ("stock", False)])
def test_mode_trains_and_reports_bytes(world, name, reducer):
    results, runs = world
    assert_mode_runs(results, runs, name, reducer=reducer)


@pytest.mark.timeout(600)
def test_outputs_tensorboard_and_deepspeed_checkpoints(world):
    results, runs = world
    d = os.path.join(runs, "selective")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(os.path.join(d, "tensorboard"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in ea.Scalars("val/loss")] == [0, 2, 4, 6]
    assert {"bytes_per_step/inter", "bytes_per_step/flat_allreduce"} <= set(ea.Tags()["scalars"])
    with open(os.path.join(d, "checkpoints", "latest")) as fh:
        assert fh.read().strip() == "step_0000006"
    assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ["latest", "step_0000004", "step_0000006"]
    assert ok(results, "selective")["mode"] == "selective"


@pytest.mark.timeout(600)
def test_resume_continues_from_the_last_checkpoint_exactly(world):
    results, runs = world
    assert ok(results, "killed") == {"stopped_at": 5}
    res = ok(results, "resumed")
    ref = ok(results, "selective")
    assert res["start_step"] == 4 and res["steps"] == 6
    got, want = (
        csv_losses(os.path.join(runs, "res", "metrics.csv")),
        csv_losses(os.path.join(runs, "selective", "metrics.csv")),
    )
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # step 5 of the killed run was replaced, nothing lost
    assert got == want  # the resumed run continues exactly as the uninterrupted one
    assert res["final_val_loss"] == ref["final_val_loss"]
    assert res["first_val_loss"] == ref["first_val_loss"]  # validation history kept across the resume
