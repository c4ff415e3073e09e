"""Benchmark (and tune) the sm90 fp8-block decode GEMV against bf16 cuBLAS and the two-kernel path.

Run: ``python benchmarks/gemv_fp8_block.py [--out DIR] [--tune]``. Each contender computes a whole
fp8-block linear from bf16 activations: the GEMV (activations quantized in-kernel), the
activation-quantization kernel + the fp8-block GEMM in its dispatch config (the path before the
GEMV), and bf16 ``F.linear``. Every timed GEMV config is first checked against float64 math
(output poisoned with NaN). Times: medians over CUDA-graph replays, weights rotated over > 2x L2.
Achieved TB/s counts the bytes that must move: FP8 weight + its scales + bf16 activations and output.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from gemm_fp8_block import L2_BYTES, gemm_f64, rel  # noqa: E402  (benchmarks/)
from quantkit.formats import fp8
from quantkit.kernels.epilogue import Epilogue
from quantkit.kernels.sm90 import act_quant as aq
from quantkit.kernels.sm90 import fp8_block_gemm as fbg
from quantkit.kernels.sm90 import fp8_block_gemv as fgv
from timing import graph_median_us  # noqa: E402

SHAPES = {
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "llama3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
    "deepseek-v3": [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)],
}
TOKENS = (1, 4, 8, 16)


def candidates(m: int, n: int, k: int) -> list[fgv.Fp8GemvConfig]:
    """Every GEMV config that fits: 4 or 8 warps, 2-4 stages, K-splits of 1, 2, 4 (clusters)."""
    tokens = 1 << (m - 1).bit_length()
    out = []
    for warps in (4, 8):
        for stages in (2, 3, 4):
            for splits in (1, 2, 4):
                cfg = fgv.Fp8GemvConfig(warps, 1, stages, splits, tokens, pdl=True, cluster=splits > 1)
                try:
                    cfg.check(Epilogue())
                except ValueError:
                    continue
                if (k // 128) // splits // warps >= 2:
                    out.append(cfg)
    return out


class Problem:
    """bf16 activations and fp8-block weights for ``x[M, K] @ w[N, K].T``, with rotation copies."""

    def __init__(self, m: int, n: int, k: int, gen: torch.Generator):
        self.m, self.n, self.k = m, n, k
        self.copies = max(1, min(16, math.ceil(2 * L2_BYTES / (n * k))))
        self.x = [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(self.copies)]
        w = [torch.randn(n, k, generator=gen, device="cuda") * 0.05 for _ in range(self.copies)]
        self.wq = [fp8.quantize(wi, (128, 128)) for wi in w]
        self.wb = [wi.to(torch.bfloat16) for wi in w]
        xq, xs = fp8.quantize(self.x[0].float(), (1, 128))
        self.ref = gemm_f64(xq, xs, *self.wq[0]).to(torch.bfloat16)
        self.bytes = n * k + (n // 128) * (k // 128) * 4 + 2 * m * k + 2 * m * n

    def check(self, cfg: fgv.Fp8GemvConfig | None) -> float:
        out = torch.full((self.m, self.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fgv.fp8_block_gemv(self.x[0], *self.wq[0], config=cfg, out=out)
        torch.cuda.synchronize()
        err = rel(out, self.ref)
        if out.isnan().any() or not err < 1e-3:
            raise AssertionError(f"{cfg} wrong at M={self.m} N={self.n} K={self.k}: rel err {err:.2e}")
        return err

    def gemv(self, cfg: fgv.Fp8GemvConfig | None) -> float:
        return graph_median_us([(lambda i=i: fgv.fp8_block_gemv(self.x[i], *self.wq[i], config=cfg))
                                for i in range(self.copies)])

    def two_kernels(self) -> float:
        return graph_median_us([(lambda i=i: fbg.fp8_block_gemm(*aq.act_quant(self.x[i]), *self.wq[i]))
                                for i in range(self.copies)])

    def bf16(self) -> float:
        return graph_median_us([(lambda i=i: torch.nn.functional.linear(self.x[i], self.wb[i]))
                                for i in range(self.copies)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tune", action="store_true", help="also time every candidate config")
    parser.add_argument("--models", nargs="*", default=list(SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    for model in args.models:
        for n, k in SHAPES[model]:
            for m in args.tokens:
                prob = Problem(m, n, k, gen)
                rule = fgv.pick_gemv_config(m, n, k, Epilogue())
                err = prob.check(None)
                tune = {}
                if args.tune:
                    for cfg in candidates(m, n, k):
                        prob.check(cfg)
                        tune[str(cfg)] = prob.gemv(cfg)
                t_gemv, t_two, t_bf16 = prob.gemv(None), prob.two_kernels(), prob.bf16()
                best = min(tune, key=tune.get) if tune else str(rule)
                row = dict(model=model, m=m, n=n, k=k, rule=str(rule), err=err, gemv_us=t_gemv, two_kernel_us=t_two,
                           bf16_us=t_bf16, tb_per_s=prob.bytes / t_gemv / 1e6, best=best,
                           best_us=tune.get(best, t_gemv), tune=tune)
                rows.append(row)
                print(f"{model} N={n:6d} K={k:6d} M={m}: gemv {t_gemv:7.1f} us {row['tb_per_s']:5.2f} TB/s | "
                      f"act_quant+gemm {t_two:7.1f} | bf16 {t_bf16:7.1f} | x{t_bf16 / t_gemv:.2f} bf16, "
                      f"x{t_two / t_gemv:.2f} two-kernel | best {row['best_us']:7.1f} {best} | err {err:.1e}", flush=True)
                del prob
    print("\n| model | N x K | M | GEMV µs | TB/s | act_quant + GEMM µs | bf16 µs | x bf16 | x two-kernel | best tuned µs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['n']}x{r['k']} | {r['m']} | {r['gemv_us']:.1f} | {r['tb_per_s']:.2f} | "
              f"{r['two_kernel_us']:.1f} | {r['bf16_us']:.1f} | {r['bf16_us'] / r['gemv_us']:.2f} | "
              f"{r['two_kernel_us'] / r['gemv_us']:.2f} | {r['best_us']:.1f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemv_fp8_block.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                                  indent=1))


if __name__ == "__main__":
    main()
