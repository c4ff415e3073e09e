"""Where an eager prefill's time goes: for each format, one ``[batch, seq]`` forward of a random-init
model (``quantkit bench``'s prefill) timed three ways, in the same run:

* **eager**: ``quantkit bench``'s own timer (:func:`quantkit.eval.bench.time_call`: CUDA events
  around the eager forward, L2 flushed before each);
* **graph**: the same forward captured once as a CUDA graph and replayed (no host launch path);
* **host**: ``perf_counter`` around the eager forward's enqueue (no synchronization inside).

and the forward's GPU kernel time by kernel family from ``torch.profiler``, and its host time by
operator (self CPU time, the ``--host-ops`` largest). If *eager* is well above *graph*, the host
launch path is exposed; if *graph* is above the bf16 *graph* by less than the GEMM tables promise,
the difference is in the kernels. ``--fuse``: :func:`quantkit.fuse_projections` first; ``--compile``:
the forward through ``torch.compile`` (Inductor), as ``quantkit bench --compile`` runs it.

Run: ``python benchmarks/prefill_breakdown.py [--formats bf16 nvfp4-w4a8] [--shape 1x2048] [--fuse] [--compile]
[--host-ops 15]``.
"""
import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quantkit  # noqa: E402
from quantkit.eval.bench import load_config, random_init_model, time_call  # noqa: E402
from timing import graph_median_us  # noqa: E402  (benchmarks/timing.py)


def family(name: str) -> str:
    """A short label for a CUDA kernel name."""
    for key, label in (("Nvfp4Gemm", "nvfp4 gemm"), ("ActQuant", "w4a8 act quant"), ("Gemv", "gemv"),
                       ("Fp8Block", "fp8-block"), ("flash", "attention"), ("fmha", "attention"),
                       ("gemm", "cublas gemm"), ("nvjet", "cublas gemm"), ("elementwise", "elementwise"),
                       ("reduce", "reduce")):
        if key.lower() in name.lower():
            return label
    return "other"


@torch.inference_mode()
def breakdown(fmt: str, batch: int, seq: int, iters: int, fuse: bool = False, compiled: bool = False,
              host_ops: int = 0) -> dict:
    model = random_init_model(load_config("llama-3.1-8b"), device="cuda", format=fmt)
    if fuse:
        quantkit.fuse_projections(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    forward = torch.compile(model) if compiled else model
    fwd = lambda: forward(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    eager_s = time_call(fwd, warmup=3, iters=iters, device=ids.device)
    host = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    graph_s = graph_median_us([fwd], reps=iters) / 1e6
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host_ops else [])
    with torch.profiler.profile(activities=activities) as prof:
        fwd()
        torch.cuda.synchronize()
    kernels = defaultdict(float)
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[family(ev.key)] += ev.device_time_total / 1e3  # ms
    cpu = [ev for ev in prof.key_averages() if ev.device_type == torch.autograd.DeviceType.CPU]
    top = sorted(cpu, key=lambda ev: -ev.self_cpu_time_total)[:host_ops]
    tokens = batch * seq
    return {"format": fmt, "shape": f"{batch}x{seq}", "eager_ms": 1e3 * eager_s,
            "graph_ms": 1e3 * graph_s, "host_ms": 1e3 * statistics.median(host),
            "eager_tok_s": tokens / eager_s, "graph_tok_s": tokens / graph_s,
            "kernel_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "host_ops": [(ev.key, ev.count, ev.self_cpu_time_total / 1e3) for ev in top]}  # name, calls, self ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "nvfp4-w4a8"])
    ap.add_argument("--shape", default="1x2048")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fuse", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--host-ops", type=int, default=0, help="list the N operators with the most host time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batch, seq = (int(v) for v in args.shape.split("x"))
    rows = []
    for fmt in args.formats:
        rows.append(breakdown(fmt, batch, seq, args.iters, args.fuse, args.compile, args.host_ops))
        torch.cuda.empty_cache()  # the model of each format is freed before the next is built
    base = rows[0]
    for r in rows:
        print(f"{r['format']:>12} {r['shape']}: eager {r['eager_ms']:.2f} ms (x{base['eager_ms'] / r['eager_ms']:.2f}), "
              f"graph {r['graph_ms']:.2f} ms (x{base['graph_ms'] / r['graph_ms']:.2f}), host enqueue {r['host_ms']:.2f} ms; "
              "kernels ms: " + ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ms"].items()))
        for name, calls, ms in r["host_ops"]:
            print(f"    host {ms:7.2f} ms  {calls:5d} calls  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
