"""Host time of one eager launch on 4096x4096, each kernel through CuTeDSL's tvm-ffi executor
and its default Python executor: the NVFP4 W4A16 decode GEMV and WGMMA kernel at M = 1, W4A8
(activation quantization + WGMMA kernel) at M = 16, fp8-block (activation quantization + GEMM) at
M = 1 and 16; bf16 ``F.linear`` for scale. Then the user's path: the fp8-block linear op called
through the dispatcher and through :func:`quantkit.kernels.ops.call` (what the backends do in eager
mode), the fp8-block linear at M = 512 as one executor call (``fp8_block_linear``) against its two
calls (``act_quant`` + ``fp8_block_gemm``), and whole ``QuantLinear`` forwards.

Run: ``python benchmarks/host_launch.py [--calls N]``. Per contender: ``N`` back-to-back eager calls
after a warm-up; "host µs" is the enqueue time per call (perf_counter around the loop, no
synchronization inside), "total µs" includes draining the GPU queue. Each kernel's outputs through
both executors must be bit-identical (same kernel, same inputs).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats import fp8, get_format  # noqa: E402
from quantkit.kernels import cache as kcache  # noqa: E402
from quantkit.kernels.epilogue import Epilogue  # noqa: E402
from quantkit.kernels.ops import call  # noqa: E402
from quantkit.kernels.sm90 import act_quant as aq  # noqa: E402
from quantkit.kernels.sm90 import fp8_block_gemm as fbg  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemm as ng  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_w4a8 as nw8  # noqa: E402
from quantkit.nn import QuantLinear  # noqa: E402


def host_us(fn, calls: int) -> tuple[float, float]:
    """(enqueue µs per call, µs per call including the GPU drain) over ``calls`` eager calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    n, k = 4096, 4096
    torch.manual_seed(0)
    qw = get_format("nvfp4-w4a16").quantize_weight(torch.randn(n, k, device="cuda") * 0.05)
    w = ng.prepare(qw.data, qw.scale, qw.tensor_scale)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    x16 = torch.randn(16, k, device="cuda").to(torch.bfloat16)
    wb = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    wgmma = ng.pick_config(1, w.row_exp.shape[0], k, Epilogue(), False)
    w8, w8_scale = fp8.quantize(torch.randn(n, k, device="cuda") * 0.05, (128, 128))

    def fp8_block(xb):
        return fbg.fp8_block_gemm(*aq.act_quant(xb), w8, w8_scale)

    kernels = {"gemv": lambda: ng.nvfp4_w4a16(x, w), "wgmma": lambda: ng.nvfp4_w4a16(x, w, config=wgmma),
               "w4a8 M=16": lambda: nw8.nvfp4_w4a8(x16, w), "fp8-block M=1": lambda: fp8_block(x),
               "fp8-block M=16": lambda: fp8_block(x16)}
    outs, rows = {}, []

    def through(name, tvm_ffi):
        def run():
            kcache.USE_TVM_FFI = tvm_ffi
            outs[name, tvm_ffi] = kernels[name]()
        return run

    for name in kernels:
        for tvm_ffi in (True, False):
            rows.append((f"{name} {'tvm-ffi' if tvm_ffi else 'cute executor'}", *host_us(through(name, tvm_ffi), args.calls)))
    rows.append(("bf16 F.linear", *host_us(lambda: torch.nn.functional.linear(x, wb), args.calls)))
    kcache.USE_TVM_FFI = True
    # The user's path: the custom op through the dispatcher against quantkit.kernels.ops.call (the
    # op's function, what the backends run in eager mode), and a whole QuantLinear forward.
    linears = {fmt: QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), fmt)
               for fmt in ("fp8-block", "nvfp4-w4a16")}
    x512 = torch.randn(512, k, device="cuda").to(torch.bfloat16)
    paths = {"fp8_block_linear op, dispatcher, M=1": lambda: fbg.fp8_block_linear_op(x, w8, w8_scale),
             "fp8_block_linear op, ops.call, M=1": lambda: call(fbg.fp8_block_linear_op, x, w8, w8_scale),
             "fp8_block_linear op, dispatcher, M=512": lambda: fbg.fp8_block_linear_op(x512, w8, w8_scale),
             "fp8_block_linear op, ops.call, M=512": lambda: call(fbg.fp8_block_linear_op, x512, w8, w8_scale),
             "act_quant + fp8_block_gemm (two executor calls), M=512": lambda: fp8_block(x512),
             "fp8_block_linear (one executor call), M=512": lambda: fbg.fp8_block_linear(x512, w8, w8_scale),
             "QuantLinear fp8-block M=1": lambda: linears["fp8-block"](x),
             "QuantLinear fp8-block M=512": lambda: linears["fp8-block"](x512),
             "QuantLinear nvfp4-w4a16 M=1": lambda: linears["nvfp4-w4a16"](x),
             "bf16 F.linear M=512": lambda: torch.nn.functional.linear(x512, wb)}
    rows += [(label, *host_us(fn, args.calls)) for label, fn in paths.items()]
    same = {name: torch.equal(outs[name, True], outs[name, False]) for name in kernels}
    print(f"tvm-ffi available: {kcache.tvm_ffi_available()}; outputs bit-identical across executors: {same}")
    print("contender | host µs/call | total µs/call")
    for label, h, t in rows:
        print(f"{label} | {h:.1f} | {t:.1f}")


if __name__ == "__main__":
    main()
