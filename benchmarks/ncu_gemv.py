"""One launch each of the decode GEMV and the WGMMA W4A16 kernel at M = 1, for Nsight Compute.

Run: ``ncu --clock-control none --section SpeedOfLight --section WarpStateStats
--section ComputeWorkloadAnalysis -k regex:"Gemv|Gemm" python benchmarks/ncu_gemv.py [--gemv CFG]``
(CFG: ``warps,stages,splits``). Shapes: Llama-3-70B 57344x8192 and 8192x8192.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats import get_format  # noqa: E402
from quantkit.kernels.epilogue import Epilogue  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemm as ng  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemv as gv  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemv", nargs="+", default=["8,2,1", "8,3,1"], help="warps,stages,splits per shape")
    args = ap.parse_args()
    for (n, k), spec in zip(((57344, 8192), (8192, 8192)), args.gemv):
        torch.manual_seed(0)
        qw = get_format("nvfp4-w4a16").quantize_weight(torch.randn(n, k, device="cuda") * 0.05)
        w = ng.prepare(qw.data, qw.scale, qw.tensor_scale)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        warps, stages, splits = (int(v) for v in spec.split(","))
        gcfg = gv.GemvConfig(warps, 1, stages, splits, tokens=1)
        wcfg = ng.pick_config(1, w.row_exp.shape[0], k, Epilogue(), False)
        ng.nvfp4_w4a16(x, w, config=gcfg)
        ng.nvfp4_w4a16(x, w, config=wcfg)
        torch.cuda.synchronize()
        print(f"{n}x{k}: gemv {gcfg}, wgmma {wcfg}")


if __name__ == "__main__":
    main()
