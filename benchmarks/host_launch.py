"""Host time of one eager W4A16 launch (decode, M = 1): the GEMV through CuTeDSL's tvm-ffi
executor vs its default Python executor, the WGMMA kernel (default executor) and bf16 ``F.linear``.

Run: ``python benchmarks/host_launch.py [--calls N]``. Per contender: ``N`` back-to-back eager calls
after a warm-up; "host µs" is the enqueue time per call (perf_counter around the loop, no
synchronization inside), "total µs" includes draining the GPU queue. The GEMV's outputs through
both executors must be bit-identical (same kernel, same inputs).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats import get_format  # noqa: E402
from quantkit.kernels.epilogue import Epilogue  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemm as ng  # noqa: E402
from quantkit.kernels.sm90 import nvfp4_gemv as gv  # noqa: E402


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
    wb = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    wgmma = ng.pick_config(1, w.row_exp.shape[0], k, Epilogue(), False)
    outs, rows = {}, []

    def gemv(tvm_ffi):
        def run():
            gv.USE_TVM_FFI = tvm_ffi
            outs[tvm_ffi] = ng.nvfp4_w4a16(x, w)
        return run

    for label, fn in (("gemv tvm-ffi", gemv(True)), ("gemv cute executor", gemv(False)),
                      ("wgmma cute executor", lambda: ng.nvfp4_w4a16(x, w, config=wgmma)),
                      ("bf16 F.linear", lambda: torch.nn.functional.linear(x, wb))):
        rows.append((label, *host_us(fn, args.calls)))
    gv.USE_TVM_FFI = True
    print(f"tvm-ffi available: {gv.tvm_ffi_available()}; GEMV outputs bit-identical across executors: "
          f"{torch.equal(outs[True], outs[False])}")
    print("contender | host µs/call | total µs/call")
    for label, h, t in rows:
        print(f"{label} | {h:.1f} | {t:.1f}")


if __name__ == "__main__":
    main()
