"""SM clock and power while each large-GEMM contender runs for seconds: is the fp8-block (or, with
``--w4a8``, the NVFP4 W4A8) GEMM's gap to ``_scaled_mm`` tensor-pipe idle time at the same clock,
or a lower clock under the power limit?

Run: ``python benchmarks/clocks_under_load.py [--out DIR] [--seconds 3] [--rounds 2] [--w4a8]``. Per
shape and round, each contender (ours at its dispatch config: fp8-block, or with ``--w4a8`` the W4A8
GEMM alone on activations quantized beforehand; FP8 ``_scaled_mm`` row-wise, bf16
``F.linear``) replays a CUDA graph of its rotated calls back to back for ``--seconds`` while
``nvidia-smi`` samples the SM clock and board power every 50 ms. Reports µs per call (CUDA events
over the window), the median clock and power over the window's last three quarters, TFLOP/s, and
FLOP per clock per SM (the dense FP8 peak is 8192, bf16 4096). Notes: ``notes/fp8_block.md``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_fp8_block import Problem  # benchmarks/gemm_fp8_block.py
from timing import copies_for  # benchmarks/timing.py

SHAPES = ((8192, 8192, 8192), (4096, 28672, 4096), (4096, 6144, 4096), (4096, 24576, 1536))
W4A8_SHAPES = ((4096, 4096, 4096), (4096, 6144, 4096), (4096, 28672, 4096), (4096, 4096, 14336))
QUERY = "clocks.sm,power.draw,temperature.gpu"


def w4a8_fns(m: int, n: int, k: int) -> list:
    """The W4A8 GEMM alone (bf16 ``[M, N]`` out) over rotated NVFP4 weight copies ``[N, K]``
    (random normal), on one random-normal activation quantized beforehand."""
    from gemm_nvfp4 import quantized  # benchmarks/gemm_nvfp4.py

    from quantkit.kernels.sm90 import nvfp4_gemm as ng
    from quantkit.kernels.sm90 import nvfp4_w4a8 as nw8

    qw = quantized(n, k, seed=n + k)
    preps = [ng.prepare(qw.data, qw.scale, qw.tensor_scale) for _ in range(copies_for(n * k * 9 // 16))]
    xq, xs = nw8.quantize_activation(torch.randn(m, k, device="cuda").to(torch.bfloat16))
    return [lambda p=p: nw8.nvfp4_w4a8_quantized(xq, xs, p) for p in preps]


def sustained(fns, seconds: float) -> dict:
    """Replay a graph of ``fns`` back to back for ``seconds``; µs per call, and the median SM clock
    (MHz), power (W) and temperature (C) that ``nvidia-smi`` saw over the last three quarters."""
    graph = torch.cuda.CUDAGraph()
    for f in fns:  # compile and warm outside the capture
        f()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replays = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            graph.replay()
        replays += 4
        end.record()
        end.synchronize()  # keeps the host within a few replays of the GPU, so the window is real
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = [[float(v) for v in line.split(",")] for line in lines if line.count(",") == 2]
    steady = samples[len(samples) // 4:] or samples
    us = start.elapsed_time(end) * 1e3 / (replays * len(fns))
    clock, power, temp = (statistics.median(s[i] for s in steady) for i in range(3))
    return {"us": us, "mhz": clock, "watts": power, "temp_c": temp, "samples": len(steady)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--w4a8", action="store_true", help="ours = the NVFP4 W4A8 GEMM (on W4A8_SHAPES)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, n, k in W4A8_SHAPES if args.w4a8 else SHAPES:
        p = Problem(m, n, k, gen)
        contenders = {"ours": w4a8_fns(m, n, k) if args.w4a8 else p.ours_fns(None), "bf16": p.bf16_fns()}
        if (smm := p.scaled_mm_fns()) is not None:
            contenders["scaled_mm"] = smm
        for rnd in range(args.rounds):
            for name, fns in contenders.items():
                r = sustained(fns, args.seconds)
                r.update(shape=f"{m}x{n}x{k}", contender=name, round=rnd, tflops=p.flops / r["us"] / 1e6)
                r["flop_per_clk_sm"] = p.flops / (r["us"] * 1e-6) / (r["mhz"] * 1e6) / sms
                print(json.dumps(r), flush=True)
                rows.append(r)
        del p, contenders
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "clocks_under_load.json").write_text(json.dumps(rows, indent=1))
    print(f"{'shape':>18} {'contender':>10} {'µs':>8} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} {'FLOP/clk/SM':>11}")
    for r in rows:
        print(f"{r['shape']:>18} {r['contender']:>10} {r['us']:8.1f} {r['tflops']:8.0f} {r['mhz']:6.0f} "
              f"{r['watts']:5.0f} {r['flop_per_clk_sm']:11.0f}")


if __name__ == "__main__":
    main()
