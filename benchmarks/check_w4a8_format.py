"""Check and time the ``nvfp4-w4a8`` format on one Hopper GPU (notes: ``benchmarks/notes/w4a8_format.md``).

Run (device machine, from the repo root): ``python benchmarks/check_w4a8_format.py --out $OUT``.

1. **Activation quantization kernel** (``nvfp4_w4a8.quantize_activation``) against
   :func:`quantkit.formats.w4a8.quantize_activation` on the CPU, bit for bit (values and scales),
   on inputs spanning 6 decades per row, one all-zero row.
2. **QuantLinear(format="nvfp4-w4a8")** on the GPU against the same module's CPU reference (FP32
   output from the same bf16 input values), for M in {1, 16, 64, 65, 127, 128, 159, 160, 383, 384, 1024, 4096}
   and N' in {4096, 6144, 10240} (K = 4096: both sides of each threshold of the rule), fresh random-normal inputs,
   bias. The kernel the rule picks is also run into a NaN-poisoned buffer: it must be fully
   written and equal QuantLinear's output bit for bit (so QuantLinear ran that kernel).
   Every element must satisfy ``|out - ref| <= 2^-8 |ref| + t · S`` with ``S = |x| @ |W|^T``
   (the scale of the accumulation-order error) and ``t = 2^-9`` on the W4A8 path (FP8 WGMMA
   accumulation), ``2^-16`` on the W4A16 path; also printed: the error against the *other*
   path's reference, which shows which function ran.
3. **Crossover timing**: W4A16 vs W4A8 (incl. its activation quantization) on the Llama-3-8B
   shapes at M in ``--ms`` (default {128, 256, 512, 1024}): median µs of CUDA-graph replays,
   weights rotated over copies totalling > 3x L2; the rule's choice and the faster kernel per
   case; ``--w4a8-configs`` also times W4A8 under forced configs (``--skip-check``: timing only).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit import kernels  # noqa: E402
from quantkit.formats import get_format, w4a8  # noqa: E402
from quantkit.kernels.epilogue import Epilogue  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemm as ng  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_w4a8 as nw8  # noqa: E402
from quantkit.nn import QuantLinear  # noqa: E402
from timing import copies_for, graph_median_us, rotated  # noqa: E402  (benchmarks/timing.py)

CHECK_MS = (1, 16, 64, 65, 127, 128, 159, 160, 383, 384, 1024, 4096)
CHECK_NS = (4096, 6144, 10240)
CHECK_K = 4096
TOL = {True: 2.0 ** -9, False: 2.0 ** -16}  # t per path (W4A8?)
BENCH_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3-8B qkv, o, gate_up, down
BENCH_MS = (128, 256, 512, 1024)


def log(msg: str, fh) -> None:
    print(msg, flush=True)
    fh.write(msg + "\n")
    fh.flush()


def check_act_quant(fh) -> bool:
    ok = True
    for m, k in ((33, 14336), (1024, 4096), (4096, 4096), (7, 8192)):
        torch.manual_seed(m + k)
        x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, k, device="cuda")[torch.randperm(k, device="cuda")])
        x = x.to(torch.bfloat16)
        x[0] = 0
        xq, s = nw8.quantize_activation(x)
        rq, rs = w4a8.quantize_activation(x.cpu()[:, ng.w4a8_k_permutation(k)])
        bad_q = int((xq.cpu().view(torch.uint8) != rq.view(torch.uint8)).sum())
        bad_s = int((s.cpu() != rs).sum())
        ok &= bad_q == 0 and bad_s == 0
        log(f"ACT_QUANT M={m} K={k}: mismatching values {bad_q}/{m * k}, scales {bad_s}/{m}", fh)
    return ok


def check_quantlinear(fh) -> tuple[bool, list[dict]]:
    ok, rows = True, []
    for n in CHECK_NS:
        torch.manual_seed(n)
        lin = torch.nn.Linear(CHECK_K, n, bias=True)
        torch.nn.init.normal_(lin.weight, std=0.02)
        lin = lin.to(torch.bfloat16)
        q = QuantLinear.from_linear(lin, "nvfp4-w4a8")
        w_abs = q.dequantized_weight().abs()
        qc = QuantLinear.from_linear(lin, "nvfp4-w4a8").cuda()
        for m in CHECK_MS:
            x = torch.randn(m, CHECK_K).to(torch.bfloat16)
            xc = x.cuda()
            assert kernels.select_backend(xc, qc.qweight, qc.epilogue) is not None, "no sm90 backend"
            out = qc(xc)
            path = w4a8.use_w4a8(m, n)
            # the kernel the rule picks, into a NaN-poisoned buffer: fully written, and what QuantLinear ran
            poisoned = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            (nw8.nvfp4_w4a8 if path else ng.nvfp4_w4a16)(xc, qc.qweight.layouts["sm90"], qc.epilogue, qc.bias,
                                                          out=poisoned)
            same = bool(torch.equal(poisoned, out))
            out = out.double().cpu()
            ref = q(x.float()).double()  # the format's function, CPU reference, FP32
            with torch.no_grad():  # the other path's function, for contrast
                other = (w4a8.accumulate(x, q.weight, q.weight_scale, q.weight_tensor_scale) if not path
                         else x.float() @ q.dequantized_weight().T).double() + lin.bias.double()
            s = (x.float().abs() @ w_abs.T).double()
            err = (out - ref).abs()
            tol = 2.0 ** -8 * ref.abs() + TOL[path] * s
            row = {"n": n, "m": m, "path": "w4a8" if path else "w4a16", "kernel_equal": same,
                   "nan": int(torch.isnan(out).sum()),
                   "fail": int((err > tol).sum()), "max_err_over_S": float(((err - 2.0 ** -9 * ref.abs()).clamp(min=0) / s).max()),
                   "max_rel": float((err / ref.abs().clamp(min=1e-3)).max()),
                   "norm_rel": float(err.norm() / ref.norm()), "norm_rel_other": float((out - other).norm() / other.norm())}
            good = same and row["nan"] == 0 and row["fail"] == 0 and row["norm_rel"] < row["norm_rel_other"]
            ok &= good
            rows.append(row)
            log(f"{'PASS' if good else 'FAIL'} " + json.dumps(row), fh)
    return ok, rows


def bench(fh, ms=BENCH_MS, w4a8_configs=(), shapes=BENCH_SHAPES) -> list[dict]:
    """W4A16 vs W4A8 (+ quantization) per (N', K) shape and M; ``w4a8_configs``: also W4A8 with
    each of these ``"bn,warpgroups,stages"`` configs forced (no split-K)."""
    rows = []
    for n, k in shapes:
        torch.manual_seed(n + k)
        qw = get_format("nvfp4-w4a8").quantize_weight(torch.randn(n, k, device="cuda") * 0.05)
        preps = [ng.prepare(qw.data, qw.scale, qw.tensor_scale) for _ in range(copies_for(n * k * 9 // 16))]
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            row = {"shape": f"{n}x{k}", "m": m, "rule": "w4a8" if w4a8.use_w4a8(m, n) else "w4a16",
                   "w4a8_config": str(ng.pick_config(m, preps[0].row_exp.shape[0], k, Epilogue(), True))}
            contenders = [("w4a16", lambda p: ng.nvfp4_w4a16(x, p)), ("w4a8", lambda p: nw8.nvfp4_w4a8(x, p))]
            for spec in w4a8_configs:
                cfg = ng.Config(*map(int, spec.split(",")), 1)
                contenders.append((f"w4a8 {spec}", lambda p, cfg=cfg: nw8.nvfp4_w4a8(x, p, config=cfg)))
            for name, fn in contenders:
                row[name] = round(graph_median_us([lambda p=p: fn(p) for p in preps]), 1)
            row["act_quant"] = round(graph_median_us([lambda xc=xc: nw8.quantize_activation(xc)  # launch gap amortized
                                                      for xc in rotated(x)]), 1)
            row["faster"] = "w4a8" if row["w4a8"] < row["w4a16"] else "w4a16"
            rows.append(row)
            log("BENCH " + json.dumps(row), fh)
        del preps
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--ms", type=int, nargs="+", default=list(BENCH_MS), help="token counts timed")
    p.add_argument("--w4a8-configs", nargs="*", default=[], help='also time W4A8 with these configs ("bn,warpgroups,stages")')
    p.add_argument("--shapes", nargs="+", default=None, metavar="NxK", help="N' x K shapes timed (default: Llama-3-8B's)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fh = open(args.out / "check_w4a8_format.log", "w")
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", fh)
    t = time.time()
    results = {}
    for name, fn in (("act_quant", check_act_quant), ("quantlinear", check_quantlinear)):
        if args.skip_check:
            results[name] = None
            continue
        try:
            results[name] = fn(fh)
        except Exception:  # noqa: BLE001
            log(f"ERROR in {name}:\n{traceback.format_exc()}", fh)
            results[name] = False
        log(f"{name} done at {time.time() - t:.0f} s", fh)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else BENCH_SHAPES
    bench_rows = [] if args.skip_bench else bench(fh, args.ms, args.w4a8_configs, shapes)
    (args.out / "check_w4a8_format.json").write_text(json.dumps(
        {"act_quant_ok": results["act_quant"], "quantlinear": results["quantlinear"], "bench": bench_rows}, indent=1))
    log("\n| N' x K | M | path | max |err|-2^-9|ref| over S | max rel | norm rel | norm rel vs other path | result |", fh)
    log("|---|---|---|---|---|---|---|---|", fh)
    ql = results["quantlinear"]
    for r in (ql[1] if isinstance(ql, tuple) else []):
        log(f"| {r['n']}x{CHECK_K} | {r['m']} | {r['path']} | {r['max_err_over_S']:.1e} | {r['max_rel']:.1e} | "
            f"{r['norm_rel']:.1e} | {r['norm_rel_other']:.1e} | {'FAIL' if r['fail'] or r['nan'] else 'ok'} |", fh)
    forced_head = "".join(f" W4A8 {spec} µs |" for spec in args.w4a8_configs)
    log(f"\n| shape | M | W4A16 µs | W4A8+quant µs |{forced_head} act quant µs | faster | rule |\n|---|---|---|---|"
        + "---|" * len(args.w4a8_configs) + "---|---|---|", fh)
    for r in bench_rows:
        forced = "".join(f" {r[f'w4a8 {spec}']} |" for spec in args.w4a8_configs)
        log(f"| {r['shape']} | {r['m']} | {r['w4a16']} | {r['w4a8']} |{forced} {r['act_quant']} | {r['faster']} | {r['rule']} |", fh)
    ok = results["act_quant"] is True and isinstance(ql, tuple) and ql[0]
    verdict = "SKIPPED" if args.skip_check else "PASSED" if ok else "FAILED"
    log(f"\nCHECKS {verdict} ({time.time() - t:.0f} s)", fh)


if __name__ == "__main__":
    main()
