"""Hopper (sm_90a) CuTeDSL kernels, registered with :mod:`quantkit.kernels` as GEMM backends.

Importing this package costs no CuTeDSL import or compilation: each backend imports its kernel
module on first use.

* ``sm90-fp8-block`` — :mod:`.fp8_block_gemm` fed by :mod:`.act_quant`, or for ``M <= 16`` the
  decode GEMV :mod:`.fp8_block_gemv` (activations quantized in-kernel): ``fp8-block`` weights,
  bf16 activations quantized per 1x128 group on the fly; epilogues bias, activation (incl.
  interleaved SwiGLU), residual, requant to ``fp8-block`` (GEMM only).
* ``sm90-nvfp4`` — :mod:`.nvfp4_gemm` W4A16: ``nvfp4-w4a16`` weights × bf16 activations. Hopper
  has no FP4 tensor cores, so ``nvfp4`` and ``nvfp4-4over6`` (W4A4) run here too: their
  activations are quantized and dequantized in PyTorch (the reference's own ``qdq``, rounded to
  bf16), then the W4A16 kernel.
  ``nvfp4-w4a8`` runs :mod:`.nvfp4_w4a8`'s format op: the W4A8 kernel (FP8 activations
  quantized per token by its CuTeDSL kernel, weights rounded to E4M3 in registers) when
  :func:`quantkit.formats.w4a8.use_w4a8` ``(M, N')``, else the W4A16 kernel — the same function
  as the reference at every M.
"""
from __future__ import annotations

import torch

from quantkit.formats import QuantizedWeight, get_format
from quantkit.kernels import Backend, register_backend
from quantkit.kernels.epilogue import SWIGLU_GROUP, Epilogue
from quantkit.kernels.ops import call
from quantkit.kernels.reference import rows, unrows


def fp8_block_supports(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue) -> bool:
    """Whether the sm90 fp8-block kernel computes ``x @ qweight`` with ``epilogue``."""
    n, k = qweight.shape
    if qweight.format != "fp8-block" or x.dtype != torch.bfloat16 or k % 128 or n % 64:
        return False
    if epilogue.requant not in (None, "fp8-block"):
        return False
    if epilogue.activation == "swiglu" and (n % (2 * SWIGLU_GROUP) or epilogue.requant is not None):
        return False
    return epilogue.requant is None or n % 128 == 0


def fp8_block_run(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue, *, bias=None, residual=None,
                  input_scale=None):
    """``x [..., K]`` bf16 -> fp8-block linear + ``epilogue`` (the decode GEMV for ``M <= 16``, else
    act_quant and the GEMM): bf16 ``[..., N]``, or for requant the pair (FP8 ``[M, N]``, FP32 scales
    ``[M, N/128]``) over the flattened rows."""
    from quantkit.kernels.sm90.act_quant import act_quant_op
    from quantkit.kernels.sm90.fp8_block_gemm import fp8_block_gemm_requant_op, fp8_block_linear_op

    x2, res = rows(x), rows(residual) if epilogue.residual else None
    b = bias if epilogue.bias else None
    if epilogue.requant is not None:
        return call(fp8_block_gemm_requant_op, *call(act_quant_op, x2), qweight.data, qweight.scale, b, res,
                    epilogue.activation)
    return unrows(call(fp8_block_linear_op, x2, qweight.data, qweight.scale, b, res, epilogue.activation), x)


register_backend(Backend("sm90-fp8-block", (9,), fp8_block_supports, fp8_block_run))


NVFP4_WEIGHT_FORMATS = ("nvfp4-w4a16", "nvfp4", "nvfp4-4over6", "nvfp4-w4a8")


def nvfp4_runs_weight(qweight: QuantizedWeight) -> bool:
    """Whether the sm90 NVFP4 kernels take ``qweight``: an NVFP4-weight format, K a multiple of 128."""
    return qweight.format in NVFP4_WEIGHT_FORMATS and qweight.shape[1] % 128 == 0


def nvfp4_supports(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue) -> bool:
    """Whether the sm90 NVFP4 kernels (W4A16, W4A8) compute ``x @ qweight`` with ``epilogue``."""
    return (nvfp4_runs_weight(qweight) and x.dtype == torch.bfloat16 and epilogue.requant is None
            and (epilogue.activation != "swiglu" or qweight.shape[0] % (2 * SWIGLU_GROUP) == 0))


def nvfp4_prepare(qweight: QuantizedWeight) -> None:
    """Cache the kernels' tile layout of a weight they take (:func:`nvfp4_runs_weight`) in
    ``qweight.layouts["sm90"]`` (:func:`.nvfp4_gemm.prepare`); other weights are left alone."""
    if nvfp4_runs_weight(qweight) and "sm90" not in qweight.layouts:
        from quantkit.kernels.sm90.nvfp4_gemm import prepare

        qweight.layouts["sm90"] = prepare(qweight.data, qweight.scale, qweight.tensor_scale)


def nvfp4_run(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue, *, bias=None, residual=None,
              input_scale=None):
    """``x [..., K]`` bf16 -> (``nvfp4``, ``nvfp4-4over6``: NVFP4 qdq) -> W4A16 GEMM (``nvfp4-w4a8``: W4A8 or W4A16 by
    M) + ``epilogue`` -> bf16 ``[..., N]``; the re-laid weight is cached in ``qweight.layouts``."""
    from quantkit.kernels.sm90.nvfp4_gemm import nvfp4_w4a16_op
    from quantkit.kernels.sm90.nvfp4_w4a8 import nvfp4_w4a8_format_op

    nvfp4_prepare(qweight)
    w = qweight.layouts["sm90"]
    x2 = rows(x)
    activation = get_format(qweight.format).activation
    if activation is not None:
        x2 = activation.qdq(x2, input_scale).to(torch.bfloat16)
    res = rows(residual) if epilogue.residual else None
    op = nvfp4_w4a8_format_op if qweight.format == "nvfp4-w4a8" else nvfp4_w4a16_op
    out = call(op, x2.contiguous(), w.tiles, w.row_exp, w.tensor_scale, w.n, bias if epilogue.bias else None, res,
               epilogue.activation)
    return unrows(out, x)


register_backend(Backend("sm90-nvfp4", (9,), nvfp4_supports, nvfp4_run, nvfp4_prepare))
