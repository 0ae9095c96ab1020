"""FSDP2 (``fully_shard``) training of a small Llama-like model, torchtitan-style, with or without topo-align.

Every rank builds the same model (RMSNorm, causal attention with rotary embeddings, SwiGLU), shards
each block and then the root on the island row of ``island_mesh`` and trains on synthetic tokens.
With ``--topo-align`` the cross-island reduction of every reduce-scatter output is the engine's
(``topo_integrations.fsdp.apply``, docs/fsdp.md); without it the same model is native HSDP on the
whole 2-D mesh (FSDP2 all-reduces across islands itself).

    torchrun --standalone --nproc-per-node 4 scripts/fsdp2_llama.py --topo-align --virtual-nodes 2
    python scripts/fsdp2_llama.py --topo-align     # no launcher: starts 4 gloo ranks itself

Rank 0 prints one line per step (loss, gradient norm) and a summary (slow-tier bytes of topo-align).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topo-align", action="store_true",
                    help="reduce across islands with topo-align (else native HSDP)")
    ap.add_argument("--config", help="JSON file with a topo_align block (default: the block's defaults)")
    ap.add_argument("--virtual-nodes", type=int, default=2,
                    help="pretend the ranks sit on this many hosts (0: the real hostnames)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--checkpoint", help="save a DCP checkpoint (model, optimizer, topo-align state) here at the end")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when no launcher started this script")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- the model

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` [batch, heads, seq, head_dim]."""
    d, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = torch.outer(torch.arange(n, dtype=torch.float32, device=x.device), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        hidden = 4 * dim * 2 // 3
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------- training

def batch(a, step: int, micro: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tokens with a learnable rule (next token = 3 * token + 1 mod vocab)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    x[:, 1:] = (3 * x[:, :-1] + 1) % a.vocab
    return x[:, :-1].to(device), x[:, 1:].to(device)


def rank_main(rank: int, world: int, a: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from topo_integrations.config import TopoAlignConfig
    from topo_integrations.fsdp import apply, island_groups, island_mesh

    if a.virtual_nodes:
        from topo_integrations.reducer.plan.planning import HOSTNAME_ENV

        os.environ[HOSTNAME_ENV] = f"vnode{rank * a.virtual_nodes // world}"
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    block = json.loads(Path(a.config).read_text()) if a.config else {}
    block.setdefault("topology", {"source": "hostnames"} if a.virtual_nodes else {})
    cfg = TopoAlignConfig.from_block(block)
    groups = island_groups(cfg)  # the plan's islands and the engine's process groups
    mesh = island_mesh(groups, device.type)  # 2-D: ("replicate", "shard"), a row per island
    torch.manual_seed(0)  # every rank builds the same model
    model = Llama(a.vocab, a.dim, a.layers, a.heads).to(device)
    shard_on = mesh["shard"] if a.topo_align else mesh
    # torchtitan's mixed precision on GPUs (bf16 compute, fp32 reduction); fp32 on the CPU
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if cuda else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=shard_on, mp_policy=mp)
    fully_shard(model, mesh=shard_on, mp_policy=mp, reshard_after_forward=False)
    ta = apply(model, groups, cfg) if a.topo_align else None  # else native HSDP, as it comes
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(a.grad_accum):
            model.set_requires_gradient_sync(micro == a.grad_accum - 1)  # reduce on the last micro-batch only
            x, y = batch(a, step, micro, rank, device)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / a.grad_accum
            loss.backward()
            total += float(loss.detach())
        norm = ta.clip_grad_norm_(a.max_norm) if ta else nn.utils.clip_grad_norm_(model.parameters(), a.max_norm)
        opt.step()
        if ta:
            ta.after_optimizer_step(opt)
        losses.append(total)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # torch's clip: a DTensor (every rank)
        if rank == 0:
            print(f"step {step + 1}/{a.steps}: loss {total:.4f}, grad norm {float(norm):.3f}", flush=True)
    report = {"topo_align": cfg.mode if ta else None, "steps": a.steps, "first_loss": round(losses[0], 4),
              "last_loss": round(losses[-1], 4), "seconds": round(time.perf_counter() - t0, 1),
              "params": sum(p.numel() for p in model.parameters())}
    if ta:
        st = ta.stats()
        report.update(sync_dtype=st["sync_dtype"], inter_bytes=sum(st["total"]["bytes"]["inter"].values()))
    if a.checkpoint:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if ta:
            ta.reconcile(opt)  # selective: identical replicas before saving
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd} | ({"topo_align": ta.checkpoint_state()} if ta else {})
        dcp.save(state, checkpoint_id=a.checkpoint)
        report["checkpoint"] = a.checkpoint
    if ta:
        ta.close()
    return report


def main(argv=None) -> int:
    a = parse(argv)
    if a.dim % a.heads or (a.dim // a.heads) % 2:
        print(f"--dim {a.dim} must be a multiple of 2 x --heads {a.heads}", file=sys.stderr)
        return 2
    if "RANK" in os.environ:  # torchrun started this process
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        report = rank_main(dist.get_rank(), dist.get_world_size(), a)
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return 0
    else:
        from topo_integrations.testing import run_world

        report = run_world(a.nproc, rank_main, a, timeout=600, env={"OMP_NUM_THREADS": "1"})[0]
    ok = math.isfinite(report["last_loss"]) and report["last_loss"] < report["first_loss"]
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
