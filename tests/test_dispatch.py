"""Dispatch adapters: the operands a GPU backend builds compute the reference function; backend
registration."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from quantkit.formats import get_format
from quantkit.kernels import emulate, reference
from quantkit.kernels.epilogue import Epilogue
from quantkit.kernels.sm100.backend import OPERAND_FORMAT, prepare_operands, supports
from quantkit.nn import QuantLinear


@pytest.mark.parametrize("fmt,calibrated", [("nvfp4", True), ("nvfp4", False), ("nvfp4-4over6", True),
                                            ("nvfp4-4over6", False), ("mxfp8", False)])
def test_sm100_adapter_operands_reproduce_the_reference(fmt, calibrated):
    torch.manual_seed(1)
    w, x = torch.randn(256, 384), torch.randn(37, 384) * 2
    qw = get_format(fmt).quantize_weight(w)
    input_scale = torch.tensor(3.0 * x.abs().max().item() / 2688) if calibrated else None
    bias = torch.randn(256)
    epi = Epilogue(bias=True, activation="silu")
    ops = prepare_operands(x, qw, input_scale)
    got = emulate.blockscaled_gemm(*ops[:4], fmt=OPERAND_FORMAT[fmt], alpha=ops[4], epilogue=epi, bias=bias)
    ref = reference.gemm(x.double().float(), qw, epi, bias=bias, input_scale=input_scale).double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    assert supports(x.bfloat16(), qw, Epilogue()) and not supports(x, qw, Epilogue())
    assert "sm100" in qw.layouts  # the weight's swizzled scales are cached


def test_dtype_casts_keep_quantized_buffers():
    q = QuantLinear.from_linear(torch.nn.Linear(64, 32), "nvfp4", input_scale=torch.tensor(0.01))
    ts = q.weight_tensor_scale.clone()
    q = q.to(torch.bfloat16)
    assert (q.weight.dtype, q.weight_scale.dtype, q.input_scale.dtype, q.bias.dtype) == (
        torch.uint8, torch.float8_e4m3fn, torch.float32, torch.bfloat16)
    assert torch.equal(q.weight_tensor_scale, ts)


_REGISTERED = """
import importlib.util, sys
if sys.argv[1] == "hidden":  # as if nvidia-cutlass-dsl were not installed
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "cutlass" else find_spec(name, *a)
from quantkit import kernels
print(",".join(b.name for b in kernels._BACKENDS) or "-", "cutlass" in sys.modules)
"""


@pytest.mark.parametrize("cutedsl", ["installed", "hidden"])
def test_backends_register_at_import_without_loading_cutedsl(cutedsl):
    """Importing ``quantkit.kernels`` registers the Hopper and Blackwell backends where CuTeDSL is
    installed (so no first call, possibly traced by torch.compile, has to), without importing
    CuTeDSL itself; where it is not installed, none."""
    out = subprocess.run([sys.executable, "-c", _REGISTERED, cutedsl], capture_output=True, text=True,
                         check=True).stdout.split()
    available = cutedsl == "installed" and importlib.util.find_spec("cutlass") is not None
    assert out == ["sm90-fp8-block,sm90-nvfp4,sm100-blockscaled" if available else "-", "False"]
