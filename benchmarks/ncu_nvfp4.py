"""One launch of each NVFP4 kernel to profile, for Nsight Compute.

Decode (default): the GEMV and the WGMMA W4A16 kernel at M = 1 on Llama-3-70B 57344x8192 and
8192x8192 (``--gemv CFG`` per shape, ``warps,stages,splits``). Prefill (``--prefill NxKxM``): the
W4A8 GEMM (on already quantized activations), the fp8-block GEMM of the same shape (the kernel
W4A8 is measured against) and cuBLAS's FP8 row-wise ``_scaled_mm`` (the one fp8-block is measured
against; its kernel name matches ``gemm``). Splits (``--split NxKxM ...``): the rule's K-split
W4A16 config through the global turnstile and as a thread-block cluster.

Run: ``ncu --clock-control none --section SpeedOfLight --section WarpStateStats
--section ComputeWorkloadAnalysis -k regex:"Gemv|Gemm|gemm" python benchmarks/ncu_nvfp4.py [...]``.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats import fp8, get_format  # noqa: E402
from quantkit.kernels.epilogue import Epilogue  # noqa: E402
from quantkit.kernels.sm90 import fp8_block_gemm as fbg  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemm as ng  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemv as gv  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_w4a8 as nw8  # noqa: E402


def prepared(n: int, k: int) -> ng.Nvfp4Sm90Weight:
    torch.manual_seed(0)
    qw = get_format("nvfp4-w4a16").quantize_weight(torch.randn(n, k, device="cuda") * 0.05)
    return ng.prepare(qw.data, qw.scale, qw.tensor_scale)


def decode(specs: list[str]) -> None:
    for (n, k), spec in zip(((57344, 8192), (8192, 8192)), specs):
        w = prepared(n, k)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        warps, stages, splits = (int(v) for v in spec.split(","))
        gcfg = gv.GemvConfig(warps, 1, stages, splits, tokens=1)
        wcfg = ng.pick_config(1, w.row_exp.shape[0], k, Epilogue(), False)
        ng.nvfp4_w4a16(x, w, config=gcfg)
        ng.nvfp4_w4a16(x, w, config=wcfg)
        torch.cuda.synchronize()
        print(f"{n}x{k}: gemv {gcfg}, wgmma {wcfg}")


def prefill(shape: str, w4a8_configs: list[str]) -> None:
    n, k, m = (int(v) for v in shape.split("x"))
    w = prepared(n, k)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    xq, xs = nw8.quantize_activation(x)
    nw8.nvfp4_w4a8_quantized(xq, xs, w)
    for spec in w4a8_configs:  # e.g. "512,2,4,1,persistent": more W4A8 configs beside the default
        bn, wgs, stages, splits, *flags = spec.split(",")
        cfg = ng.Config(int(bn), int(wgs), int(stages), int(splits), **{f: True for f in flags})
        nw8.nvfp4_w4a8_quantized(xq, xs, w, config=cfg)
    xq8, xs8 = fp8.quantize(x, (1, 128))
    w16 = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    wq8 = fp8.quantize(w16, (128, 128))
    fbg.fp8_block_gemm(xq8, fbg.scales_for_tma(xs8), *wq8)
    # cuBLAS FP8 with row-wise scales on the same shape, the kernel fp8-block is measured against
    xr, wr = fp8.quantize(x, (1, 0)), fp8.quantize(w16, (1, 0))
    torch._scaled_mm(xr[0], wr[0].t(), scale_a=xr[1], scale_b=wr[1].t(), out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print(f"{n}x{k} M={m}: w4a8 {ng.pick_config(m, w.row_exp.shape[0], k, Epilogue(), True)}, "
          f"fp8-block {fbg.pick_config(m, n, k)}")


def split(shapes: list[str]) -> None:
    """The rule's K-split W4A16 config at each ``NxKxM``, through the turnstile and as a cluster."""
    import dataclasses

    for shape in shapes:
        n, k, m = (int(v) for v in shape.split("x"))
        w = prepared(n, k)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        rule = ng.pick_config(m, w.row_exp.shape[0], k, Epilogue(), False)
        for cluster in (False, True):
            ng.nvfp4_w4a16(x, w, config=dataclasses.replace(rule, cluster=cluster))
        torch.cuda.synchronize()
        print(f"{shape}: {rule}, turnstile then cluster")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemv", nargs="+", default=["8,2,1", "8,3,1"], help="warps,stages,splits per shape")
    ap.add_argument("--prefill", metavar="NxKxM", help="profile W4A8 and fp8-block at this shape instead")
    ap.add_argument("--w4a8-configs", nargs="*", default=[], metavar="BN,WGS,STAGES,SPLITS[,FLAG...]",
                    help="prefill: also these W4A8 configs (flags: Config's boolean fields)")
    ap.add_argument("--split", nargs="+", metavar="NxKxM", help="profile K-split grids: turnstile vs cluster")
    args = ap.parse_args()
    if args.split:
        split(args.split)
    elif args.prefill:
        prefill(args.prefill, args.w4a8_configs)
    else:
        decode(args.gemv)


if __name__ == "__main__":
    main()
