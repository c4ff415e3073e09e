"""Check and benchmark the sm90 NVFP4 GEMMs (W4A16, W4A8) on one Hopper GPU.

Run: ``python benchmarks/gemm_nvfp4.py [--out DIR] [--skip-check] [--shapes 8b 70b] [--quick]
[--no-quack] [--no-tinygemm] [--tune] [--variants] [--floors]``; notes and results:
``benchmarks/notes/nvfp4.md``.

1. **Check** (a subprocess, overlapping the benchmark's compiles): every kernel on fresh
   random-normal inputs, output poisoned with NaN, compared with float64 math: W4A16 with the
   dequantized weight, W4A8 with :func:`quantkit.formats.w4a8.accumulate` (its documented
   rounding), for M in {1, 3, 16, 64, 257, 4096} and each epilogue kind; the tinygemm contender
   against float64 math on its own int4 weight.
2. **Benchmark**: Llama-3-8B and -70B projection shapes at M in {1, 4, 16, 64, 256, 4096}
   (W4A8 also at 1024, 2048 for the crossover): ours (W4A16, W4A8 incl. its activation
   quantization), bf16 cuBLAS (``F.linear``), dequantize-then-matmul, and QuACK
   ``gemm_w4a16(wformat="nvfp4")`` at M <= 64 when importable, and torchao's int4 weight-only
   kernel (tinygemm, ``aten._weight_int4pack_mm``, group 128: what ``Int4WeightOnlyConfig`` runs
   with ``int4_packing_format="tile_packed_to_4d"``) at M <= 256 on an int4 copy of the weight
   (4.25 bits per weight against NVFP4's 4.5); at the W4A8 token counts also FP8 ``torch._scaled_mm``
   with row-wise scales on FP8 weights (W4A8's ceiling: the same tensor-core work, no weight
   decode; ``gemm x fp8 mm`` compares W4A8's GEMM alone with it). Median of CUDA-graph replays (CUDA
   events), a row's contenders timed in turn over 3 rounds (median round);
   weights rotated across enough copies to exceed L2. TB/s counts the bytes that must move
   (weights + scales + x + out). Prints the table last; JSON and logs go to ``--out``.
3. ``--tune``: every candidate config on representative shapes (what ``pick_config`` is fitted
   to); ``--variants``: decode A/B of the PDL and batched-issue code variants; ``--floors``: M=1
   against a plain streaming read of the same bytes and the fixed cost of one launch.
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats import fp8, get_format, w4a8  # noqa: E402
from quantkit.formats.codecs import e2m1_decode, unpack_nibbles  # noqa: E402
from quantkit.kernels import cache as kcache  # noqa: E402
from quantkit.kernels.epilogue import Epilogue, apply_activation, interleave_gate_up  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemm as ng  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemv as gv  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_w4a8 as nw8  # noqa: E402
from timing import copies_for, graph_median_us, interleaved_us, medians, rotated  # noqa: E402  (benchmarks/timing.py)

SHAPES = {  # (N, K) of the projections: qkv, o, gate_up, down
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
    # Llama-3.1-8B as transformers runs it (no fused q/k/v or gate/up): k/v, gate/up, q/o, down
    "8b-hf": [(1024, 4096), (14336, 4096), (4096, 4096), (4096, 14336)],
    "405b": [(18432, 16384), (16384, 16384), (106496, 16384), (16384, 53248)],
    "qwen2.5-7b": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
}
MS = [1, 4, 16, 64, 256, 1024, 4096]
W4A8_MS = [64, 256, 1024, 2048, 4096]
TINYGEMM_GROUP, TINYGEMM_MAX_M = 128, 256


def log(msg, fh=None):
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()


def watchdog(seconds: float, what: str):
    """Exit the process (code 3) if ``what`` takes longer than ``seconds`` (a hung kernel)."""
    timer = threading.Timer(seconds, lambda: (print(f"WATCHDOG: {what} exceeded {seconds}s", flush=True),
                                              os._exit(3)))
    timer.daemon = True
    timer.start()
    return timer


def quantized(n, k, seed=0, swiglu=False, device="cuda"):
    torch.manual_seed(seed)
    w = torch.randn(n, k, device=device) * 0.05
    if swiglu:
        w = interleave_gate_up(w[: n // 2], w[n // 2:])
    return get_format("nvfp4-w4a16").quantize_weight(w)


_LUT = {}


def dequant(qw) -> torch.Tensor:
    """FP32 ``e2m1 · s_b · s_g`` in plain torch (the dequantize-then-matmul baseline's first half;
    no host-to-device copies, so it can be graph-captured once the LUT exists)."""
    dev = qw.data.device
    if dev not in _LUT:
        _LUT[dev] = e2m1_decode(torch.arange(16, dtype=torch.uint8, device=dev))
    n, kh = qw.data.shape
    vals = _LUT[dev][unpack_nibbles(qw.data).int()].view(n, -1, 16) * qw.scale.float()[..., None]
    return vals.view(n, 2 * kh) * qw.tensor_scale.float()


def int4_tinygemm(w: torch.Tensor, group: int = TINYGEMM_GROUP):
    """torchao's int4 weight-only quantization of ``w`` [n, k] for tinygemm: per ``group`` along K
    an asymmetric uint4 code ``q = round((w - min) / s)``, ``s = (max - min) / 15`` and a float zero
    point ``z = min + 8 s`` (both bf16), so ``w ≈ (q - 8)·s + z``. Returns ``(packed, sz, deq)``:
    ``packed`` for ``aten._weight_int4pack_mm`` (inner k-tiles 8, on ``w``'s CUDA device),
    ``sz`` [k/group, n, 2] bf16 (scale, zero) and ``deq`` [n, k] FP32, the weight it computes with."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo[..., None]) / s[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    s16, z16 = s.to(torch.bfloat16), (lo + 8 * s).to(torch.bfloat16)
    deq = (q.view(n, -1, group).float() - 8) * s16.float()[..., None] + z16.float()[..., None]
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
    return packed, torch.stack([s16, z16], -1).transpose(0, 1).contiguous(), deq.view(n, k)


def tinygemm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x`` [m, k] bf16 times the int4 weight of :func:`int4_tinygemm`, transposed: [m, n] bf16."""
    return torch.ops.aten._weight_int4pack_mm(x, packed, TINYGEMM_GROUP, sz)


# ----------------------------------------------------------------------------------- check
CHECK_EPILOGUES = [Epilogue(bias=True, activation="silu", residual=True), Epilogue(activation="gelu_tanh"),
                   Epilogue(activation="relu"), Epilogue(activation="swiglu", bias=True, residual=True)]


def check_case(mode, m, n, k, epi, seed, config=None):
    qw = quantized(n, k, seed, epi.activation == "swiglu")
    prep = ng.prepare(qw.data, qw.scale, qw.tensor_scale)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    n_out = n // 2 if epi.activation == "swiglu" else n
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if epi.bias else None
    res = torch.randn(m, n_out, device="cuda").to(torch.bfloat16) if epi.residual else None
    out = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn = nw8.nvfp4_w4a8 if mode == "w4a8" else ng.nvfp4_w4a16
    fn(x, prep, epi, bias, res, config=config, out=out)
    torch.cuda.synchronize()
    if mode == "w4a8":
        acc = w4a8.accumulate(x, qw.data, qw.scale, qw.tensor_scale).double()
    else:
        acc = x.double() @ dequant(qw).double().T
    y = acc + bias.double() if epi.bias else acc
    y = apply_activation(y, epi.activation)
    ref = y + res.double() if epi.residual else y
    unwritten = int(torch.isnan(out).sum())
    err = float((out.double() - ref).norm() / ref.norm())
    rounded = float((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm())  # the bf16 floor
    return unwritten, err, rounded


def check_act_quant(m, k):
    """The W4A8 activation quantization kernel vs :func:`w4a8.quantize_activation` (bit-exact)."""
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, k, device="cuda")).to(torch.bfloat16)
    x[0] = 0
    xq, s = nw8.quantize_activation(x)
    # the reference on the CPU: CUDA torch divides by a scalar as a multiply by its reciprocal
    rq, rs = w4a8.quantize_activation(x.cpu()[:, ng.w4a8_k_permutation(k)])
    return torch.equal(xq.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


def check_tinygemm(m, n, k):
    """The tinygemm contender against float64 math on its own int4 weight: relative error."""
    torch.manual_seed(m + n + k)
    packed, sz, deq = int4_tinygemm(torch.randn(n, k, device="cuda") * 0.05)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.double() @ deq.double().T
    return float((tinygemm(x, packed, sz).double() - ref).norm() / ref.norm())


def run_check(fh, gemv_only: bool = False) -> bool:
    cases = [] if gemv_only else [(mode, m, 1000, 2048, Epilogue()) for mode in ("w4a16", "w4a8") for m in (1, 3, 16, 64, 257, 4096)]
    variants = []
    if not gemv_only:
        cases += [(mode, 37, 1024, 1536, e) for mode in ("w4a16", "w4a8") for e in CHECK_EPILOGUES]
        cases += [("w4a16", 1, 512, 14336, Epilogue()), ("w4a16", 5, 256, 8192, Epilogue(activation="swiglu"))]
        variants = [ng.Config(bn, wgs, 4, sp, pdl, bat) for bn, wgs, sp in ((8, 1, 4), (16, 2, 2), (64, 1, 2))
                    for pdl in (False, True) for bat in (False, True)]
        variants += [ng.Config(128, 2, 5, 1), ng.Config(256, 2, 5, 1)]  # setmaxnreg-rebalanced tiles
    gemv_cases = [(m, n, k, Epilogue(), None) for name in SHAPES for n, k in SHAPES[name] for m in (1, 3, 4, 8)]
    gemv_cases += [(m, 1024, 1536, e, None) for e in CHECK_EPILOGUES for m in (1, 7)]
    gemv_cases += [(m, n, k, e, gv.pick_gemv_config(m, n, k, e)) for n, k in SHAPES["8b"] for m in (9, 16)
                   for e in (Epilogue(), Epilogue(activation="swiglu", bias=True))]  # 16-token slots
    gemv_cases += [(m, 1000, 2048, Epilogue(bias=True), cfg) for m in (2, 5) for cfg in GEMV_CHECKED]
    gemv_cases += [(m, 1000, 2048, Epilogue(bias=True), gv.GemvConfig(8, 1, 3, 2, tokens=t, pdl=True))
                   for m, t in ((1, 1), (2, 2), (3, 4))]
    gemv_cases += [(m, 2048, 4096, Epilogue(activation="swiglu", bias=True), gv.GemvConfig(4, 2, 4, s, tokens=t))
                   for m, s, t in ((4, 1, 4), (3, 3, 8), (1, 2, 1))]
    gemv_cases += [(m, 2048, 4096, Epilogue(activation="swiglu", bias=True, residual=True),
                    gv.GemvConfig(8, 2, 2, s, tokens=t, cluster=True)) for m, s, t in ((1, 2, 1), (3, 4, 4), (8, 3, 8))]
    ok = True
    for m, k in () if gemv_only else ((1, 4096), (37, 14336), (4096, 8192)):
        good = check_act_quant(m, k)
        log(f"CHECK {'PASS' if good else 'FAIL'} act_quant M={m} K={k} bit-exact", fh)
        ok &= good
    for m, n, k in () if gemv_only else ((1, 4096, 4096), (16, 6144, 4096), (64, 1024, 14336)):
        try:
            err = check_tinygemm(m, n, k)
            log(f"CHECK {'PASS' if err < 4e-3 else 'FAIL'} tinygemm (contender) M={m} N={n} K={k}: "
                f"rel_err={err:.2e}", fh)
        except Exception:  # noqa: BLE001  (a contender, not ours: its failure fails no check)
            log(f"CHECK ERROR tinygemm (contender) M={m}:\n{traceback.format_exc(limit=3)}", fh)
    for i, (mode, m, n, k, epi) in enumerate(cases):
        t0 = time.time()
        timer = watchdog(240, f"check {mode} m={m} {epi}")
        try:
            unwritten, err, floor = check_case(mode, m, n, k, epi, seed=i)
            good = unwritten == 0 and err < max(4e-3, 2 * floor)
            log(f"CHECK {'PASS' if good else 'FAIL'} {mode} M={m} N={n} K={k} {epi}: rel_err={err:.2e} "
                f"(bf16 floor {floor:.1e}) unwritten={unwritten} [{time.time() - t0:.1f}s]", fh)
            ok &= good
        except Exception:
            log(f"CHECK ERROR {mode} M={m} N={n} K={k} {epi}:\n{traceback.format_exc()}", fh)
            ok = False
        timer.cancel()
    for i, (m, n, k, epi, cfg) in enumerate(gemv_cases):
        timer = watchdog(240, f"check gemv m={m} {n}x{k} {epi} {cfg}")
        try:
            # cfg None: the default W4A16 route (nvfp4_gemv.use_gemv, the rule's config, tvm-ffi where installed)
            unwritten, err, floor = check_case("w4a16", m, n, k, epi, seed=200 + i, config=cfg)
            good = unwritten == 0 and err < max(4e-3, 2 * floor)
            shown = cfg or f"default route {gv.pick_gemv_config(m, -(-n // 128) * 128, k, epi)}"
            log(f"CHECK {'PASS' if good else 'FAIL'} gemv M={m} N={n} K={k} {epi} {shown}: rel_err={err:.2e} "
                f"(bf16 floor {floor:.1e}) unwritten={unwritten} tvm_ffi={kcache.use_tvm_ffi()}",
                fh)
            ok &= good
        except Exception:
            log(f"CHECK ERROR gemv M={m} N={n} K={k} {epi} {cfg}:\n{traceback.format_exc()}", fh)
            ok = False
        timer.cancel()
    for i, cfg in enumerate(variants):
        for mode in ("w4a8",) if cfg.bn == 256 else ("w4a16", "w4a8"):  # bn=256 bf16 tiles exceed smem
            m = {8: 3, 16: 11, 64: 50, 128: 200, 256: 300}[cfg.bn]
            try:
                unwritten, err, floor = check_case(mode, m, 1000, 2048, Epilogue(bias=True), seed=100 + i, config=cfg)
                good = unwritten == 0 and err < max(4e-3, 2 * floor)
                log(f"CHECK {'PASS' if good else 'FAIL'} variant {mode} M={m} {cfg}: rel_err={err:.2e} "
                    f"unwritten={unwritten}", fh)
                ok &= good
            except Exception:
                log(f"CHECK ERROR variant {mode} {cfg}:\n{traceback.format_exc()}", fh)
                ok = False
    return ok


# ----------------------------------------------------------------------------------- bench
def weight_copies(n: int, k: int, *, swiglu: bool = False, bf16: bool = True):
    """Rotating copies of the random NVFP4 weight ``[n, k]`` (seed ``n + k``), as many as overflow
    the L2 (:func:`copies_for`): ``(qw, preps, bf16s)``, ``preps`` laid out for our kernels and
    ``bf16s`` dequantized for cuBLAS (empty without ``bf16``)."""
    qw = quantized(n, k, seed=n + k, swiglu=swiglu)
    preps = [ng.prepare(qw.data, qw.scale, qw.tensor_scale) for _ in range(copies_for(n * k * 9 // 16))]
    bf16s = [dequant(qw).to(torch.bfloat16) for _ in range(copies_for(2 * n * k))] if bf16 else []
    return qw, preps, bf16s


def fp8_weights(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rotating copies of a random row-wise FP8 weight ``[n, k]`` (values, scales) for
    :func:`fp8_mm_fns`."""
    return [fp8.quantize(torch.randn(n, k, device="cuda"), (1, 0)) for _ in range(copies_for(n * k))]


def fp8_mm_fns(x: torch.Tensor, fp8s) -> list:
    """FP8 row-wise ``torch._scaled_mm`` of bf16 ``x [M, K]`` (quantized once, M a multiple of 16)
    on each of ``fp8s``: W4A8's tensor-core work with no weight decode, bf16 out."""
    xr, xrs = fp8.quantize(x, (1, 0))
    return [lambda w=w: torch._scaled_mm(xr, w[0].t(), scale_a=xrs, scale_b=w[1].t(), out_dtype=torch.bfloat16)
            for w in fp8s]


def load_quack():
    try:
        from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight
        return gemm_w4a16, prepare_w4_weight
    except Exception as err:  # noqa: BLE001
        print(f"QuACK unavailable: {err!r}")
        return None


ROUNDS = 3  # rounds of a benchmark row's contenders


def run_bench(shapes, ms, w4a8_ms, fh, deadline: float, quick=False, with_quack=True, with_tinygemm=True):
    """Time every contender of a row in turn (QuACK too, at M <= 64; tinygemm at M <= 256),
    ``ROUNDS`` rounds, each contender's median round; nothing new after ``deadline`` (time.time())."""
    quack = load_quack() if with_quack else None
    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            if time.time() > deadline:
                log(f"deadline reached: skipping {name} {n}x{k}", fh)
                continue
            qw = quantized(n, k, seed=n + k)
            w_bytes = n * k // 2 + n * k // 16
            nw = copies_for(w_bytes)
            ts = float(qw.tensor_scale)
            preps = [ng.prepare(qw.data, qw.scale, qw.tensor_scale) for _ in range(nw)]
            bf16s = [dequant(qw).to(torch.bfloat16) for _ in range(copies_for(2 * n * k))]
            qblobs = []
            if quack is not None and min(ms) <= 64:
                try:
                    qblobs = [quack[1](qw.data, qw.scale, wformat="nvfp4") for _ in range(nw)]
                except Exception:  # noqa: BLE001
                    log(f"QuACK prepare failed: {traceback.format_exc()}", fh)
            int4s, int4_bytes = [], n * k // 2 + 4 * n * (k // TINYGEMM_GROUP)
            if with_tinygemm and min(ms) <= TINYGEMM_MAX_M:
                try:
                    packed, sz, _ = int4_tinygemm(dequant(qw))
                    int4s = [(packed.clone(), sz.clone()) for _ in range(copies_for(int4_bytes))]
                except Exception:  # noqa: BLE001
                    log(f"tinygemm packing failed: {traceback.format_exc(limit=3)}", fh)
            fp8s = fp8_weights(n, k) if w4a8_ms else []  # for _scaled_mm: W4A8's ceiling with no decode
            for m in sorted(set(ms) | set(w4a8_ms)):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                io_bytes = 2 * m * k + 2 * m * n
                res = {"shape": f"{name} {n}x{k}", "n": n, "k": k, "m": m}
                contenders = {"bf16": ([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16s], 2 * n * k)}
                if m in ms:  # bf16 above: the baseline of W4A16 and W4A8 alike
                    contenders["w4a16"] = ([lambda p=p: ng.nvfp4_w4a16(x, p) for p in preps], w_bytes)
                    if m <= gv.MAX_M:
                        wg = ng.pick_config(m, preps[0].row_exp.shape[0], k, Epilogue(), False)
                        gcfg = gv.pick_gemv_config(m, preps[0].row_exp.shape[0], k, Epilogue())
                        contenders["wgmma"] = ([lambda p=p: ng.nvfp4_w4a16(x, p, config=wg) for p in preps], w_bytes)
                        contenders["gemv"] = ([lambda p=p: ng.nvfp4_w4a16(x, p, config=gcfg) for p in preps], w_bytes)
                    if not quick:
                        contenders["dequant+mm"] = (
                            [lambda: torch.nn.functional.linear(x, dequant(qw).to(torch.bfloat16))], w_bytes)
                    if qblobs and m <= 64:
                        contenders["quack"] = ([lambda b=b: quack[0](x, b[0], b[1], tensor_scale=ts, wformat="nvfp4")
                                                for b in qblobs], w_bytes)
                    if int4s and m <= TINYGEMM_MAX_M:
                        contenders["tinygemm"] = ([lambda b=b: tinygemm(x, *b) for b in int4s], int4_bytes)
                if m in w4a8_ms:
                    contenders["w4a8"] = ([lambda p=p: nw8.nvfp4_w4a8(x, p) for p in preps], w_bytes)
                    xq, xs = nw8.quantize_activation(x)
                    contenders["w4a8_gemm"] = ([lambda p=p: nw8.nvfp4_w4a8_quantized(xq, xs, p) for p in preps],
                                               w_bytes)
                    contenders["act_quant"] = ([lambda xc=xc: nw8.quantize_activation(xc)  # copies: launch gap amortized
                                                for xc in rotated(x)], 0)
                    if m % 16 == 0:  # cuBLAS FP8 wants M, N, K multiples of 16
                        contenders["fp8_mm"] = (fp8_mm_fns(x, fp8s), n * k)
                timer = watchdog(300 * ROUNDS * len(contenders), f"bench {res['shape']} m={m}")
                rounds = interleaved_us(  # in turn, so no contender alone gets a cool GPU's clock
                    {cname: fns for cname, (fns, _) in contenders.items()}, rounds=ROUNDS, reps=15,
                    on_error=lambda cname, shape=res["shape"], m=m: log(
                        f"BENCH ERROR {cname} {shape} M={m}: {traceback.format_exc(limit=3)}", fh))
                timer.cancel()
                for cname, us in medians(rounds).items():
                    res[cname] = us
                    res[cname + "_tbs"] = (contenders[cname][1] + io_bytes) / us / 1e6
                log("BENCH " + json.dumps(res), fh)
                rows.append(res)
            del preps, bf16s, qblobs, int4s, fp8s
            torch.cuda.empty_cache()
    return rows


def run_variants(shapes, fh, ms=(1, 16)):
    """Decode (M in ``ms``): the default config against the same config with PDL and/or batched
    WGMMA issue."""
    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            qw, preps, _ = weight_copies(n, k, bf16=False)
            n_pad = preps[0].row_exp.shape[0]
            for m in ms:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                base = ng.pick_config(m, n_pad, k, Epilogue(), False)
                row = {"shape": f"{name} {n}x{k}", "m": m, "config": str(base)}
                for label, cfg in (("default", base), ("pdl", dataclasses.replace(base, pdl=True)),
                                   ("batched", dataclasses.replace(base, batched=True)),
                                   ("pdl+batched", dataclasses.replace(base, pdl=True, batched=True))):
                    try:
                        row[label] = graph_median_us([lambda p=p, c=cfg: ng.nvfp4_w4a16(x, p, config=c) for p in preps])
                    except Exception:  # noqa: BLE001
                        log(f"VARIANT ERROR {label} {row['shape']}: {traceback.format_exc(limit=2)}", fh)
                rows.append(row)
                log("VARIANT " + json.dumps(row), fh)
            del preps
    return rows


def run_persistent_ab(shapes, fh, ms=(1024, 4096)):
    """Prefill: the default config (persistent where ``pick_config`` says so) against the same tile
    as one CTA per tile at its deepest pipeline (the rule before session 13) and, if persistent, in
    the other tile order (token tiles or weight row blocks fastest), for W4A8 (GEMM on quantized
    activations) and W4A16, beside bf16 ``F.linear`` and FP8 ``_scaled_mm``: 3 interleaved rounds."""
    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            _, preps, bf16s = weight_copies(n, k)
            fp8s = fp8_weights(n, k)
            n_pad = preps[0].row_exp.shape[0]
            for m in ms:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                xq, xs = nw8.quantize_activation(x)
                fns = {"bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16s]}
                if m % 16 == 0:
                    fns["fp8_mm"] = fp8_mm_fns(x, fp8s)
                for mode in ("w4a8", "w4a16"):
                    w4a8_mode = mode == "w4a8"
                    new = ng.pick_config(m, n_pad, k, Epilogue(), w4a8_mode)
                    deepest = [ng.Config(new.bn, new.warpgroups, s, new.splits) for s in range(8, 2, -1)]
                    old = next(c for c in deepest if ng.fits(c, Epilogue(), w4a8_mode))
                    cfgs = [new, old]
                    if new.persistent:  # and the other tile order
                        cfgs.append(dataclasses.replace(new, tokens_fastest=not new.tokens_fastest))
                    for cfg in cfgs:
                        if w4a8_mode:
                            fns[f"{mode} {cfg}"] = [lambda p=p, c=cfg: nw8.nvfp4_w4a8_quantized(xq, xs, p, config=c)
                                                    for p in preps]
                        else:
                            fns[f"{mode} {cfg}"] = [lambda p=p, c=cfg: ng.nvfp4_w4a16(x, p, config=c) for p in preps]
                row = {"shape": f"{name} {n}x{k}", "m": m, "us": interleaved_us(fns)}
                rows.append(row)
                log("PAB " + json.dumps(row), fh)
            del preps, bf16s, fp8s
            torch.cuda.empty_cache()
    return rows


def run_act_quant_sweep(fh, ms=(256, 1024, 2048, 4096, 8192), ks=(4096, 8192, 14336, 28672)):
    """W4A8 activation quantization: each held-groups variant (``nvfp4_w4a8.HELD``; a variant that
    cannot hold the row reads it twice) at every (M, K), 3 interleaved rounds."""
    rows = []
    tvm = kcache.use_tvm_ffi()
    for k in ks:
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.empty(m, dtype=torch.float32, device="cuda")
            fns = {h: [lambda h=h: nw8._executor(h, tvm)(x.data_ptr(), xq.data_ptr(), s.data_ptr(), m, k,
                                                          kcache.launch_stream(x.device, tvm))]  # the capture stream
                   for h in nw8.HELD}
            row = {"m": m, "k": k, "default": nw8.held_groups(k), "us": interleaved_us(fns, reps=15)}
            rows.append(row)
            log("AQ " + json.dumps(row), fh)
    return rows


GEMV_CHECKED = [gv.GemvConfig(w, 1, st, sp) for w, st, sp in ((4, 4, 1), (4, 2, 2), (8, 2, 3), (8, 3, 4))]
GEMV_CHECKED += [gv.GemvConfig(8, 1, st, sp, cluster=True, pdl=pdl) for st, sp, pdl in ((3, 2, True), (2, 3, False),
                                                                                         (2, 4, True))]


def gemv_grid(m, n_pad, k):
    """Decode GEMV configs to time for ``m`` tokens: 4 or 8 warps, 2..4 stages (what fits), 1..4
    K-splits (>= 2 k-tiles per warp), and PDL on the unsplit 8-warp ones; 8-warp K-splits also as
    clusters meeting in distributed shared memory, with PDL."""
    tokens = 1 << max(0, m - 1).bit_length()
    out = []
    for warps in (4, 8):
        for stages in (2, 3, 4):
            for splits in (1, 2, 3, 4):
                cfg = gv.GemvConfig(warps, 1, stages, splits, tokens)
                if cfg.smem_bytes() <= 227 * 1024 and (k // 128) // splits // warps >= 2:
                    out.append(cfg)
                    if warps == 8 and splits == 1:
                        out.append(dataclasses.replace(cfg, pdl=True))
                    if warps == 8 and splits > 1:
                        clustered = dataclasses.replace(cfg, pdl=True, cluster=True)
                        if clustered.smem_bytes() <= 227 * 1024:
                            out.append(clustered)
    return out


def run_gemv_tune(shapes, fh, deadline):
    """Decode GEMV at M = 1 and 8: every config of :func:`gemv_grid`; rows with every time."""
    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            if time.time() > deadline:
                log(f"gemv tune deadline: skipping {name} {n}x{k}", fh)
                continue
            qw, preps, _ = weight_copies(n, k, bf16=False)
            n_pad = preps[0].row_exp.shape[0]
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                base = gv.pick_gemv_config(m, n_pad, k, Epilogue())
                times = {}
                for cfg in gemv_grid(m, n_pad, k):
                    try:
                        times[str(cfg)] = graph_median_us([lambda p=p, c=cfg: ng.nvfp4_w4a16(x, p, config=c)
                                                           for p in preps], reps=9)
                    except Exception:  # noqa: BLE001
                        log(f"GEMV TUNE ERROR {cfg}: {traceback.format_exc(limit=2)}", fh)
                row = {"shape": f"{name} {n}x{k}", "m": m, "rule": str(base), "rule_us": times.get(str(base)),
                       "all": dict(sorted(times.items(), key=lambda kv: kv[1]))}
                rows.append(row)
                log("GEMV_TUNE " + json.dumps(row), fh)
            del preps
            torch.cuda.empty_cache()
    return rows


AB_CASES = [(57344, 8192, Epilogue()), (57344, 8192, Epilogue(activation="swiglu")),
            (28672, 4096, Epilogue(activation="swiglu")), (8192, 8192, Epilogue(activation="swiglu"))]


def run_gemv_ab(fh):
    """The default W4A16 route (GEMV at M <= 8) against the WGMMA kernel and alternative GEMV
    configs, incl. the fused SwiGLU gate_up shapes; 3 interleaved rounds (median of each round)."""
    rows = []
    for n, k, epi in AB_CASES:
        qw, preps, _ = weight_copies(n, k, swiglu=epi.activation == "swiglu", bf16=False)
        n_pad = preps[0].row_exp.shape[0]
        tiles = 2 if epi.activation == "swiglu" else 1
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            tok = 1 << (m - 1).bit_length()
            cands = {"default": None, "wgmma": ng.pick_config(m, n_pad, k, epi, False)}
            for w, st, sp, pdl in ((8, 3, 1, False), (8, 2, 1, False), (4, 2, 1, False), (8, 3, 1, True)):
                cfg = gv.GemvConfig(w if tiles == 1 else 8, tiles, st, sp, tok, pdl)
                if cfg.smem_bytes() <= 227 * 1024:
                    cands.setdefault(str(cfg), cfg)
            fns = {label: [lambda p=p, c=cfg: ng.nvfp4_w4a16(x, p, epi, config=c) for p in preps]
                   for label, cfg in cands.items()}
            row = {"shape": f"{n}x{k}", "epilogue": epi.activation, "m": m,
                   "default_config": str(gv.pick_gemv_config(m, n_pad, k, epi)), "us": interleaved_us(fns)}
            rows.append(row)
            log("AB " + json.dumps(row), fh)
        del preps
        torch.cuda.empty_cache()
    return rows


def run_gemv_stages_ab(shapes, fh):
    """The GEMV rule's config against the same config with 2, 3 and 4 ring stages (where they fit),
    beside bf16 ``F.linear``, at M = 1 and 8, for every (N, K) of ``shapes`` and the fused SwiGLU
    gate_up shapes among them: 3 interleaved rounds. The rows carry the grid's waves at one CTA
    per SM (``ctas * splits / SMs``), what a stage rule is fitted on."""
    rows, sms = [], kcache.num_sms(torch.device("cuda"))
    cases = [(n, k, Epilogue()) for name in shapes for n, k in SHAPES[name]]
    cases += [(n, k, Epilogue(activation="swiglu")) for n, k, _ in cases if n >= 4 * k]  # gate_up
    for n, k, epi in cases:
        qw, preps, bf16s = weight_copies(n, k, swiglu=epi.activation == "swiglu")
        n_pad = preps[0].row_exp.shape[0]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rule = gv.pick_gemv_config(m, n_pad, k, epi)
            cands = {"rule": rule}
            for st in (2, 3, 4):
                cfg = dataclasses.replace(rule, stages=st)
                if cfg != rule and cfg.smem_bytes() <= 227 * 1024:
                    cands[f"stages={st}"] = cfg
            fns = {label: [lambda p=p, c=cfg: ng.nvfp4_w4a16(x, p, epi, config=c) for p in preps]
                   for label, cfg in cands.items()}
            fns["bf16"] = [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16s]
            ctas = n_pad // (ng.ROWS * rule.tiles) * rule.splits
            row = {"shape": f"{n}x{k}", "epilogue": epi.activation, "m": m, "rule": str(rule),
                   "waves_1_per_sm": round(ctas / sms, 2), "us": interleaved_us(fns)}
            rows.append(row)
            log("STAGES " + json.dumps(row), fh)
        del preps, bf16s
        torch.cuda.empty_cache()
    return rows


PAD_MS = (33, 47, 65, 80, 96, 100, 104, 112, 129, 200, 300)


def run_pad_ab(shapes, fh):
    """W4A16 at token counts whose last tile is partial: the default route (a tile-high copy of x
    where :func:`ng.tma_rows` says, else x's own rows) against the same kernel the other way
    (padded copy included in its time), beside bf16; 3 interleaved rounds, after a float64 check
    of the default route."""
    from quantkit.kernels.cache import launch_stream

    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            _, preps, bf16s = weight_copies(n, k)
            n_pad = preps[0].row_exp.shape[0]
            for m in PAD_MS:
                cfg, fn = ng._plan(m, n_pad, k, Epilogue(), False, False, torch.device("cuda"), None, False)
                tile_rows = -(-m // cfg.bn) * cfg.bn
                if tile_rows == m:
                    continue  # whole tiles: nothing to compare
                unwritten, err, _ = check_case("w4a16", m, n, k, Epilogue(), m)
                assert unwritten == 0 and err < 4e-3, (n, k, m, unwritten, err)
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                x_pad = torch.zeros(tile_rows, k, dtype=torch.bfloat16, device="cuda")
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                padded = ng.tma_rows(m, cfg, False) > m

                def direct(p, pad, x=x, x_pad=x_pad, out=out, fn=fn, m=m):
                    if pad:
                        x_pad[:m] = x
                    src = x_pad if pad else x
                    fn(src.data_ptr(), p.tiles.data_ptr(), p.row_exp.data_ptr(), 0, p.tensor_scale.data_ptr(),
                       out.data_ptr(), 0, 0, 0, 0, m, src.shape[0], n_pad, n, k, launch_stream(x.device, False))

                us = interleaved_us({f"{'padded' if padded else 'own rows'} (default)":
                                     [lambda p=p, x=x: ng.nvfp4_w4a16(x, p) for p in preps],
                                     "own rows" if padded else "padded": [lambda p=p, pad=not padded: direct(p, pad)
                                                                          for p in preps],
                                     "bf16": [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in bf16s]})
                row = {"shape": f"{name} {n}x{k}", "m": m, "config": str(cfg), "us": us}
                rows.append(row)
                log("PAD " + json.dumps(row), fh)
            del preps, bf16s
            torch.cuda.empty_cache()
    return rows


TILE256_MS = (129, 160, 192, 224, 256)
TILE128_LAYOUTS = {"128 1wg": ng.Config(128, 1, 6, 1), "128 2wg": ng.Config(128, 2, 5, 1),
                   "128 2wg persistent": ng.Config(128, 2, 4, 1, persistent=True)}


def run_tile256_ab(shapes, fh):
    """W4A16 at 129-256 tokens where the rule runs one 256-token tile: its config against the
    128-token layouts the rule picked before (one or two warpgroups, two-warpgroup persistent;
    such grids need no K-split) and bf16, 3 interleaved rounds, after a float64 check of the rule's
    config (its padded x included)."""
    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            _, preps, bf16s = weight_copies(n, k)
            n_pad = preps[0].row_exp.shape[0]
            for m in TILE256_MS:
                rule = ng.pick_config(m, n_pad, k, Epilogue(), False)
                if rule.bn != 256:
                    continue
                unwritten, err, _ = check_case("w4a16", m, n, k, Epilogue(), m)
                assert unwritten == 0 and err < 4e-3, (n, k, m, unwritten, err)
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                configs = {"rule": rule, **TILE128_LAYOUTS}
                fns = {label: [lambda p=p, c=c, x=x: ng.nvfp4_w4a16(x, p, config=c) for p in preps]
                       for label, c in configs.items()}
                fns["bf16"] = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in bf16s]
                row = {"shape": f"{name} {n}x{k}", "m": m, "rule": str(rule), "us": interleaved_us(fns)}
                rows.append(row)
                log("TILE256 " + json.dumps(row), fh)
            del preps, bf16s
            torch.cuda.empty_cache()
    return rows


SWIGLU_MS = (64, 256, 512, 1024, 2048, 4096)
SWIGLU_SHAPES = [(28672, 4096), (57344, 8192), (37888, 3584), (16384, 2048)]  # gate/up of 8B, 70B, Qwen2.5-7B, 3.2-1B
SWIGLU_LAYOUTS = {"256 2wg": ng.Config(256, 2, 3, 1), "128 2wg": ng.Config(128, 2, 5, 1),
                  "128 2wg persistent": ng.Config(128, 2, 4, 1, persistent=True)}


def run_swiglu_ab(fh, shapes=SWIGLU_SHAPES):
    """W4A16 SwiGLU (interleaved gate/up weights): from 256 tokens the rule's config against
    256-token tiles (non-persistent: the exchange reuses the drained activation stages) and the
    128-token layouts, after a float64 check of the 256-token tile with bias and residual; at 64
    tokens the rule against its pipeline at 3 stages (the depth before the exchange moved into
    the stages); beside bf16 ``F.linear`` on the same weight (no activation), 3 interleaved rounds."""
    swiglu = Epilogue(activation="swiglu")
    rows = []
    for n, k in shapes:
        _, preps, bf16s = weight_copies(n, k, swiglu=True)
        for m in SWIGLU_MS:
            rule = ng.pick_config(m, n, k, swiglu, False)
            configs = ({"rule": rule, "3 stages": dataclasses.replace(rule, stages=3)} if m < 256
                       else {"rule": rule, **SWIGLU_LAYOUTS})
            checked = rule if m < 256 else SWIGLU_LAYOUTS["256 2wg"]
            unwritten, err, _ = check_case("w4a16", m, n, k, CHECK_EPILOGUES[-1], m, checked)
            assert unwritten == 0 and err < 4e-3, (n, k, m, unwritten, err)
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            fns = {label: [lambda p=p, c=c, x=x: ng.nvfp4_w4a16(x, p, swiglu, config=c) for p in preps]
                   for label, c in configs.items()}
            fns["bf16"] = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in bf16s]
            row = {"shape": f"{n}x{k}", "m": m, "rule": str(rule), "err": err, "us": interleaved_us(fns)}
            rows.append(row)
            log("SWIGLU " + json.dumps(row), fh)
        del preps, bf16s
        torch.cuda.empty_cache()
    return rows


def cluster_contenders(m: int, n_pad: int, k: int, sms: int) -> dict[str, ng.Config]:
    """Configs that :func:`run_cluster_ab` times for one problem: a K-split rule config through
    the global turnstile and as a cluster (a two-warpgroup 64-token one also against one
    unsplit warpgroup, the rule before session 31; a 16-32-token one also as a cluster of
    SM-filling CTAs with as many splits as keep one wave); an unsplit one-wave 64-token rule config (one
    warpgroup) against two warpgroups with 2 K-splits that still fill one wave, through the
    turnstile and as a cluster (all stages: one CTA per SM). Empty where neither applies."""
    rule = ng.pick_config(m, n_pad, k, Epilogue(), False)
    if rule.splits > 1:
        configs = {"turnstile": dataclasses.replace(rule, cluster=False), "cluster": dataclasses.replace(rule, cluster=True)}
        if (rule.bn, rule.warpgroups) == (64, 2):
            configs["1 warpgroup, unsplit"] = ng.Config(64, 1, 8, 1)
        ctas = n_pad // (ng.ROWS * rule.warpgroups) * -(-m // rule.bn)
        splits = max([s for s in (2, 4, 8) if ctas * s <= sms and k // ng.BK // s >= 4], default=0)
        if rule.bn <= 32 and splits:  # the same tile as a cluster of SM-filling CTAs in one wave
            configs[f"cluster, {splits} splits, one wave"] = dataclasses.replace(
                rule, stages=ng.max_stages(rule.bn, rule.warpgroups, False), splits=splits, cluster=True)
        return configs
    rows = n_pad // ng.ROWS
    if rule.bn != 64 or rule.warpgroups != 1 or rows > sms:
        return {}
    split = ng.Config(64, 2, min(8, ng.max_stages(64, 2, False)), 2)
    return {"rule": rule, "2 warpgroups, 2 splits": split,
            "2 warpgroups, 2 splits, cluster": dataclasses.replace(split, cluster=True)}


def short_tile_contenders(m: int, n_pad: int, k: int, sms: int) -> dict[str, ng.Config]:
    """Configs that ``--short-ab`` times for a 9-32-token problem: the rule's; its token tile in
    one-warpgroup CTAs, K-split into as many clusters as keep one wave (every stage: one CTA per
    SM, the structure that won at 64 tokens); and the 64-token rule's config (x's own rows).
    Empty where one-warpgroup CTAs of the tile do not fit one wave."""
    rule = ng.pick_config(m, n_pad, k, Epilogue(), False)
    ctas = n_pad // ng.ROWS * -(-m // rule.bn)
    splits = max([s for s in (1, 2, 4, 8) if ctas * s <= sms and k // ng.BK // s >= 4], default=0)
    if rule.bn > 32 or not splits:
        return {}
    one_wg = ng.Config(rule.bn, 1, min(16, ng.max_stages(rule.bn, 1, False)), splits, cluster=splits > 1)
    return {"rule": rule, f"1 warpgroup, {splits} splits, one wave": one_wg,
            "64-token rule": ng.pick_config(64, n_pad, k, Epilogue(), False)}


def halved_split_contenders(m: int, n_pad: int, k: int, sms: int) -> dict[str, ng.Config]:
    """Configs that ``--halved-ab`` times for a 17-32-token problem the rule runs as one-warpgroup
    CTAs at half the K-splits (session 34): the rule's, and the two-warpgroup grid with twice its
    splits that it replaced, through the turnstile and (<= 8 splits) as a cluster. Empty elsewhere."""
    rule = ng.pick_config(m, n_pad, k, Epilogue(), False)
    if (rule.bn, rule.warpgroups, rule.stages, rule.cluster) != (32, 1, 4, False):
        return {}
    two = ng.Config(32, 2, 4, 2 * rule.splits)
    configs = {"rule": rule, f"2 warpgroups, {two.splits} splits": two}
    if two.splits <= 8:
        configs[f"2 warpgroups, {two.splits} splits, cluster"] = dataclasses.replace(two, cluster=True)
    return configs


def run_cluster_ab(shapes, fh, ms, contenders=cluster_contenders):
    """W4A16 at ``ms`` tokens: the configs ``contenders`` gives each problem (by default K-split
    grids through the global split-K turnstile against the same grids as thread-block clusters
    meeting in distributed shared memory, :func:`cluster_contenders`), beside the default route
    and bf16; 3 interleaved rounds, after a float64 check of each config."""
    rows = []
    for name in shapes:
        for n, k in SHAPES[name]:
            _, preps, bf16s = weight_copies(n, k)
            n_pad = preps[0].row_exp.shape[0]
            for m in ms:
                configs = contenders(m, n_pad, k, kcache.num_sms(preps[0].tiles.device))
                if not configs:
                    continue
                for c in configs.values():
                    unwritten, err, _ = check_case("w4a16", m, n, k, Epilogue(), m, c)
                    assert unwritten == 0 and err < 4e-3, (n, k, m, c, unwritten, err)
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                fns = {label: [lambda p=p, x=x, c=c: ng.nvfp4_w4a16(x, p, config=c) for p in preps]
                       for label, c in configs.items()}
                fns["default route"] = [lambda p=p, x=x: ng.nvfp4_w4a16(x, p) for p in preps]
                fns["bf16"] = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in bf16s]
                row = {"shape": f"{name} {n}x{k}", "m": m, "configs": {lb: str(c) for lb, c in configs.items()},
                       "us": interleaved_us(fns)}
                rows.append(row)
                log("CLUSTER " + json.dumps(row), fh)
            del preps, bf16s
            torch.cuda.empty_cache()
    return rows


TUNE_CASES = [("8b", 4096, 4096), ("8b", 28672, 4096), ("8b", 4096, 14336), ("70b", 8192, 8192),
              ("70b", 57344, 8192), ("8b", 6144, 4096), ("70b", 10240, 8192)]
TUNE_MS = [1, 16, 64, 256, 4096]


def candidates(m, n_pad, k, w4a8):
    """Configs to try for one problem: the heuristic's token tile (beyond 128 tokens: 128 and 256),
    1 or 2 warpgroups, K-splits (>= 4 stages each; 1..8 for decode, 1..4 from M=65, 1..2 from
    M=257, 1 at prefill; each as a turnstile and as a cluster), the deepest pipeline that fits (and
    4 stages for decode tiles, and for 64-token tiles the deepest that leaves two CTAs per SM);
    beyond 128 tokens also each unsplit one as a persistent kernel at the two deepest pipelines
    that leave staging room (W4A8: in either tile order)."""
    base = ng.pick_config(m, n_pad, k, Epilogue(), w4a8)
    bns = (128, 256) if m > 128 else (base.bn,)
    split_opts = (1, 2, 4, 8) if m <= 64 else ((1, 2, 4) if m <= 256 else ((1, 2) if m <= 512 else (1,)))
    out = {base}
    for bn in bns:
        for wgs in (1, 2):
            deepest = min(8, ng.max_stages(bn, wgs, w4a8))
            two_per_sm = ng.max_stages(bn, wgs, w4a8, ctas_per_sm=2)
            for stages in {deepest, 4} if bn <= 16 else ({deepest, two_per_sm} if bn == 64 else {deepest}):
                for splits in split_opts:
                    if stages >= 3 and (k // ng.BK) // splits >= 4:
                        for cluster in (False, True) if splits > 1 else (False,):
                            cfg = ng.Config(bn, wgs, stages, splits, cluster=cluster)
                            if ng.fits(cfg, Epilogue(), w4a8):
                                out.add(cfg)
    if m > 128:  # persistent CTAs, the output staged beside the two deepest pipelines that leave room
        for cfg in list(out):
            deep = [dataclasses.replace(cfg, stages=s, persistent=True) for s in range(cfg.stages, 2, -1)]
            for c in [c for c in deep if ng.fits(c, Epilogue(), w4a8)][:2]:
                out.update([c, dataclasses.replace(c, tokens_fastest=True)] if w4a8 else [c])
    return base, sorted(out, key=str)


def run_tune(fh, deadline, ms=TUNE_MS, modes=("w4a16", "w4a8"), cases=TUNE_CASES, rounds=1):
    """Time every candidate config per (shape, M) and mode (W4A8 only from M=256), with bf16
    ``F.linear`` on the same weight, in ``rounds`` interleaved rounds (each config's median round);
    returns rows with the heuristic's, the best and bf16's µs."""
    rows = []
    for name, n, k in cases:
        if time.time() > deadline:
            log(f"tune deadline: skipping {name} {n}x{k}", fh)
            continue
        _, preps, bf16s = weight_copies(n, k)
        n_pad = preps[0].row_exp.shape[0]
        for m in ms:
            if n == 57344 and m not in (1, 64):
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            xq, xs = nw8.quantize_activation(x)
            for mode in [md for md in modes if md == "w4a16" or m >= 256]:
                w4a8_mode = mode == "w4a8"
                base, cands = candidates(m, n_pad, k, w4a8_mode)
                fns = {"bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16s]}
                for cfg in cands:
                    if w4a8_mode:
                        fns[cfg] = [lambda p=p, c=cfg: nw8.nvfp4_w4a8_quantized(xq, xs, p, config=c) for p in preps]
                    else:
                        fns[cfg] = [lambda p=p, c=cfg: ng.nvfp4_w4a16(x, p, config=c) for p in preps]
                timer = watchdog(60 * len(fns) * rounds, f"tune {mode} {n}x{k} M={m}")
                times = medians(interleaved_us(fns, rounds=rounds, on_error=lambda c: log(
                    f"TUNE ERROR {mode} {c}: {traceback.format_exc(limit=2)}", fh)))
                timer.cancel()
                bf16_us = times.pop("bf16", None)
                if not times:
                    continue
                best = min(times, key=times.get)
                row = {"shape": f"{name} {n}x{k}", "m": m, "mode": mode, "rounds": rounds, "heuristic": str(base),
                       "heuristic_us": times.get(base), "best": str(best), "best_us": times[best], "bf16_us": bf16_us,
                       "all": {str(c): t for c, t in sorted(times.items(), key=lambda kv: kv[1])}}
                rows.append(row)
                log("TUNE " + json.dumps(row), fh)
        del preps, bf16s
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    head = ("shape", "M", "w4a16 µs", "TB/s", "bf16 µs", "TB/s", "x bf16", "deq+mm µs", "quack µs", "x quack",
            "tinygemm µs", "TB/s", "x tinygemm", "wgmma µs", "gemv µs", "TB/s", "x bf16", "w4a8 µs", "x bf16", "w4a8 gemm µs", "actq µs",
            "fp8 mm µs", "gemm x fp8 mm")
    lines = [" | ".join(head)]
    for r in rows:
        def f(key, fmt="{:.1f}"):
            return fmt.format(r[key]) if key in r else "-"
        ratio = lambda a, b: f"{r[b] / r[a]:.2f}" if a in r and b in r else "-"  # noqa: E731
        lines.append(" | ".join([r["shape"], str(r["m"]), f("w4a16"), f("w4a16_tbs", "{:.2f}"), f("bf16"),
                                 f("bf16_tbs", "{:.2f}"), ratio("w4a16", "bf16"), f("dequant+mm"), f("quack"),
                                 ratio("w4a16", "quack"), f("tinygemm"), f("tinygemm_tbs", "{:.2f}"),
                                 ratio("w4a16", "tinygemm"), f("wgmma"), f("gemv"), f("gemv_tbs", "{:.2f}"),
                                 ratio("gemv", "bf16"), f("w4a8"), ratio("w4a8", "bf16"), f("w4a8_gemm"),
                                 f("act_quant"), f("fp8_mm"), ratio("w4a8_gemm", "fp8_mm")]))
    return "\n".join(lines)


def run_floors(fh) -> list[dict]:
    """M=1 decode against what its bytes allow: per shape, the default route and bf16 ``F.linear``
    next to plain streaming kernels over the same weight bytes, an FP32 ``sum`` (reads them), a
    ``copy_`` (reads and writes them) and Triton direct-load reads (:mod:`stream_read`, one
    per variant; ``read_triton`` is the fastest), timed in turn over ``ROUNDS`` rounds; the first
    row (128x128) is the fixed cost of one launch. ``x bf16 at the read floor``: bf16's time over
    the fastest read of our bytes, what a GEMV streaming at that speed would reach."""
    import stream_read  # Triton: only here

    rows = []
    shapes = [(128, 128)] + [nk for name in ("8b", "70b") for nk in SHAPES[name]]
    for n, k in shapes:
        _, preps, bf16s = weight_copies(n, k)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(preps[0].tiles)
        row = {"n": n, "k": k, "bytes": preps[0].tiles.numel()}
        fns = {"w4a16": [lambda p=p: ng.nvfp4_w4a16(x, p) for p in preps],
               "bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in bf16s],
               "read_ours": [lambda p=p: p.tiles.view(torch.float32).sum() for p in preps],
               "copy_ours": [lambda p=p: dst.copy_(p.tiles) for p in preps]}
        for v in stream_read.VARIANTS:
            fns[f"triton {v[0]}x{v[1]} w{v[2]}"] = [stream_read.reader(p.tiles, *v) for p in preps]
        row.update(medians(interleaved_us(fns, rounds=ROUNDS, reps=15)))
        row["read_triton"] = min(row[f] for f in fns if f.startswith("triton"))
        row["x_bf16"] = row["bf16"] / row["w4a16"]
        row["x_bf16_at_read_floor"] = row["bf16"] / min(row["read_ours"], row["read_triton"])
        tbs = lambda us, nbytes=row["bytes"]: nbytes / us / 1e6  # noqa: E731
        log(f"FLOOR {n}x{k}: w4a16 {row['w4a16']:.1f} us ({tbs(row['w4a16']):.2f} TB/s), bf16 {row['bf16']:.1f}; "
            f"FP32 sum of our bytes {row['read_ours']:.1f} ({tbs(row['read_ours']):.2f} TB/s), Triton read "
            f"{row['read_triton']:.1f} ({tbs(row['read_triton']):.2f} TB/s), copy {row['copy_ours']:.1f} "
            f"({2 * tbs(row['copy_ours']):.2f} TB/s moved); x bf16 {row['x_bf16']:.2f}, "
            f"at the read floor {row['x_bf16_at_read_floor']:.2f}; all: {json.dumps(row)}", fh)
        rows.append(row)
        del preps, bf16s
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--shapes", nargs="+", default=["8b", "70b"], help=f"{', '.join(SHAPES)} or NxK")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="skip the dequantize-then-matmul baseline")
    ap.add_argument("--budget", type=float, default=420, help="seconds after which no new shape starts")
    ap.add_argument("--tune", action="store_true", help="also time candidate configs (after the benchmark)")
    ap.add_argument("--tune-budget", type=float, default=200)
    ap.add_argument("--tune-ms", type=int, nargs="+", default=TUNE_MS)
    ap.add_argument("--tune-modes", nargs="+", default=["w4a16", "w4a8"], choices=["w4a16", "w4a8"])
    ap.add_argument("--tune-shapes", nargs="+", default=None, metavar="NxK", help="default: TUNE_CASES")
    ap.add_argument("--tune-rounds", type=int, default=1, help="interleaved rounds per tuned (shape, M)")
    ap.add_argument("--variants", action="store_true", help="decode A/B of PDL and batched WGMMA issue")
    ap.add_argument("--no-quack", action="store_true")
    ap.add_argument("--no-tinygemm", action="store_true", help="skip torchao's int4 weight-only kernel")
    ap.add_argument("--ms", type=int, nargs="+", default=MS, help="W4A16 token counts to time")
    ap.add_argument("--no-w4a8", action="store_true", help="time W4A16 only")
    ap.add_argument("--w4a8-ms", type=int, nargs="+", default=W4A8_MS, help="W4A8 token counts to time")
    ap.add_argument("--gemv-tune", action="store_true", help="also sweep decode GEMV configs")
    ap.add_argument("--gemv-tune-budget", type=float, default=60)
    ap.add_argument("--variant-ms", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--check-gemv-only", action="store_true", help="check only the decode GEMV")
    ap.add_argument("--gemv-ab", action="store_true", help="only: default route vs WGMMA vs GEMV configs (AB_CASES)")
    ap.add_argument("--gemv-stages-ab", action="store_true",
                    help="only: the GEMV rule's config vs 2/3/4 ring stages over --shapes (wave counts)")
    ap.add_argument("--tile256-ab", action="store_true",
                    help="only: 129-256-token 256-token rule tiles vs the 128-token layouts and bf16")
    ap.add_argument("--swiglu-ab", action="store_true",
                    help="only: W4A16 SwiGLU at 64-4096 tokens, 256-token tiles against 128 (SWIGLU_SHAPES)")
    ap.add_argument("--pad-ab", action="store_true",
                    help="only: partial token tiles through the padded copy vs x's own rows (PAD_MS)")
    ap.add_argument("--floors", action="store_true", help="only: M=1 against a plain read of the same bytes")
    ap.add_argument("--persistent-ab", action="store_true", help="only: prefill persistent vs one CTA per tile")
    ap.add_argument("--cluster-ab", action="store_true",
                    help="only: K-split grids through the turnstile vs as clusters, at --ms")
    ap.add_argument("--short-ab", action="store_true",
                    help="only: 9-32-token rule configs vs one-warpgroup one-wave clusters and 64-token tiles, at --ms")
    ap.add_argument("--halved-ab", action="store_true",
                    help="only: 17-32-token one-warpgroup half-split rule configs vs the two-warpgroup grids they replaced, at --ms")
    ap.add_argument("--act-quant-sweep", action="store_true", help="only: W4A8 activation quantization variants")
    args = ap.parse_args()
    SHAPES.update({s: [tuple(int(d) for d in s.split("x"))] for s in args.shapes if s not in SHAPES})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.check_only:
        with open(out / "check.log", "w") as fh:
            sys.exit(0 if run_check(fh, args.check_gemv_only) else 1)
    only = {  # flag: (the stem of its .log and .json in --out, the run), tried in this order
        "floors": ("floors", lambda fh: run_floors(fh)),
        "act_quant_sweep": ("aq", lambda fh: run_act_quant_sweep(fh)),
        "persistent_ab": ("pab", lambda fh: run_persistent_ab(args.shapes, fh, args.w4a8_ms)),
        "cluster_ab": ("cluster", lambda fh: run_cluster_ab(args.shapes, fh, args.ms)),
        "short_ab": ("short", lambda fh: run_cluster_ab(args.shapes, fh, args.ms, short_tile_contenders)),
        "halved_ab": ("halved", lambda fh: run_cluster_ab(args.shapes, fh, args.ms, halved_split_contenders)),
        "tile256_ab": ("tile256", lambda fh: run_tile256_ab(args.shapes, fh)),
        "swiglu_ab": ("swiglu", lambda fh: run_swiglu_ab(fh)),
        "pad_ab": ("pad", lambda fh: run_pad_ab(args.shapes, fh)),
        "gemv_stages_ab": ("stages", lambda fh: run_gemv_stages_ab(args.shapes, fh)),
        "gemv_ab": ("ab", lambda fh: run_gemv_ab(fh)),
    }
    for flag, (stem, run) in only.items():
        if getattr(args, flag):
            with open(out / f"{stem}.log", "w") as fh:
                (out / f"{stem}.json").write_text(json.dumps(run(fh), indent=1))
            return
    deadline = time.time() + args.budget
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    checker = None
    if not args.skip_check:  # overlaps the benchmark's compiles; the timing waits for it
        checker = subprocess.Popen([sys.executable, __file__, "--check-only", "--out", str(out)]
                                   + (["--check-gemv-only"] if args.check_gemv_only else []))
    ms, w4a8_ms = args.ms, ([] if args.no_w4a8 else args.w4a8_ms)
    with open(out / "bench.log", "w") as fh:
        # compile the benchmark kernels while the check runs
        for m in sorted(set(ms) | set(w4a8_ms)):
            for name in args.shapes:
                for n, k in SHAPES[name]:
                    for mode in (("w4a16",) if m in ms else ()) + (("w4a8",) if m in w4a8_ms else ()):
                        cfg = ng.pick_config(m, -(-n // 128) * 128, k, Epilogue(), mode == "w4a8")
                        ng.compile_gemm(cfg, Epilogue(), mode == "w4a8")
                    if m <= gv.MAX_M:
                        gv.compile_gemv(gv.pick_gemv_config(m, -(-n // 128) * 128, k, Epilogue()), Epilogue())
        log(f"compiled benchmark kernels ({time.time() - deadline + args.budget:.0f}s)", fh)
        if checker is not None:
            rc = checker.wait()
            log(f"check subprocess exit code {rc}", fh)
        rows = run_bench(args.shapes, ms, w4a8_ms, fh, deadline, args.quick, not args.no_quack,
                         not args.no_tinygemm)
        (out / "bench.json").write_text(json.dumps(rows, indent=1))
        if args.gemv_tune:
            tuned = run_gemv_tune(args.shapes, fh, time.time() + args.gemv_tune_budget)
            (out / "gemv_tune.json").write_text(json.dumps(tuned, indent=1))
        if args.variants:
            variants = run_variants(args.shapes, fh, args.variant_ms)
            (out / "variants.json").write_text(json.dumps(variants, indent=1))
        if args.tune:
            cases = ([("", *map(int, s.split("x"))) for s in args.tune_shapes] if args.tune_shapes else TUNE_CASES)
            tuned = run_tune(fh, time.time() + args.tune_budget, args.tune_ms, args.tune_modes, cases,
                             args.tune_rounds)
            (out / "tune.json").write_text(json.dumps(tuned, indent=1))
            for r in tuned:
                log(f"TUNED {r['shape']} M={r['m']} {r['mode']}: heuristic {r['heuristic_us']} -> best "
                    f"{r['best_us']:.1f} us {r['best']}", fh)
    print(table(rows))


if __name__ == "__main__":
    main()
