"""Where a compiled decode step's GPU time goes: ``torch.profiler`` over a few replays of a CUDA
graph of an Inductor-compiled decode step (on CPU: the compiled step) of a random-init model,
kernel time per step grouped by kernel name.

    python benchmarks/profile_decode.py --format nvfp4-w4a16 [--config llama-3.1-8b] [--batch 1] [--sequence 40] [--fuse] [--attention flex|packed|repeat-kv]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import quantkit
from quantkit.eval import bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="nvfp4-w4a16", help="'bf16' = unquantized")
    p.add_argument("--config", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--sequence", type=int, default=0, help="also list the first N kernels of a step in launch order")
    p.add_argument("--fuse", action="store_true", help="quantkit.fuse_projections first (q/k/v, gate/up as one GEMM)")
    p.add_argument("--attention", choices=("flex", "packed", "repeat-kv"),
                   help="FlexAttention decoding over a BlockMask, packed-GQA SDPA, or transformers' own sdpa "
                        "(copies the cache per query head under compile); default: as `quantkit bench --compile` "
                        "on this device (flex on CUDA, packed on CPU)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (CPU operators instead of kernels)")
    args = p.parse_args()
    flex_default = bench.BenchSettings(compile="inductor").uses_flex(args.device)
    attention = args.attention or ("flex" if flex_default else "packed")
    if attention == "flex" and args.device == "cpu":
        p.error("--attention flex needs a CUDA device, as quantkit bench --flex-attention does")

    model = bench.random_init_model(bench.load_config(args.config), device=args.device, format=args.format)
    if attention != "repeat-kv":
        quantkit.nn.use_packed_gqa_attention(model, flex=attention == "flex")
    if args.fuse:
        quantkit.fuse_projections(model)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.context), device=args.device)
    with torch.inference_mode():
        step, _ = bench.greedy_decoder(model, prompt, args.context + args.steps + 16, compile_backend="inductor")
        cuda = args.device == "cuda"
        if cuda:  # as `quantkit bench` times it: replays of the captured compiled step
            step = bench.capture_graph(step, warmup=3).replay
        for _ in range(3):  # compile and warm up
            step()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(args.steps):
                step()
            sync()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    launches = sorted((e for e in prof.events() if e.device_type == kind), key=lambda e: e.time_range.start)

    def duration(event) -> float:
        return event.device_time_total if cuda else event.self_cpu_time_total

    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in launches:
        per_name[event.name][0] += duration(event) / args.steps
        per_name[event.name][1] += 1 / args.steps
    total = sum(t for t, _ in per_name.values())
    if args.sequence:
        print(f"first {args.sequence} kernels of the first profiled step, in launch order "
              "(start and end in us from the first one's start; duration):")
        t0 = launches[0].time_range.start if launches else 0
        for e in launches[:args.sequence]:
            print(f"{e.time_range.start - t0:9.2f} {e.time_range.end - t0:9.2f} {duration(e):8.2f} us  {e.name[:90]}")
    print(f"{args.format} batch {args.batch}: GPU kernel time per step {total / 1e3:.3f} ms, "
          f"{sum(c for _, c in per_name.values()):.0f} kernels per step")
    for name, (t, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{t / 1e3:8.3f} ms {count:6.0f}x {t / max(count, 1):8.2f} us  {name[:110]}")


if __name__ == "__main__":
    main()
