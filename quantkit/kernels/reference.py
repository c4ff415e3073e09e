"""The oracle: what every GEMM backend computes, in plain PyTorch (CPU or GPU).

``gemm(x, qw)`` = ``epilogue(qdq(x) @ dequant(w).T)`` with FP32 accumulation, where ``qdq`` is the
activation quantization the format implies (identity for weight-only formats), or
``epilogue(fmt.accumulate(x, qw))`` for a format that defines its own accumulator
(``nvfp4-w4a8``: W4A8 rounding past the M crossover). See
:mod:`quantkit.kernels.epilogue` for the epilogue's order of operations.
"""
from __future__ import annotations

import torch

from quantkit.formats import QuantizedWeight, get_format
from quantkit.formats import fp8
from quantkit.kernels.epilogue import IDENTITY, Epilogue, apply_activation


def apply_epilogue(acc: torch.Tensor, epilogue: Epilogue, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, out_dtype: torch.dtype):
    """Apply ``epilogue`` to the FP32 accumulator ``acc [M, N']``.

    Returns ``[M, N]`` in ``out_dtype``, or for ``requant="fp8-block"`` the pair
    ``(float8_e4m3fn [M, N], FP32 scales [M, N/128])`` of the bf16-rounded result."""
    y = acc.float()
    if epilogue.bias:
        y = y + bias.float()
    y = apply_activation(y, epilogue.activation)
    if epilogue.residual:
        y = y + residual.float()
    if epilogue.requant is None:
        return y.to(out_dtype)
    if epilogue.requant == "fp8-block":
        return fp8.quantize(y.to(torch.bfloat16).reshape(-1, y.shape[-1]), (1, 128))
    raise NotImplementedError(f"reference requant to {epilogue.requant!r} is not implemented")


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., C]`` as ``[rows, C]`` (``t`` itself when already 2-D: no view to build per call)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def unrows(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out [rows, N]`` back to ``like``'s leading shape, ``[..., N]``."""
    return out if like.dim() == 2 else out.reshape(*like.shape[:-1], out.shape[-1])


def gemm(x: torch.Tensor, qweight: QuantizedWeight, epilogue: Epilogue = IDENTITY, *,
         bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         input_scale: torch.Tensor | None = None, weight: torch.Tensor | None = None):
    """Reference quantized linear: ``x [..., K]`` (bf16/fp32) × ``qweight [N', K]`` -> ``[..., N]``
    in ``x.dtype`` (or the requant pair). ``weight``: an already dequantized copy of ``qweight``
    (FP32 or exact lower precision) to skip re-decoding it on every call."""
    fmt = get_format(qweight.format)
    x2 = rows(x)
    if fmt.accumulate is not None:
        acc = fmt.accumulate(x2, qweight, weight)
    else:
        xq = fmt.activation.qdq(x2, input_scale) if fmt.activation is not None and len(x2) else x2  # 0 rows: empty out
        w = qweight.dequantize() if weight is None else weight
        acc = xq.to(w.dtype) @ w.T
    res = rows(residual) if residual is not None else None
    out = apply_epilogue(acc, epilogue, bias, res, x.dtype)
    return unrows(out, x) if isinstance(out, torch.Tensor) else out
