"""MoE calibration cost: Qwen3-30B-A3B-shaped decoder layers (128 experts, top-8, H=2048, I=768),
random bf16 weights, every expert run on every calibration token.

Times ``quantkit.quantize`` per recipe (seconds per decoder layer), the peak device memory, and one
forward of the quantized model; prints one line per recipe.

    python benchmarks/moe_calibration.py --layers 2 --samples 128 --seq-len 512        # H200
    python benchmarks/moe_calibration.py --device cpu --experts 8 --hidden 256 --inter 128 --samples 4 --seq-len 64
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import quantkit

RECIPES = [("nvfp4", "rtn"), ("nvfp4", "gptq"), ("nvfp4-w4a16", "gptq")]


def config(args: argparse.Namespace) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's decoder shapes (vocabulary cut to 32k) with ``args`` overrides."""
    return Qwen3MoeConfig(vocab_size=32000, hidden_size=args.hidden, moe_intermediate_size=args.inter,
                          intermediate_size=6144, num_hidden_layers=args.layers, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=args.experts, num_experts_per_tok=8)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (args.samples, args.seq_len))
    rows = []
    for fmt, algo in RECIPES:
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config(args), dtype=torch.bfloat16).eval()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(args.device)
        start = time.perf_counter()
        report = quantkit.quantize(model, quantkit.Recipe.parse(fmt, algo), ids, device=args.device, batch_size=8)
        sync(args.device)
        per_layer = (time.perf_counter() - start) / args.layers
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
        with torch.no_grad():
            start = time.perf_counter()
            logits = model(ids[:1].to(args.device)).logits
            sync(args.device)
            forward = time.perf_counter() - start
        experts = sum(".experts." in r.name for r in report.quantized)
        rows.append({"format": fmt, "algorithm": algo, "seconds_per_layer": per_layer, "peak_gib": peak,
                     "expert_linears_quantized": experts, "skipped": [r.name for r in report.skipped],
                     "forward_seconds": forward, "finite": bool(torch.isfinite(logits).all())})
        print(f"{fmt:12s} {algo:5s} {per_layer:7.2f} s/layer  peak {peak:6.1f} GiB  {experts} expert Linears  "
              f"skipped {len(report.skipped)}  1x{args.seq_len} forward {forward:.2f} s  finite {rows[-1]['finite']}",
              flush=True)
        del model, report
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
