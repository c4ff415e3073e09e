"""What happens when the sm_100a block-scaled GEMM meets a non-Blackwell GPU (e.g. the H200).

1. The public entry points (host function and custom op) must raise our RuntimeError naming the
   device before compiling anything, so the dispatcher can fall back.
2. For information: the kernel still compiles for sm_100a on this machine (explicit arch), and
   launching that sm_100a binary directly, past our check, fails in the driver.

Prints one line per step; exits non-zero only if step 1 does not give the clear error.
Run: ``python benchmarks/sm100_on_hopper.py``.
"""
import sys

import torch

from quantkit.kernels import emulate
from quantkit.kernels.epilogue import Epilogue
from quantkit.kernels.sm100 import _launch, blockscaled_gemm, compile_variant, swizzled_numel


def operands(device: str):
    m = n = k = 128
    return dict(x_q=torch.zeros(m, k // 2, dtype=torch.uint8, device=device),
                x_scale=torch.ones(swizzled_numel(m, k // 16), device=device).to(torch.float8_e4m3fn),
                w_q=torch.zeros(n, k // 2, dtype=torch.uint8, device=device),
                w_scale=torch.ones(swizzled_numel(n, k // 16), device=device).to(torch.float8_e4m3fn))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    ops = operands("cuda")
    ok = True
    for name, call in (("host function", lambda: blockscaled_gemm(**ops, fmt="nvfp4")),
                       ("custom op", lambda: torch.ops.quantkit.sm100_blockscaled_gemm(
                           ops["x_q"], ops["x_scale"], ops["w_q"], ops["w_scale"], None, None, None, "nvfp4",
                           "identity"))):
        try:
            call()
            print(f"step 1 {name}: ran (expected only on sm_100)")
            ok = cap == (10, 0)
        except RuntimeError as err:
            print(f"step 1 {name}: RuntimeError: {err}")
            ok = ok and "sm_100" in str(err)
    try:
        executor = compile_variant("nvfp4", (128, 128), Epilogue(), has_alpha=False, arch="sm_100a")
        print("step 2 compile for sm_100a: ok")
        out = torch.empty(128, 128, dtype=torch.bfloat16, device="cuda")
        _launch(executor, "nvfp4", Epilogue(), ops["x_q"], ops["w_q"], ops["x_scale"], ops["w_scale"], out, None,
                None, None, None, None, 128, 128, 128)
        torch.cuda.synchronize()
        want = emulate.blockscaled_gemm(**{key: t.cpu() for key, t in ops.items()}, fmt="nvfp4")
        print(f"step 2 raw sm_100a launch: returned; max |out - emulation| = "
              f"{(out.double().cpu() - want).abs().max().item():.3g}")
    except Exception as err:  # noqa: BLE001 - report whatever the driver says
        print(f"step 2 raw sm_100a launch: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    print("RESULT:", "clear RuntimeError before any compilation" if ok else "UNEXPECTED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
