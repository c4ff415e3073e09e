"""Compiled decode with FlexAttention against packed-GQA SDPA, both in one process: each model is
built once (random weights, q/k/v and gate/up fused) and every (batch, model) pair is timed with
both attention paths, so the A/B shares the machine, the models and the warm-up.

Each measurement is ``quantkit.eval.bench.bench_decode`` (Inductor, one static graph per batch
size, CUDA-graph replay, ``--context`` prompt tokens then 64 timed steps); lines print as they
finish, so a run cut short keeps what it measured. CUDA only: on the CPU, Inductor's FlexAttention
template rejects the bf16 model.

    python benchmarks/decode_flex_ab.py [--batches 32,8] [--formats nvfp4-w4a16,bf16] [--config llama-3.1-8b]
"""
from __future__ import annotations

import argparse
import time

import quantkit
from quantkit.eval import bench
from quantkit.nn.attention import use_packed_gqa_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="32,8")
    p.add_argument("--formats", default="nvfp4-w4a16,bf16", help="'bf16' = unquantized")
    p.add_argument("--config", default="llama-3.1-8b")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    t0 = time.time()
    config, models = bench.load_config(a.config), {}
    for fmt in a.formats.split(","):
        model = bench.random_init_model(config, device=a.device, format=fmt)
        quantkit.fuse_projections(model)
        models[fmt] = model
    for batch in (int(b) for b in a.batches.split(",")):
        for fmt, model in models.items():
            for flex in (True, False):
                model.set_attn_implementation("sdpa")
                use_packed_gqa_attention(model, flex=flex)
                settings = bench.BenchSettings(decode_batches=(batch,), context=a.context, compile="inductor")
                r = bench.bench_decode(model, settings)[0]
                print(f"{fmt:12s} batch {batch:3d} {'flex' if flex else 'sdpa'}: {r.tokens_per_s:10,.1f} tokens/s "
                      f"(cuda graph {r.cuda_graph}{', ' + r.note if r.note else ''}) [{time.time() - t0:.0f} s]",
                      flush=True)


if __name__ == "__main__":
    main()
