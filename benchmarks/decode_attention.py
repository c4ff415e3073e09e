"""Decode attention (one query token, grouped-query heads, a static KV cache with a padding mask):
the SDPA calls a compiled decode step makes, against torch's FlexAttention decoding kernel.

Contenders, each checked against float64 math first, then timed in interleaved rounds of CUDA-graph
replays (median µs):

* ``sdpa-repeat``: transformers' ``sdpa`` path (``repeat_kv`` copies each key/value head for its
  ``G`` query heads, then SDPA with the mask);
* ``sdpa-packed``: :func:`quantkit.nn.attention.packed_gqa_sdpa` (queries ``[B, H_kv, G, D]``);
* ``flex``: ``flex_attention(..., enable_gqa=True)`` compiled, the mask applied as a ``score_mod``
  (reads every cached position, as SDPA does);
* ``flex-block``: the same with a ``BlockMask`` whose ``mask_mod`` reads the mask, as
  ``quantkit bench --compile --flex-attention`` builds it, so unfilled cache blocks are skipped
  (built outside the timed region; once per step in a model). Session 37's numbers came from a
  ``mask_mod`` comparing with the filled length (same blocks, no mask read in the partial one).

Bytes that must move: the filled keys and values (``B·H_kv·L·D·2`` each in bf16), the queries and
the output; TB/s is reported against those, so ``flex-block`` is the only one that can reach the
copy rate when ``L`` < the cache length.

Run on a GPU: ``python benchmarks/decode_attention.py [--batches 1,8,32] [--filled 512] [--cache 640]``
(Llama-3.1-8B heads by default: 32 query heads, 8 key/value heads, head dim 128).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import interleaved_us, medians

from quantkit.nn.attention import packed_gqa_sdpa


def reference(q, k, v, mask, scale):
    """float64 softmax(q·kᵀ·scale masked)·v with ``q [B, H, 1, D]``, ``k``/``v [B, H_kv, S, D]``,
    ``mask [B, 1, 1, S]`` (True = attend): ``[B, H, 1, D]``."""
    groups = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    s = (q.double() @ k64.transpose(-1, -2)) * scale
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v64)


def contenders(q, k, v, mask, scale):
    """Name -> zero-argument callable returning ``[B, H, 1, D]`` for every contender."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers.integrations.sdpa_attention import repeat_kv

    batch, heads = q.shape[:2]
    groups = heads // k.shape[1]
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))[:, 0, 0]

    def masked(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    def allowed(b, h, q_idx, kv_idx):  # as quantkit.nn.attention.decode_block_mask builds it
        return mask[b, 0, 0, kv_idx]

    block = create_block_mask(allowed, batch, None, 1, k.shape[2], device=q.device)
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    module = torch.nn.Module()
    return {
        "sdpa-repeat": lambda: F.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=scale),
        "sdpa-packed": lambda: packed_gqa_sdpa(module, q, k, v, mask, scaling=scale)[0].transpose(1, 2),
        "flex": lambda: flex(q, k, v, score_mod=masked, scale=scale, enable_gqa=True),
        "flex-block": lambda: flex(q, k, v, block_mask=block, scale=scale, enable_gqa=True),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--filled", type=int, default=512, help="filled cache positions (the rest masked)")
    ap.add_argument("--cache", type=int, default=640, help="static cache length")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; H={args.heads} H_kv={args.kv_heads} "
          f"D={args.dim}, cache {args.cache}, filled {args.filled}; µs (median of {args.rounds} rounds), "
          "TB/s of the filled K/V + q + out, ratio to sdpa-packed")
    for batch in (int(b) for b in args.batches.split(",")):
        q = torch.randn(batch, args.heads, 1, args.dim, device=dev, dtype=dt)
        k, v = (torch.randn(batch, args.kv_heads, args.cache, args.dim, device=dev, dtype=dt) for _ in range(2))
        mask = (torch.arange(args.cache, device=dev) < args.filled).expand(batch, 1, 1, args.cache)
        scale = args.dim ** -0.5
        want = reference(q, k, v, mask, scale)
        fns = contenders(q, k, v, mask, scale)
        for name, fn in fns.items():
            err = ((fn().double() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{name}: relative error {err:.2e} against float64"
        times = medians(interleaved_us({name: [fn] for name, fn in fns.items()}, rounds=args.rounds))
        nbytes = 2 * (2 * batch * args.kv_heads * args.filled * args.dim + 2 * batch * args.heads * args.dim)
        base = times["sdpa-packed"]
        row = "  ".join(f"{n} {t:7.1f} µs {nbytes / t / 1e6:4.2f} TB/s {base / t:4.2f}x" for n, t in times.items())
        print(f"batch {batch:3d}: {row}")


if __name__ == "__main__":
    main()
