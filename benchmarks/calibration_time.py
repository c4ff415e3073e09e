"""Calibration wall time per algorithm on 8B-class decoder layers (Llama-3.1-8B shapes, random init).

Builds the ``--config`` architecture (default Llama-3.1-8B) cut to ``--layers`` decoder layers, random bf16 weights, and times
``quantkit.quantize`` for each recipe on the same token batch (seconds per decoder layer).

    python benchmarks/calibration_time.py --device cuda --layers 2 --samples 128 --seq-len 512
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.eval.bench import load_config

RECIPES = [("nvfp4", "rtn"), ("nvfp4", "mse"), ("nvfp4", "gptq"), ("nvfp4", "awq"), ("nvfp4", "awq+gptq+mse"),
           ("fp8-block", "rtn"), ("fp8-block", "gptq"), ("fp8", "smoothquant")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3.1-8b", help="shipped config name or config.json path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--recipes", nargs="+", default=[f"{f}:{a}" for f, a in RECIPES], help="FORMAT:ALGOS, e.g. nvfp4:awq+mse")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = load_config(args.config)
    config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.samples, args.seq_len))
    rows = []
    for fmt, algo in (r.split(":") for r in args.recipes):
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        quantkit.quantize(model, quantkit.Recipe.parse(fmt, algo), ids, device=args.device, batch_size=8)
        if args.device == "cuda":
            torch.cuda.synchronize()
        per_layer = (time.perf_counter() - start) / args.layers
        rows.append({"format": fmt, "algorithm": algo, "seconds_per_layer": per_layer})
        print(f"{fmt:10s} {algo:14s} {per_layer:8.2f} s/layer", flush=True)
        del model
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "samples": args.samples, "seq_len": args.seq_len, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
