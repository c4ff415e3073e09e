"""fp8-block linear (activation quantization + GEMM, 17+ tokens) with both kernels launched as
programmatic dependents against plain launches, on one Hopper GPU: µs per linear in CUDA-graph
replays over 8 rotated inputs, both variants and bf16 in 3 interleaved rounds (bf16's one weight
copy may stay in L2). ``--gap``: each linear's input first goes through an RMSNorm launched without
PDL (as in a model, where Inductor's kernels sit between the linears). Correctness:
``test_gpu_pdl_linear_chain_equals_the_plain_launches``."""
from __future__ import annotations

import argparse

import torch
from timing import interleaved_us, medians  # benchmarks/timing.py

from quantkit.formats import fp8
from quantkit.kernels.sm90 import fp8_block_gemm as fbg

SHAPES = [(4096, 4096), (2112, 7168), (4096, 14336), (6144, 4096), (28672, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--gap", action="store_true", help="an RMSNorm (no PDL) before each linear")
    args = parser.parse_args()
    pre = (lambda x: torch.nn.functional.rms_norm(x, x.shape[-1:])) if args.gap else (lambda x: x)
    gen = torch.Generator("cuda").manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.03
        wq, ws = fp8.quantize(w, (128, 128))
        wb = w.to(torch.bfloat16)
        for m in args.ms:
            xs = [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(8)]
            med = medians(interleaved_us({
                "plain": [lambda x=x, wq=wq, ws=ws: fbg.fp8_block_linear(pre(x), wq, ws, pdl=False) for x in xs],
                "pdl": [lambda x=x, wq=wq, ws=ws: fbg.fp8_block_linear(pre(x), wq, ws, pdl=True) for x in xs],
                "bf16": [lambda x=x, wb=wb: torch.nn.functional.linear(pre(x), wb) for x in xs]}, rounds=3, reps=15))
            print(f"M={m:4d} N={n:6d} K={k:6d}: plain {med['plain']:6.1f} us, pdl {med['pdl']:6.1f} us "
                  f"(x{med['plain'] / med['pdl']:.3f}), bf16 {med['bf16']:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
