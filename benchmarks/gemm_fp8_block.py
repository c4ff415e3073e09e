"""Benchmark (and tune) the sm90 fp8-block GEMM on one Hopper GPU.

Run: ``python benchmarks/gemm_fp8_block.py [--out DIR] [--tune]``. Every timed kernel is first
checked on fresh random-normal inputs against float64 math (output poisoned with NaN before the
launch). Times are medians over CUDA-graph replays (CUDA events), with inputs rotated across enough
copies to exceed L2; a row's contenders are timed in turn over ``--rounds`` rounds (default 3) and each
reports its median round (timed once each in a fixed order, the first kernel after a compile ran up
to 15 % fast on a cool H200, session 29). Contenders in the same run: bf16 ``F.linear`` (cuBLAS), FP8 ``torch._scaled_mm``
with row-wise scales (per-token x per-channel, coarser than our 128-blocks), and ``torch._scaled_mm``
on our own operands and scales (1x128 activation, 128x128 weight blocks: cuBLAS's block-scaled FP8
GEMM, with CUDA >= 12.9: the same function as ours, from NVIDIA's library; checked against the
same float64 reference, left out where unsupported). ``--tune`` times every
candidate tile config per shape and prints the dispatch table it implies (``--tune-ms M ...``: at
those token counts only, e.g. between two buckets' tuning points); ``--tune-rows M`` instead
times the ``LARGE_CANDIDATES`` on the table's rows with ``M >= M`` and uses each row's fastest;
``--tune-rows M --ab VARIANT ...`` (defer, unroll, tanh, unroll16, early_bias) times only those rows, each
dispatch config against those variants;
``--shapes N,K ...`` keeps only those weight shapes; ``--act-quant`` times only the activation
quantization (bf16 -> FP8 1x128 groups, with and without RMSNorm). ``--partial-tiles`` times only
``fp8_block_linear`` at token counts whose last tile is partial (its operands tile-high) against the
same act_quant + GEMM on x's own rows and bf16, 3 interleaved rounds. ``--split-ab`` times only
the small-M rows (:data:`SPLIT_MS` tokens) in their dispatch config against K-split clusters of
small tiles (:func:`split_candidates`) and bf16, 3 interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from quantkit.formats import fp8
from quantkit.kernels.epilogue import Epilogue
from quantkit.kernels.sm90 import act_quant as aq
from quantkit.kernels.sm90 import fp8_block_gemm as fbg
from timing import graph_median_us, interleaved_us, medians  # noqa: E402  (benchmarks/timing.py)

L2_BYTES = 60 << 20
SQUARE = [(8192, 8192, 8192)]
DSV3 = [(n, k, m) for n, k in [(2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)] for m in (64, 128, 4096)]
LLAMA = [(n, k, m) for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] for m in (1, 16, 4096)]
# Hugging Face Llama runs k_proj / v_proj unfused: a 1024-row weight fills few SMs at prefill sizes
# (session 9: 0.61x bf16 at M=128 through the untabled default tile).
UNFUSED = [(1024, 4096, m) for m in (128, 512, 2048)]
CANDIDATES = [
    fbg.TileConfig(64, 64), fbg.TileConfig(64, 128), fbg.TileConfig(128, 64), fbg.TileConfig(128, 128),
    fbg.TileConfig(64, 128, 1, 2), fbg.TileConfig(128, 128, 1, 2),
    fbg.TileConfig(64, 64, overlap=False), fbg.TileConfig(128, 128, overlap=False),
]
TUNE_M = (1, 16, 64, 128, 512, 4096)
# Rows whose bias+SiLU(+requant) epilogues are timed against the bare GEMM.
EPILOGUE_ROWS = [(8192, 8192, 8192), (4096, 28672, 4096), (4096, 4096, 4096), (4096, 24576, 1536), (16, 4096, 4096)]
# Same-run A/B variants of a large-M dispatch config (--ab): the deferred epilogue flipped, the
# overlapped mainloop's straight-line groups (one wait_group(0) per group) of 4 k-tiles, or of 16
# against 8, SiLU through tanh.approx (one MUFU op per element) against ex2 + rcp, or the bias
# loaded as the tile's mainloop starts against in its epilogue (a control on the bare GEMM rows).
AB_VARIANTS = {
    "defer": lambda cfg: replace(cfg, defer_epilogue=not cfg.defer_epilogue),
    "unroll": lambda cfg: replace(cfg, unroll=8 if cfg.unroll == 4 else 4),
    "tanh": lambda cfg: replace(cfg, act_tanh=not cfg.act_tanh),
    "unroll16": lambda cfg: replace(cfg, unroll=16 if cfg.unroll != 16 else 8),
    "early_bias": lambda cfg: replace(cfg, early_bias=not cfg.early_bias),
}
# Large-M variants: raster groups (L2 reuse), 2-CTA multicast of A (1x2) or B (2x1), 192-column
# tiles (no overlap). Call 1 of session 2 also timed raster 4/16 without clusters, 128x128 without
# overlap and 192 with raster 1: never fastest (notes/fp8_block.md).
LARGE_CANDIDATES = [
    fbg.TileConfig(128, 128), fbg.TileConfig(128, 128, 1, 2, raster=2), fbg.TileConfig(128, 128, 1, 2, raster=4),
    fbg.TileConfig(128, 128, 1, 2, raster=8), fbg.TileConfig(128, 128, 2, 1, raster=4),
    fbg.TileConfig(128, 192, overlap=False, raster=4), fbg.TileConfig(128, 192, 2, 1, overlap=False, raster=4),
]


SPLIT_MS = (32, 64, 128)


def split_candidates(m: int, n: int, k: int, num_sms: int) -> list[fbg.TileConfig]:
    """K-split variants for a small-M row: 64x64 and 64x128 tiles (64x64, 128x64 and 128x128
    above 64 tokens), unsplit and with 2, 4 or 8 splits where the splits divide the k-tiles into
    runs of >= 4 and the grid fills 1/2 to ~2 waves."""
    tiles = [(64, 64), (64, 128)] if m <= 64 else [(64, 64), (128, 64), (128, 128)]
    out = []
    kt = k // 128
    for tm, tn in tiles:
        ctas = -(-m // tm) * (n // tn)
        for s in (1, 2, 4, 8):
            if kt % s or kt // s < 4 or (s > 1 and not num_sms / 2 <= ctas * s <= 2.2 * num_sms):
                continue
            unroll = next((u for u in (8, 4, 2) if (kt // s) % u == 0), 8)
            out.append(fbg.TileConfig(tm, tn, unroll=unroll, overlap=(kt // s) % unroll == 0, splits=s))
    return out


def split_ab(gen: torch.Generator, shapes: set | None, ms: list[int]) -> list[dict]:
    """Per small-M row: the dispatch config, :func:`split_candidates` and bf16 in 3 interleaved
    rounds (each config checked against float64 first); µs medians."""
    from quantkit.kernels.cache import num_sms

    rows = []
    pairs = sorted({(n, k) for n, k, _ in DSV3 + LLAMA + UNFUSED})
    for n, k in pairs:
        if shapes and (n, k) not in shapes:
            continue
        for m in ms:
            prob = Problem(m, n, k, gen)
            picked = fbg.pick_config(m, n, k)
            cands = list(dict.fromkeys([picked, *split_candidates(m, n, k, num_sms(torch.device("cuda")))]))
            ok = []
            for c in cands:
                try:
                    prob.check(c)
                    ok.append(c)
                except (AssertionError, RuntimeError, ValueError) as err:
                    print(f"  {c} M={m} N={n} K={k}: {str(err).splitlines()[0][:160]}", flush=True)
            contenders = {str(c): prob.ours_fns(c) for c in ok} | {"bf16": prob.bf16_fns()}
            med = medians(interleaved_us(contenders, rounds=3, reps=15))
            best = min((c for c in ok), key=lambda c: med[str(c)])
            rows.append({"m": m, "n": n, "k": k, "picked": str(picked), "us": med})

            def short(c: fbg.TileConfig) -> str:
                return f"{c.tile_m}x{c.tile_n}/s{c.splits}"
            print(f"M={m:4d} N={n:6d} K={k:6d}: bf16 {med['bf16']:6.1f} | picked {short(picked)} {med[str(picked)]:6.1f} | "
                  f"best {short(best)} {med[str(best)]:6.1f} (x{med[str(picked)] / med[str(best)]:.2f}) | "
                  + " ".join(f"{short(c)} {med[str(c)]:.1f}" for c in ok), flush=True)
            del prob
    return rows


def _ab_candidates(picked: fbg.TileConfig, names: list[str]) -> list[fbg.TileConfig]:
    """``picked`` and its ``names`` variants (``a+b``: both applied), without repeats."""
    def variant(name: str) -> fbg.TileConfig:
        cfg = picked
        for part in name.split("+"):
            cfg = AB_VARIANTS[part](cfg)
        return cfg
    return list(dict.fromkeys([picked, *(variant(v) for v in names)]))


def gemm_f64(xq, xs, wq, ws):
    """float64 ``sum_kb (xq_kb @ wq_kb.T) * xs[:, kb] * ws[n//128, kb]`` on the GPU."""
    m, k = xq.shape
    n = wq.shape[0]
    xd, wd = xq.double(), wq.double()
    ws_rows = ws.double().repeat_interleave(128, 0)[:n]
    acc = torch.zeros(m, n, dtype=torch.float64, device=xq.device)
    for b in range(k // 128):
        blk = slice(128 * b, 128 * (b + 1))
        acc += (xd[:, blk] @ wd[:, blk].T) * xs.double()[:, b, None] * ws_rows[None, :, b]
    return acc


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Problem:
    """Random-normal operands for ``x[M, K] @ w[N, K].T``, quantized, with rotation copies."""

    def __init__(self, m: int, n: int, k: int, gen: torch.Generator):
        self.m, self.n, self.k = m, n, k
        per_call = m * k + n * k + 2 * m * n
        self.copies = max(1, min(16, math.ceil(2 * L2_BYTES / per_call)))
        self.x = [torch.randn(m, k, generator=gen, device="cuda") for _ in range(self.copies)]
        self.w = [torch.randn(n, k, generator=gen, device="cuda") * 0.05 for _ in range(self.copies)]
        self.xq = [fp8.quantize(x, (1, 128)) for x in self.x]
        self.wq = [fp8.quantize(w, (128, 128)) for w in self.w]
        self.xs_tma = [fbg.scales_for_tma(s) for _, s in self.xq]
        self.ref = gemm_f64(self.xq[0][0], self.xq[0][1], *self.wq[0]).to(torch.bfloat16)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def check(self, cfg: fbg.TileConfig) -> float:
        out = torch.full((self.m, self.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fbg.fp8_block_gemm(self.xq[0][0], self.xs_tma[0], *self.wq[0], config=cfg, out=out)
        torch.cuda.synchronize()
        err = rel(out, self.ref)
        if out.isnan().any() or not err < 1e-3:
            raise AssertionError(f"{cfg} wrong at M={self.m} N={self.n} K={self.k}: rel err {err:.2e}, NaNs {int(out.isnan().sum())}")
        return err

    def ours_fns(self, cfg: fbg.TileConfig | None, epilogue: Epilogue = Epilogue(), bias=None) -> list:
        cfg = cfg or fbg.pick_config(self.m, self.n, self.k, epilogue)
        return [(lambda i=i: fbg.fp8_block_gemm(self.xq[i][0], self.xs_tma[i], *self.wq[i], epilogue, bias, config=cfg))
                for i in range(self.copies)]

    def ours(self, cfg: fbg.TileConfig) -> float:
        return graph_median_us(self.ours_fns(cfg))

    def bf16_fns(self) -> list:
        xb = [x.to(torch.bfloat16) for x in self.x]
        wb = [w.to(torch.bfloat16) for w in self.w]
        return [(lambda i=i: torch.nn.functional.linear(xb[i], wb[i])) for i in range(self.copies)]

    def blockwise_mm_fns(self) -> tuple[list | None, float]:
        """cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with our 1x128 activation scales,
        M-major, and 128x128 weight scales) on our quantized operands, and its relative error against
        the float64 reference; ``(None, nan)`` (the reason printed) where this torch/GPU lacks it or
        the error is not below 1e-2."""
        xs = [s.t().contiguous().t() for _, s in self.xq]  # (M, K/128) with stride (1, M)
        fns = [(lambda i=i: torch._scaled_mm(self.xq[i][0], self.wq[i][0].t(), scale_a=xs[i],
                                             scale_b=self.wq[i][1].t(), out_dtype=torch.bfloat16))
               for i in range(self.copies)]
        try:
            err = rel(fns[0](), self.ref)
        except (RuntimeError, ValueError) as e:  # cuBLAS without an algorithm; torch refusing the scale layout
            print(f"  block-scaled _scaled_mm unavailable (M={self.m}): {str(e).splitlines()[0][:160]}", flush=True)
            return None, float("nan")
        if not err < 1e-2:
            print(f"  block-scaled _scaled_mm left out (M={self.m} N={self.n} K={self.k}): rel err {err:.1e}", flush=True)
            return None, float("nan")
        return fns, err

    def scaled_mm_fns(self) -> list | None:
        """FP8 ``_scaled_mm`` with row-wise scales, or None where this torch/GPU lacks it."""
        xr = [fp8.quantize(x, (1, 0)) for x in self.x]
        wr = [fp8.quantize(w, (1, 0)) for w in self.w]
        fns = [(lambda i=i: torch._scaled_mm(xr[i][0], wr[i][0].t(), scale_a=xr[i][1], scale_b=wr[i][1].t(),
                                             out_dtype=torch.bfloat16)) for i in range(self.copies)]
        try:
            fns[0]()
        except RuntimeError:
            return None
        return fns


PARTIAL_M = (17, 33, 65, 100, 129, 200)


def partial_tiles(gen: torch.Generator) -> list[dict]:
    """``fp8_block_linear`` (act_quant into tile-high operands, the GEMM on whole token tiles)
    against act_quant + ``fp8_block_gemm`` on x's own rows and bf16 ``F.linear``, on the Llama
    shapes at :data:`PARTIAL_M` tokens; after a float64 check of the linear path."""
    out = []
    for n, k in sorted({(n, k) for n, k, _ in LLAMA}):
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.05
        wq, ws = fp8.quantize(w, (128, 128))
        wb = w.to(torch.bfloat16)
        for m in PARTIAL_M:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            xq, xs = fp8.quantize(x.float(), (1, 128))
            err = rel(fbg.fp8_block_linear(x, wq, ws), gemm_f64(xq, xs, wq, ws).to(torch.bfloat16))
            assert err < 1e-3, (m, n, k, err)
            us = interleaved_us({"linear": [lambda: fbg.fp8_block_linear(x, wq, ws)],
                                 "own rows": [lambda: fbg.fp8_block_gemm(*aq.act_quant(x), wq, ws)],
                                 "bf16": [lambda: torch.nn.functional.linear(x, wb)]})
            row = dict(m=m, n=n, k=k, err=err, **medians(us))
            out.append(row)
            print(f"M={m:4d} N={n:6d} K={k:6d}: linear {row['linear']:7.1f} us, own rows {row['own rows']:7.1f} us, "
                  f"bf16 {row['bf16']:7.1f} us: x{row['own rows'] / row['linear']:.2f} own rows, "
                  f"x{row['bf16'] / row['linear']:.2f} bf16", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-ms", type=int, nargs="+", default=list(TUNE_M), metavar="M",
                        help="token counts --tune times (default: the dispatch buckets' tuning points); "
                             "the dispatch table is printed only for the default set")
    parser.add_argument("--tune-rows", type=int, default=None, metavar="M",
                        help="time LARGE_CANDIDATES on the table rows with M >= this and use each row's fastest")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="N,K",
                        help="only these (N, K) weight shapes (tuning and table rows)")
    parser.add_argument("--ab", nargs="+", default=None, metavar="VARIANT",
                        help=f"with --tune-rows: time each row's dispatch config against these variants ({', '.join(AB_VARIANTS)}; "
                             "a+b combines two) (also for the epilogue rows), and stop after those rows")
    parser.add_argument("--act-quant", action="store_true", help="only the activation-quantization rows")
    parser.add_argument("--partial-tiles", action="store_true",
                        help="only: fp8_block_linear at partial-tile token counts vs the GEMM on x's own rows")
    parser.add_argument("--split-ab", action="store_true", help="only: small-M rows against K-split clusters")
    parser.add_argument("--split-ms", type=int, nargs="+", default=list(SPLIT_MS), metavar="M")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds that time a row's contenders (and an epilogue row's kernels) in turn; medians are reported")
    args = parser.parse_args()
    if args.ab and args.tune_rows is None:
        parser.error("--ab needs --tune-rows M (the rows it compares)")
    unknown = {part for v in args.ab or () for part in v.split("+")} - set(AB_VARIANTS)
    if unknown:
        parser.error(f"unknown --ab variant(s) {sorted(unknown)}; choose from {sorted(AB_VARIANTS)}")
    gen = torch.Generator("cuda").manual_seed(0)
    if args.split_ab:
        keep = {tuple(int(v) for v in s.split(",")) for s in args.shapes} if args.shapes else None
        rows = split_ab(gen, keep, args.split_ms)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "split_ab.json").write_text(json.dumps(rows, indent=1))
        return
    if args.partial_tiles:
        rows = partial_tiles(gen)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "partial_tiles.json").write_text(json.dumps(rows, indent=1))
        return
    results = {"device": torch.cuda.get_device_name(), "rows": [], "tune": {}, "epilogue": [], "act_quant": []}

    rows = [] if args.act_quant else SQUARE + DSV3 + LLAMA + UNFUSED
    if args.shapes:
        keep = {tuple(int(v) for v in s.split(",")) for s in args.shapes}
        rows = [(n, k, m) for n, k, m in rows if (n, k) in keep]
    tuned: dict[tuple[int, int, int], fbg.TileConfig] = {}
    if args.tune:
        for n, k in sorted({(n, k) for n, k, _ in rows}):
            for m in args.tune_ms:
                prob = Problem(m, n, k, gen)
                times = {}
                for cfg in CANDIDATES:
                    try:
                        prob.check(cfg)
                        times[str(cfg)] = prob.ours(cfg)
                    except Exception as err:  # noqa: BLE001 — report and keep tuning
                        print(f"  {cfg} M={m} N={n} K={k}: {str(err).splitlines()[0][:160]}")
                best = min(times, key=times.get)
                tuned[(n, k, m)] = next(c for c in CANDIDATES if str(c) == best)
                results["tune"][f"{n}x{k}@{m}"] = times
                print(f"tune N={n:6d} K={k:6d} M={m:5d}: best {best} {times[best]:9.1f} us  "
                      + " ".join(f"{t:8.1f}" for t in times.values()), flush=True)
                del prob
        if tuple(args.tune_ms) == TUNE_M:  # every bucket tuned: the table they imply
            print("_DISPATCH = {")
            for n, k in sorted({(n, k) for n, k, _ in tuned}):
                entries = ", ".join(f"({m if m < TUNE_M[-1] else '1 << 31'}, {tuned[(n, k, m)]!r})" for m in TUNE_M)
                print(f"    ({n}, {k}): ({entries}),")
            print("}")

    if args.ab:
        rows = [(n, k, m) for n, k, m in rows if m >= args.tune_rows]
    for n, k, m in rows:
        prob = Problem(m, n, k, gen)
        if args.tune_rows is not None and m >= args.tune_rows:
            times = {}
            picked = fbg.pick_config(m, n, k)
            candidates = _ab_candidates(picked, args.ab) if args.ab else LARGE_CANDIDATES
            for cand in candidates:
                try:
                    prob.check(cand)
                    times[str(cand)] = prob.ours(cand)
                except (AssertionError, RuntimeError, ValueError) as err:  # report and keep tuning
                    print(f"  {cand} M={m} N={n} K={k}: {str(err).splitlines()[0][:160]}", flush=True)
                    times[str(cand)] = float("inf")
            tuned[(n, k, m)] = min(candidates, key=lambda c: times[str(c)])
            results["tune"][f"{n}x{k}@{m}"] = times
            print(f"tune N={n:6d} K={k:6d} M={m:5d}: " + " ".join(f"{t:8.1f}" for t in times.values()), flush=True)
        cfg = tuned.get((n, k, m)) or fbg.pick_config(m, n, k)
        err = prob.check(cfg)
        block_fns, block_err = prob.blockwise_mm_fns()
        contenders = {"ours": prob.ours_fns(cfg), "bf16": prob.bf16_fns(), "scaled_mm": prob.scaled_mm_fns(),
                      "block_mm": block_fns}
        med = medians(interleaved_us({c: f for c, f in contenders.items() if f is not None}, rounds=args.rounds, reps=15,
                                     on_error=lambda c: print(f"  {c} failed while timed: {traceback.format_exc(limit=2)}")))
        t_ours, t_bf16, t_smm = med["ours"], med["bf16"], med.get("scaled_mm", float("nan"))
        t_bmm = med.get("block_mm", float("nan"))
        tf = lambda t, flops=prob.flops: flops / t / 1e6  # noqa: E731
        row = dict(m=m, n=n, k=k, cfg=str(cfg), err=err, ours_us=t_ours, bf16_us=t_bf16, scaled_mm_us=t_smm,
                   block_mm_us=t_bmm, block_mm_err=block_err,
                   ours_tflops=tf(t_ours), bf16_tflops=tf(t_bf16), scaled_mm_tflops=tf(t_smm),
                   block_mm_tflops=tf(t_bmm))
        results["rows"].append(row)
        print(f"M={m:5d} N={n:6d} K={k:6d} {cfg}: ours {t_ours:8.1f} us {tf(t_ours):7.1f} TF | bf16 {tf(t_bf16):7.1f} TF"
              f" | scaled_mm {tf(t_smm):7.1f} TF | block_mm {tf(t_bmm):7.1f} TF | x{t_bf16 / t_ours:.2f} bf16"
              f" x{t_smm / t_ours:.2f} smm x{t_bmm / t_ours:.2f} block_mm | err {err:.1e}", flush=True)
        if (m, n, k) in EPILOGUE_ROWS:
            # Each epilogue against the bare GEMM in the dispatch table's config (t_ours).
            # Without --ab each epilogue runs in its own dispatch config (they differ in early_bias on
            # immediate-epilogue tiles); an --ab variant applies to both.
            epi = Epilogue(bias=True, activation="silu", requant="fp8-block")
            silu = Epilogue(bias=True, activation="silu")
            bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
            picked = fbg.pick_config(m, n, k, epi)
            variants = [(picked, fbg.pick_config(m, n, k, silu))]
            if args.ab:
                variants = [(c, c) for c in _ab_candidates(picked, args.ab)]
            for epi_cfg, silu_cfg in variants:  # each variant's four kernels interleaved in args.rounds rounds
                med = medians(interleaved_us({"bare": prob.ours_fns(cfg), "epi": prob.ours_fns(epi_cfg, epi, bias),
                                              "silu": prob.ours_fns(silu_cfg, silu, bias),
                                              "same": prob.ours_fns(epi_cfg)},  # the bare GEMM in the epilogue's config
                                             rounds=args.rounds, reps=15))
                t_ours, t_epi, t_silu, t_same = med["bare"], med["epi"], med["silu"], med["same"]
                results["epilogue"].append(dict(m=m, n=n, k=k, cfg=str(epi_cfg), rounds=args.rounds, bare_us=t_ours,
                                                bare_same_cfg_us=t_same, bias_silu_us=t_silu, bias_silu_requant_us=t_epi))
                print(f"  epilogue ({epi_cfg}) bias+silu+requant: {t_epi:8.1f} us, bias+silu (bf16) {t_silu:8.1f} us,"
                      f" bare {t_ours:8.1f} us (same config {t_same:8.1f}): x{t_epi / t_ours:.3f}, x{t_silu / t_ours:.3f}",
                      flush=True)
        del prob

    for m, k in [] if args.ab else [(1, 4096), (16, 7168), (512, 4096), (2048, 4096), (4096, 4096), (4096, 7168),
                                    (8192, 16384)]:
        x = [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(max(1, min(16, (2 * L2_BYTES) // (3 * m * k))))]
        w = torch.rand(k, generator=gen, device="cuda").to(torch.bfloat16) + 0.5
        for rms in (False, True):
            t = graph_median_us([(lambda xi=xi: aq.act_quant(xi, w if rms else None)) for xi in x])
            gbs = 3 * m * k / t / 1e3
            results["act_quant"].append(dict(m=m, k=k, rmsnorm=rms, us=t, gb_per_s=gbs))
            print(f"act_quant M={m:5d} K={k:6d} rmsnorm={rms}: {t:8.1f} us {gbs:7.1f} GB/s", flush=True)

    print("\n| M | N | K | config | ours TF/s | bf16 TF/s | _scaled_mm TF/s | block-scaled TF/s | vs bf16 "
          "| vs _scaled_mm | vs block-scaled |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['m']} | {r['n']} | {r['k']} | {r['cfg'].replace('TileConfig', '')} | {r['ours_tflops']:.0f} | {r['bf16_tflops']:.0f} "
              f"| {r['scaled_mm_tflops']:.0f} | {r['block_mm_tflops']:.0f} | {r['bf16_us'] / r['ours_us']:.2f} "
              f"| {r['scaled_mm_us'] / r['ours_us']:.2f} | {r['block_mm_us'] / r['ours_us']:.2f} |")
    print("\n| M, N, K | config | bare µs (dispatch config) | bare µs (this config) | bias+silu µs (x) | bias+silu+requant µs (x) |")
    print("|---|---|---|---|---|---|")
    for r in results["epilogue"]:
        print(f"| {r['m']}, {r['n']}, {r['k']} | {r['cfg'].replace('TileConfig', '')} | {r['bare_us']:.1f} | {r['bare_same_cfg_us']:.1f} "
              f"| {r['bias_silu_us']:.1f} ({r['bias_silu_us'] / r['bare_us']:.2f}) "
              f"| {r['bias_silu_requant_us']:.1f} ({r['bias_silu_requant_us'] / r['bare_us']:.2f}) |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemm_fp8_block.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
