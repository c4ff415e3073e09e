"""Host time of one custom-op call, eager (through the dispatcher) and inside an Inductor-compiled
graph, for the two ways to define the op: ``torch.library.custom_op`` (quantkit until session 36)
and :class:`quantkit.kernels.ops.KernelOp` (``torch.library.Library``, one
``CompositeExplicitAutograd`` kernel). The op's body only allocates its output, so what is timed is
the registration's own cost; ``direct`` is the body called as a Python function.

Run (CPU is enough; the GPU machine's host is what matters for the kernels):
``python benchmarks/op_dispatch.py [--calls N]``. Under ``torch.inference_mode``; the compiled rows
time a graph of 1 and of 4 chained calls, and their difference / 3 is the cost per op inside a graph.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.kernels.ops import KernelOp


def body(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "identity") -> torch.Tensor:
    """An uninitialised ``[M, N]`` output for ``x [M, K]``, ``w [N, K]`` (a kernel op's signature);
    shapes only, so it is its own fake implementation too."""
    return x.new_empty((x.shape[0], w.shape[0]))


def host_us(fn, calls: int) -> float:
    """Mean µs per call over ``calls`` calls after a warm-up (host only: no GPU work)."""
    for _ in range(max(50, calls // 20)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    custom = torch.library.custom_op("quantkit_bench::custom", body, mutates_args=())
    custom.register_fake(body)
    kernel = KernelOp("quantkit_bench::kernel", body)
    kernel.register_fake(body)
    x, w = torch.randn(512, 64), torch.randn(64, 64)
    print(f"torch {torch.__version__}; µs per call (host)")
    with torch.inference_mode():
        print(f"direct (the body as a Python function): {host_us(lambda: body(x, w), args.calls):.1f}")
        for name, op in (("custom_op", custom), ("KernelOp", kernel)):
            eager = host_us(lambda op=op: op(x, w), args.calls)
            one = torch.compile(lambda x, w, op=op: op(x, w), fullgraph=True)
            four = torch.compile(lambda x, w, op=op: op(op(op(op(x, w), w), w), w), fullgraph=True)
            t1 = host_us(lambda one=one: one(x, w), args.calls // 4)
            t4 = host_us(lambda four=four: four(x, w), args.calls // 4)
            print(f"{name}: eager {eager:.1f}; compiled graph of 1 call {t1:.1f}, of 4 calls {t4:.1f} "
                  f"-> {(t4 - t1) / 3:.1f} per op in a graph")


if __name__ == "__main__":
    main()
