"""Pure (single-process) tests of the reducer's pieces: layer detection and classes, the FP16 scale,
error feedback, buckets."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from topo_integrations.reducer.classes.classes import LOCAL, SYNC, classify, layer_indices
from topo_integrations.reducer.wire.compression import (
    choose_scale,
    fold_owner_residual,
    is_lossy,
    owner_residual_numel,
    quantize,
    wire_dtype,
)
from topo_integrations.torch.buckets import build_buckets

MEGATRON = [
    "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
    *[f"decoder.layers.{i}.{n}" for i in range(4) for n in (
        "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight")],
    "decoder.final_layernorm.weight", "output_layer.weight",
]
HF_GPT2 = ["transformer.wte.weight", "transformer.wpe.weight",
           *[f"transformer.h.{i}.attn.c_attn.weight" for i in range(12)], "transformer.ln_f.weight", "lm_head.weight"]
LLAMA = ["model.embed_tokens.weight", *[f"model.layers.{i}.mlp.gate_proj.weight" for i in range(10)],
         "model.norm.weight", "lm_head.weight"]


def _sync(names, n, always=(), pattern=None, model=None, top=0.0, scores=None, numels=None):
    layers = layer_indices(names, model=model, layer_pattern=pattern)
    numels = numels or [1] * len(names)
    c = classify(names, numels, last_n_layers=n, always_sync=list(always), top_fraction=top,
                 scores=scores, layers=layers)
    return sorted(k for k, v in c.items() if v == SYNC)


def test_megatron_last_layers_and_head():
    got = _sync(MEGATRON, 2, always=["output_layer", "final_layernorm"])
    assert got == sorted([n for n in MEGATRON if ".layers.2." in n or ".layers.3." in n]
                         + ["decoder.final_layernorm.weight", "output_layer.weight"])


def test_hf_gpt2_and_llama_names():
    assert _sync(HF_GPT2, 1) == ["transformer.h.11.attn.c_attn.weight"]
    assert _sync(LLAMA, 3, always=["lm_head"]) == sorted(
        ["lm_head.weight"] + [f"model.layers.{i}.mlp.gate_proj.weight" for i in (7, 8, 9)])


def test_leftmost_layer_index_wins():
    names = ["layers.3.experts.h.1.w", "layers.1.experts.h.9.w"]
    assert layer_indices(names) == {names[0]: 3, names[1]: 1}


def test_plain_sequential_and_nested_sequential():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    names = [n for n, _ in seq.named_parameters()]
    assert layer_indices(names, model=seq) == {"0.weight": 0, "0.bias": 0, "2.weight": 2, "2.bias": 2,
                                               "4.weight": 4, "4.bias": 4}
    assert _sync(names, 1, model=seq) == ["4.bias", "4.weight"]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(2, 2)
            self.net = seq

    m = Net()
    names = [n for n, _ in m.named_parameters()]
    assert _sync(names, 2, model=m) == ["net.2.bias", "net.2.weight", "net.4.bias", "net.4.weight"]


def test_layer_pattern_override_and_errors():
    names = ["blk_0.w", "blk_1.w", "blk_2.w", "head.w"]
    assert _sync(names, 1, pattern=r"blk_(\d+)\.") == ["blk_2.w"]
    with pytest.raises(ValueError, match=r"sync.layer_pattern = 'blk_\\\\d\+' has 0 groups"):
        layer_indices(names, layer_pattern=r"blk_\d+")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        layer_indices(names, layer_pattern="(")


def test_top_fraction_is_greedy_by_score_within_budget():
    names = ["a", "b", "c", "d"]
    numels = [50, 30, 20, 10]  # total 110, budget 0.3 -> 33 elements
    got = _sync(names, 0, top=0.3, scores=[4.0, 3.0, 2.0, 2.0], numels=numels)
    assert got == ["b"]  # a does not fit; b fits; c would exceed (30 + 20 > 33); d would exceed (40 > 33)
    got = _sync(names, 0, top=0.3, scores=[4.0, 1.0, 2.0, 2.0], numels=numels)
    assert got == ["c", "d"]  # ties broken by name
    assert _sync(names, 0, top=1.0, numels=numels) == names


@pytest.mark.parametrize("n", [2, 3, 4, 8, 120])
def test_fp16_scaled_cast_keeps_11_bits_and_its_sum_cannot_overflow(n):
    """The owner sums n scaled FP16 values in fp32 and rounds the sum once to FP16 (lossy_wire.py):
    neither a value nor that sum overflows, and every normal value is within 2^-11 of what was meant."""
    g = torch.Generator().manual_seed(n)
    vs = [torch.randn(5000, generator=g) * 10 ** torch.randint(-6, 6, (1,), generator=g).item() for _ in range(n)]
    amax = torch.stack([v.abs().max() for v in vs]).max()
    s = choose_scale(amax, torch.float16, n)
    qs = [quantize(v, torch.float16, s, None) for v in vs]
    total = torch.stack([q.float() for q in qs]).sum(0)
    assert torch.isfinite(total.to(torch.float16)).all() and total.abs().max() <= 65504 / 2
    for v, q in zip(vs, qs):
        normal = (v * s).abs() >= torch.finfo(torch.float16).tiny
        err = (q.double() / s.double() - v.double()).abs()
        assert bool((err[normal] <= 2.0 ** -11 * v.double().abs()[normal]).all())


def test_owner_residual_folds_per_element():
    """A 16-bit hop's residual: the sender's part (padded to n) and my chunk of the sum's rounding;
    folded, my chunk's rounding joins my own part, element by element."""
    assert owner_residual_numel(10, 4) == 12 + 3 and owner_residual_numel(1000, 2, 256) == 1024 + 512
    r = torch.arange(15.0)
    flat = fold_owner_residual(r, 10, 4, rank=1)
    assert flat.tolist() == [0, 1, 2, 3 + 12, 4 + 13, 5 + 14, 6, 7, 8, 9]


def test_scale_with_zero_and_inf():
    assert float(choose_scale(torch.tensor(0.0), torch.float16, 4)) == 1.0
    assert float(choose_scale(torch.tensor(float("inf")), torch.float16, 4)) == 1.0
    r = torch.zeros(3)
    q = quantize(torch.tensor([float("inf"), 1.0, 2.0]), torch.float16, torch.tensor(1.0), r)
    assert torch.isinf(q[0]) and torch.isfinite(r).all()


def test_error_feedback_keeps_the_rounding():
    v = torch.randn(1000) * 1e-3
    r = torch.zeros(1000)
    s = choose_scale(v.abs().max(), torch.float16, 2)
    q = quantize(v, torch.float16, s, r)
    assert torch.allclose(q.float() / s + r, v, rtol=0, atol=1e-12)


def test_wire_dtypes():
    assert wire_dtype("fp16") is torch.float16 and wire_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="wire dtype = 'fp8'"):
        wire_dtype("fp8")
    assert is_lossy(torch.float32, torch.float16) and is_lossy(torch.float16, torch.bfloat16)
    assert not is_lossy(torch.bfloat16, torch.float32) and not is_lossy(torch.float32, torch.float32)


def test_buckets_reverse_order_size_and_padding():
    ps = [
        ("a", torch.zeros(5)),
        ("b", torch.zeros(7)),
        ("c", torch.zeros(100)),
        ("d", torch.zeros(3, dtype=torch.float16)),
        ("e", torch.zeros(2, dtype=torch.float64)),
    ]
    classes = {"a": SYNC, "b": SYNC, "c": SYNC, "d": SYNC, "e": LOCAL}
    bk = build_buckets(ps, classes, bucket_numel=12, pad_to=4, class_order=(SYNC, LOCAL))
    assert [b.names for b in bk[SYNC]] == [["d"], ["c"], ["b", "a"]]  # reverse order; c alone (too big)
    assert [b.buffer.numel() for b in bk[SYNC]] == [4, 100, 12]
    assert bk[LOCAL][0].buffer.dtype == torch.float64 and bk[SYNC][0].buffer.dtype == torch.float32


def test_first_bucket_of_each_class_is_capped_as_in_ddp():
    ps = [(n, torch.zeros(4)) for n in "abcd"] + [(n, torch.zeros(4)) for n in "xyz"]
    classes = {**{n: SYNC for n in "abcd"}, **{n: LOCAL for n in "xyz"}}
    one = build_buckets(ps, classes, bucket_numel=100, pad_to=1, class_order=(SYNC, LOCAL))
    assert [b.names for b in one[SYNC]] == [["d", "c", "b", "a"]] and [b.names for b in one[LOCAL]] == [["z", "y", "x"]]
    bk = build_buckets(ps, classes, bucket_numel=100, pad_to=1, class_order=(SYNC, LOCAL), first_bucket_numel=6)
    # The gradients backward produces first (the last parameters) get a small bucket of their own.
    assert [b.names for b in bk[SYNC]] == [["d"], ["c", "b", "a"]]
    assert [b.names for b in bk[LOCAL]] == [["z"], ["y", "x"]]
    assert [b.index for b in bk[SYNC]] == [0, 1]


def test_sync_groups_get_high_priority_nccl_streams(monkeypatch):
    """SYNC communicators are created with is_high_priority_stream on NCCL; LOCAL ones and gloo not.
    (The CPU build of torch has no ProcessGroupNCCL: a stand-in Options class isolates the choice.)"""
    import torch.distributed as dist

    from topo_integrations.reducer.plan.groups import SYNC_KINDS, group_options

    class Options:
        is_high_priority_stream = False

    class FakeNCCL:
        pass

    FakeNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    assert SYNC_KINDS == ("intra", "inter", "leaf_rail", "spine_rail")
    for kind in SYNC_KINDS:
        assert group_options(kind, "nccl").is_high_priority_stream is True
        assert group_options(kind, "gloo") is None
    for kind in ("intra_low", "inter_low", "leaf_rail_low", "spine_rail_low"):
        assert group_options(kind, "nccl") is None


def test_collectives_refuse_a_tensor_off_the_comm_device():
    """Every collective checks the communication device before touching the network."""
    from topo_integrations.reducer.plan.groups import ReducerGroups
    from topo_integrations.reducer.plan.planning import gather_hostnames_topology
    from topo_integrations.reducer.wire.collectives import agree_scalar, hierarchical_all_reduce
    from topo_integrations.topology import plan_groups

    plan = plan_groups(gather_hostnames_topology(["a", "a", "b", "b"]))
    g = ReducerGroups(plan=plan, dp_ranks=(0, 1, 2, 3), dp_group=None, position=0, intra=None, inter=None,
                      intra_low=None, inter_low=None, intra_size=2, inter_size=2, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"hierarchical_all_reduce was given a tensor on cpu; the communication "
                                          r"device of these groups is meta"):
        hierarchical_all_reduce(torch.ones(4), g)
    with pytest.raises(ValueError, match=r"agree_scalar\(sum\) was given a tensor on cpu"):
        agree_scalar(torch.ones(1), g)
