"""torchft's DiLoCo and LocalSGD as optional peers of `topo-align bench` (bench/trainers.py `_TorchFT`,
docs/benchmarks.md "torchft DiLoCo").

The pure tests (keys, theory bytes, the skip line when torchft is absent) always run. The
`multirank` test builds the bench's own torchft system on 4 gloo ranks (2 faked nodes x 2 ranks, a
tiny GPT, 4 steps, sync every 2) with the lighthouse in rank 0's process; it skips where torchft is
not installed (`pip install -c constraints.txt -e '.[torchft]'`). About 20 s per system on 2 idle cores.
"""

from __future__ import annotations

import pytest

from topo_integrations.bench.systems import (
    DEFAULT_SYSTEMS,
    SYSTEMS,
    Layout,
    availability,
    is_local,
    resolve,
    theory_bytes,
    torchft_period,
)

L2X2 = Layout(("node0", "node0", "node1", "node1"), ("leaf0",) * 4, ((0, 1), (2, 3)))
L4X1 = Layout(("node0", "node1", "node2", "node3"), ("leaf0",) * 4, None)
P = 1_000_000
S = 4.0 * P
STEPS, H = 4, 2


@pytest.mark.timeout(10)
def test_keys_periods_and_defaults():
    assert torchft_period("torchft-diloco") == 0 and torchft_period("torchft-localsgd-h16") == 16
    assert torchft_period("torchft-diloco-h0") is None and torchft_period("post-local-sgd-h4") is None
    assert resolve("torchft-diloco-h16").label == "torchft DiLoCo (outer Nesterov SGD), replica group = node (H=16)"
    assert resolve("torchft-diloco-hx") is None
    assert is_local("torchft-diloco-h8") and is_local("torchft-localsgd")
    # Optional peers: named with --systems only, never in the default run.
    assert "torchft-diloco" in SYSTEMS and "torchft-diloco" not in DEFAULT_SYSTEMS


@pytest.mark.timeout(10)
def test_theory_bytes_rails_every_h_steps():
    # 2x2: the in-node all-reduce crosses no node cut; each of the 2 rails all-reduces the whole
    # model across the 2 nodes (2 edges x S) once per sync.
    got = theory_bytes("torchft-diloco", L2X2, P, {"steps": 8, "sync_every": 4, "syncs": 2})
    assert got["node"] == pytest.approx(2 * 2 * S * 2 / 8)
    # Flat cluster: one replica group per rank, one world all-reduce per sync.
    flat = theory_bytes("torchft-localsgd-h4", L4X1, P, {"steps": 8, "sync_every": 4, "syncs": 2})
    assert flat["node"] == pytest.approx(4 * 2 * 3 / 4 * S * 2 / 8)


@pytest.mark.timeout(10)
def test_absent_torchft_is_one_skip_line_with_the_install():
    def importer(name):
        if name.startswith("torchft"):
            raise ModuleNotFoundError("No module named 'torchft'")
        return __import__(name)

    why = availability(SYSTEMS["torchft-diloco"], importer)
    assert why.startswith("torchft.local_sgd does not import (ModuleNotFoundError")
    assert why.endswith("optional: pip install -c constraints.txt -e '.[torchft]'")


# ------------------------------------------------------------------------- 4 gloo ranks

def _spec(system: str) -> dict:
    return {"system": system, "seed": 1234, "layers": 2, "hidden": 16, "heads": 2, "seq_length": 16, "lr": 3e-3,
            "weight_decay": 0.01, "clip": 1.0, "groups": [[0, 1], [2, 3]], "reconcile_interval": H, "timeout_s": 60}


def _batch(step: int, rank: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(2, 16)}


def _rank_main(rank, world, system):
    import torch

    from topo_integrations.bench.trainers import build

    sysm = build(_spec(system))
    flat, losses = [], []
    for step in range(STEPS):
        losses.append(sysm.step(_batch(step, rank)))
        flat.append(torch.cat([p.detach().reshape(-1) for p in sysm.model.parameters()]).clone())
    return {"flat": flat, "losses": losses, "info": sysm.info()}


@pytest.fixture(scope="module", params=["torchft-diloco", "torchft-localsgd"])
def ranks(request):
    pytest.importorskip("torchft", reason="torchft not installed: pip install -c constraints.txt -e '.[torchft]'")
    from topo_integrations.testing import run_world

    return request.param, run_world(4, _rank_main, request.param, timeout=240, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.multirank
@pytest.mark.timeout(290)
def test_torchft_syncs_every_h_steps_through_its_own_outer_loop(ranks):
    import math

    import torch

    system, out = ranks
    assert out[0]["info"]["syncs"] == STEPS // H and out[0]["info"]["replica_groups"] == 2
    assert out[0]["info"]["torchft"] == system.split("-")[1]
    assert all(math.isfinite(x) for r in out for x in r["losses"])
    for step in range(STEPS):
        # DDP inside a node every step: the two ranks of a node hold the same replica.
        assert torch.equal(out[0]["flat"][step], out[1]["flat"][step])
        assert torch.equal(out[2]["flat"][step], out[3]["flat"][step])
        # Across nodes: apart between syncs, equal right after torchft's sync (steps 2 and 4).
        same = torch.allclose(out[0]["flat"][step], out[2]["flat"][step], rtol=0, atol=1e-6)
        assert same == ((step + 1) % H == 0), (system, step)
