"""Dispatcher adapter for the Blackwell block-scaled GEMM: bf16 activations and a
:class:`QuantizedWeight` in, the kernel's operands out (quantized activations and 128×4-swizzled
scales, produced by :mod:`quantkit.formats`), then the kernel."""
from __future__ import annotations

import torch

from quantkit.formats import QuantizedWeight, get_format, layouts, mx
from quantkit.formats.codecs import pack_nibbles
from quantkit.kernels import Backend, register_backend
from quantkit.kernels.epilogue import Epilogue
from quantkit.kernels.ops import call
from quantkit.kernels.reference import rows, unrows
from quantkit.kernels.sm100 import FORMATS, K_MULTIPLE, sm100_blockscaled_gemm

_MXFP8 = mx.MXElement(8)
# quantkit format -> the kernel's operand format (nvfp4-4over6 differs from nvfp4 only in how the
# activations' block scales are chosen, before the kernel)
OPERAND_FORMAT = {**{f: f for f in FORMATS}, "nvfp4-4over6": "nvfp4"}


def runs_weight(qweight: QuantizedWeight) -> bool:
    """Whether the kernel takes ``qweight``: format nvfp4 / nvfp4-4over6 / mxfp8, K a multiple of
    128, N of 128."""
    n, k = qweight.shape
    return qweight.format in OPERAND_FORMAT and k % K_MULTIPLE == 0 and n % 128 == 0


def prepare(qweight: QuantizedWeight) -> None:
    """Cache the 128x4-swizzled block scales of a weight the kernel runs in ``qweight.layouts["sm100"]``."""
    if runs_weight(qweight) and "sm100" not in qweight.layouts:
        qweight.layouts["sm100"] = layouts.to_blocked(qweight.scale)


def prepare_operands(x: torch.Tensor, qweight: QuantizedWeight, input_scale: torch.Tensor | None = None):
    """``(x_q, x_scale, w_q, w_scale, alpha)`` for :func:`quantkit.kernels.sm100.blockscaled_gemm`
    from ``x [M, K]`` and ``qweight``: activations quantized as the format's reference does, scales
    swizzled (the weight's cached in ``qweight.layouts``), ``alpha`` the product of NVFP4 tensor
    scales (``None`` for MXFP8)."""
    prepare(qweight)
    w_scale = qweight.layouts["sm100"]
    if OPERAND_FORMAT[qweight.format] == "nvfp4":
        codes, scale, ts = get_format(qweight.format).activation.quantize(x, input_scale)
        x_q = pack_nibbles(codes)
        alpha = (ts * qweight.tensor_scale).reshape(1)
    else:
        scale = _MXFP8.scales(x)
        x_q, alpha = _MXFP8.encode(x, scale), None
    return x_q, layouts.to_blocked(scale), qweight.data, w_scale, alpha


def supports(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue) -> bool:
    """A weight the kernel takes (:func:`runs_weight`), bf16 input, bf16 output."""
    return runs_weight(qweight) and x.dtype == torch.bfloat16 and epilogue.requant is None


def run(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue, *, bias=None, residual=None, input_scale=None):
    """``x [..., K]`` bf16 -> bf16 ``[..., N]`` through the sm_100 kernel."""
    x_q, x_scale, w_q, w_scale, alpha = prepare_operands(rows(x), qweight, input_scale)
    res = rows(residual) if epilogue.residual else None
    out = call(sm100_blockscaled_gemm, x_q, x_scale, w_q, w_scale, alpha, bias if epilogue.bias else None, res,
               OPERAND_FORMAT[qweight.format], epilogue.activation)
    return unrows(out, x)


register_backend(Backend("sm100-blockscaled", (10,), supports, run, prepare))
