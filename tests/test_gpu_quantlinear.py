"""QuantLinear on a Hopper GPU equals its CPU reference path (run with ``-m gpu`` on the H200)."""
import subprocess
import sys

import pytest
import torch

from quantkit import kernels
from quantkit.nn import QuantLinear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["fp8-block", "nvfp4-w4a16", "nvfp4", "nvfp4-4over6", "mxfp8"])
@pytest.mark.parametrize("lead", [(1,), (7,), (300,), (2, 5)], ids=str)
def test_quantlinear_cuda_equals_cpu_reference(fmt, lead):
    torch.manual_seed(sum(lead))
    lin = torch.nn.Linear(1024, 768, bias=True).to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(*lead, 1024, dtype=torch.bfloat16)
    ref = q(x).float()                                  # CPU: reference path
    qc = q.cuda()
    backend = kernels.select_backend(x.cuda(), qc.qweight, qc.epilogue)
    assert (backend is not None) == (fmt != "mxfp8")    # no Hopper kernel for MX: reference on GPU
    out = qc(x.cuda()).float().cpu()
    assert out.shape == (*lead, 768) and torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


def test_quantlinear_cuda_graph_and_compile():
    lin = torch.nn.Linear(1024, 1024, bias=False).to(torch.bfloat16).cuda()
    q = QuantLinear.from_linear(lin, "fp8-block")
    x = torch.randn(16, 1024, dtype=torch.bfloat16, device="cuda")
    eager = q(x)
    compiled = torch.compile(q, dynamic=True)
    assert torch.equal(compiled(x), eager)
    graph = torch.cuda.CUDAGraph()
    static = x.clone()
    q(static)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = q(static)
    static.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, q(static))


def test_first_call_compiled_is_one_graph():
    """A model whose first call is already under ``torch.compile`` (no eager call before it) traces
    as one graph for every M: nothing the backends load on first use may break it, and the weights'
    kernel layouts are built at the move to the GPU, not inside the trace (a cache filled there
    would recompile the second call). Run in a fresh process, where nothing has run yet."""
    script = """
import torch
from quantkit.nn import QuantLinear
layers = [QuantLinear.from_linear(torch.nn.Linear(1024, 1024, bias=False), f) for f in ("fp8-block", "nvfp4-w4a16", "nvfp4-w4a8")]
model = torch.nn.Sequential(*layers).to(device="cuda", dtype=torch.bfloat16)
compiled = torch.compile(model, dynamic=True)
xs = [torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda") for m in (48, 200, 3)]
with torch.inference_mode():
    outs = [compiled(x) for x in xs]
    same = all(torch.equal(out, model(x)) for x, out in zip(xs, outs))
print(torch._dynamo.utils.counters["stats"]["unique_graphs"], same)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["1", "True"], out
