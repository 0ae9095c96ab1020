"""Deriving ``--num-distributed-optimizer-instances`` from the topology (topo_integrations/megatron/layout.py).

The rule without ranks: unset -> the number of topology groups and one log line; explicit -> kept
as given (equal: runs; conflicting: `TopoAlignDDP` keeps its refusal, whose text is pinned here).
End to end through Megatron-LM's own pretrain_gpt.py: tests/test_megatron_lm_train.py ("hier-dopt"
runs without the flag, "sel-dopt" with an explicit equal value).
"""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from topo_integrations.megatron import layout
from topo_integrations.megatron.flags import add_topo_align_args
from topo_integrations.topology.file_source import load_topology_file
from topo_integrations.topology.planner import plan_groups

ROOT = os.path.join(os.path.dirname(__file__), "..")
TODAY_REFUSAL = ("topo_align: with the distributed optimizer, num_distributed_optimizer_instances must equal the "
                 "number of topology groups: it is 1, the topology has 2 groups of 2 ranks; launch with "
                 "--num-distributed-optimizer-instances 2")


def _megatron_parser() -> argparse.ArgumentParser:
    """As Megatron-LM's parse_args: its own flags first (default 1), then ours."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return add_topo_align_args(p)


def _plan(name: str = "virtual-2x2.json"):
    return plan_groups(load_topology_file(os.path.join(ROOT, "configs", "topologies", name)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, value, unset", [
    ([], 1, ("num_distributed_optimizer_instances",)),
    (["--num-distributed-optimizer-instances", "1"], 1, ()),
    (["--num-distributed-optimizer-instances", "2"], 2, ()),
])
def test_parse_tells_unset_from_explicit_and_never_leaks_the_sentinel(argv, value, unset):
    ns = _megatron_parser().parse_args(["--topo-align", "--use-distributed-optimizer", *argv])
    assert ns.num_distributed_optimizer_instances == value and type(ns.num_distributed_optimizer_instances) is int
    assert ns.topo_align_unset_layout == unset


@pytest.mark.timeout(30)
def test_unset_is_derived_as_the_number_of_groups_with_the_reason():
    plan = _plan()
    value, line = layout.choose_instances(None, plan)
    assert value == 2
    assert line.startswith("topo_align: --num-distributed-optimizer-instances not set: using 2, the number of "
                           "topology groups (2 groups of 2 ranks)")
    assert plan.reason in line


@pytest.mark.timeout(30)
def test_explicit_values_are_kept_and_a_conflicting_one_keeps_todays_refusal():
    plan = _plan()
    assert layout.choose_instances(2, plan) == (2, None)
    assert layout.choose_instances(1, plan) == (1, None)
    assert layout.instances_refusal(1, plan) == TODAY_REFUSAL


@pytest.mark.timeout(30)
def test_single_tier_topology_keeps_megatrons_default():
    plan = _plan("virtual-4x1.json")  # one rank per island: no groups
    assert not plan.hierarchical
    assert layout.choose_instances(None, plan) == (1, None)


class _FakeDist:
    """What derive_layout asks torch.distributed besides discovery (the rank that logs)."""

    @staticmethod
    def get_rank() -> int:
        return 0


@pytest.fixture
def derive(monkeypatch):
    """``derive(argv, model_parallel_size)`` -> (args, discoveries) with discovery faked to the 2x2 plan."""
    import torch.distributed as dist

    from topo_integrations.reducer.plan import discover

    calls = []
    monkeypatch.setattr(discover, "discover_plan", lambda cfg: calls.append(cfg) or _plan())
    monkeypatch.setattr(dist, "get_rank", _FakeDist.get_rank)

    def run(argv, model_parallel_size=1, times=1):
        args = _megatron_parser().parse_args(argv)
        for _ in range(times):
            layout.derive_layout(args, args.topo_align_resolved, model_parallel_size=model_parallel_size)
        return args, calls

    return run


@pytest.mark.timeout(30)
def test_derive_layout_sets_the_flag_and_logs_once(derive, caplog):
    caplog.set_level(logging.INFO, logger="topo_align")
    args, calls = derive(["--topo-align", "--topo-align-mode", "hierarchical", "--use-distributed-optimizer"], times=2)
    assert args.num_distributed_optimizer_instances == 2 and len(calls) == 1
    lines = [r.getMessage() for r in caplog.records if "not set: using 2" in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [
    ["--topo-align", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "1"],  # explicit
    ["--topo-align"],                                                                             # plain DDP
    ["--use-distributed-optimizer"],                                                              # plugin off
    ["--topo-align", "--topo-align-mode", "flat", "--use-distributed-optimizer"],                 # stock reduction
])
def test_derive_layout_leaves_explicit_values_and_other_runs_alone(derive, argv):
    args, calls = derive(argv)
    assert args.num_distributed_optimizer_instances == 1 and calls == []


@pytest.mark.timeout(30)
def test_model_parallelism_keeps_the_default_and_says_why(derive, caplog):
    caplog.set_level(logging.INFO, logger="topo_align")
    args, calls = derive(["--topo-align", "--use-distributed-optimizer"], model_parallel_size=2)
    assert args.num_distributed_optimizer_instances == 1 and calls == []
    assert any("not derived: with model parallelism (tensor x pipeline x context = 2)" in r.getMessage()
               for r in caplog.records)


@pytest.mark.timeout(30)
def test_the_plugins_own_megatron_trainer_tells_unset_from_explicit():
    from topo_integrations.train.pretrain_megatron import build_parser

    ns = build_parser().parse_args(["--use-distributed-optimizer"])
    assert ns.num_distributed_optimizer_instances == 1
    assert ns.topo_align_unset_layout == ("num_distributed_optimizer_instances",)
    ns = build_parser().parse_args(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4"])
    assert ns.num_distributed_optimizer_instances == 4 and ns.topo_align_unset_layout == ()
