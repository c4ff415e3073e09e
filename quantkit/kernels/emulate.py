"""FP64 emulation of the Blackwell block-scaled GEMM on the exact operands the kernel reads.

The sm_100 kernel (:mod:`quantkit.kernels.sm100`) cannot run on this project's CI; this module
reads the same bytes it reads — packed E2M1 / E4M3 values and flat 128×4-swizzled scales,
addressed with the byte formula the kernel's CuTe layout implements (not through
:mod:`quantkit.formats.layouts`, so the two are checked against each other) — and computes the
GEMM and the epilogue in float64. Requantized outputs are written back in the kernel's output
format (packed values + swizzled scales), so every packing and layout decision is testable on CPU.

Numerics: ``acc = alpha · Σ_k x̂·ŵ`` exactly (FP64), then bias, activation, residual as in
:mod:`quantkit.kernels.epilogue`; the bf16 output is ``acc`` rounded once to bf16. Requant
quantizes that bf16 result with the scale rules of :mod:`quantkit.formats` evaluated in FP64
(the kernel evaluates them in FP32, so scales and codes agree within one step).
"""
from __future__ import annotations

import torch

from quantkit.formats.codecs import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e4m3_encode, e8m0_decode, \
    e8m0_from_amax, pack_nibbles, unpack_nibbles
from quantkit.kernels.epilogue import IDENTITY, Epilogue, apply_activation

BLOCK = {"nvfp4": 16, "mxfp8": 32}
_E4M3_TINY = 2.0**-6


def swizzled_offsets(rows: int, cols: int) -> torch.Tensor:
    """int64 ``[rows, cols]``: byte offset of scale ``(r, j)`` in the 128×4 swizzled layout,
    ``(r//128)·rk·512 + (j//4)·512 + (r%32)·16 + ((r%128)//32)·4 + j%4`` with ``rk = ceil(cols/4)``."""
    r = torch.arange(rows).unsqueeze(1)
    j = torch.arange(cols).unsqueeze(0)
    rk = -(-cols // 4)
    return (r // 128) * rk * 512 + (j // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (j % 4)


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the swizzled buffer for ``rows × cols`` scales (rows padded to 128, cols to 4)."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


def read_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Scale bytes (uint8 ``[rows, cols]``) gathered from a flat swizzled buffer."""
    raw = flat.reshape(-1).view(torch.uint8)
    if raw.numel() != swizzled_size(rows, cols):
        raise ValueError(f"swizzled scales hold {raw.numel()} bytes; {rows}x{cols} needs {swizzled_size(rows, cols)}")
    return raw[swizzled_offsets(rows, cols)]


def write_scales(sf: torch.Tensor) -> torch.Tensor:
    """Flat swizzled uint8 buffer holding ``sf`` (uint8 ``[rows, cols]``), padding zero."""
    rows, cols = sf.shape
    flat = torch.zeros(swizzled_size(rows, cols), dtype=torch.uint8)
    flat[swizzled_offsets(rows, cols)] = sf
    return flat


def dequantize(values: torch.Tensor, flat_scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP64 ``[R, K]`` from packed values (uint8 ``[R, K/2]`` nvfp4, E4M3 ``[R, K]`` mxfp8) and their
    flat swizzled block scales (the per-tensor NVFP4 scale is not applied: it is the kernel's alpha)."""
    if fmt == "nvfp4":
        vals = e2m1_decode(unpack_nibbles(values.view(torch.uint8))).double()
    elif fmt == "mxfp8":
        vals = values.view(torch.float8_e4m3fn).double()
    else:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(BLOCK)}")
    rows, k = vals.shape
    sf = read_scales(flat_scales, rows, k // BLOCK[fmt])
    scale = sf.view(torch.float8_e4m3fn).double() if fmt == "nvfp4" else e8m0_decode(sf).double()
    return (vals.reshape(rows, -1, BLOCK[fmt]) * scale.unsqueeze(-1)).reshape(rows, k)


def requantize(y: torch.Tensor, fmt: str, tensor_scale: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``y [M, N]`` (bf16-exact values, any float dtype) the way the kernel's epilogue
    does, in FP64: ``nvfp4`` → (uint8 ``[M, N/2]``, flat swizzled E4M3 scales) under the FP32
    ``tensor_scale``; ``mxfp8`` → (float8_e4m3fn ``[M, N]``, flat swizzled E8M0 bytes)."""
    y = y.double()
    m, n = y.shape
    blocks = y.reshape(m, n // BLOCK[fmt], BLOCK[fmt])
    amax = blocks.abs().amax(-1)
    if fmt == "nvfp4":
        ts = tensor_scale.double().reshape(())
        sb = e4m3_encode(((amax / E2M1_MAX) / ts).clamp(_E4M3_TINY, E4M3_MAX))
        codes = e2m1_encode(blocks * ((1.0 / ts) / sb.double()).unsqueeze(-1))
        return pack_nibbles(codes.reshape(m, n)), write_scales(sb.view(torch.uint8)).view(torch.float8_e4m3fn)
    if fmt == "mxfp8":
        e = e8m0_from_amax(amax, E4M3_MAX, round_up=True)
        vals = e4m3_encode(blocks / e8m0_decode(e).double().unsqueeze(-1))
        return vals.reshape(m, n), write_scales(e)
    raise ValueError(f"cannot requantize to {fmt!r}; valid: {', '.join(BLOCK)}")


def blockscaled_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *,
                     fmt: str, alpha: torch.Tensor | None = None, epilogue: Epilogue = IDENTITY,
                     bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                     requant_scale: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantkit.kernels.sm100.blockscaled_gemm` computes, from the same arguments.

    Returns the FP64 ``[M, N]`` result before bf16 rounding (the kernel's bf16 output is its
    rounding), or for ``epilogue.requant`` the kernel's ``(values, swizzled scales)`` pair."""
    acc = dequantize(x_q.cpu(), x_scale.cpu(), fmt) @ dequantize(w_q.cpu(), w_scale.cpu(), fmt).T
    if alpha is not None:
        acc = acc * alpha.double().cpu().reshape(())
    if epilogue.bias:
        acc = acc + bias.double().cpu()
    y = apply_activation(acc, epilogue.activation)
    if epilogue.residual:
        y = y + residual.double().cpu()
    if epilogue.requant is None:
        return y
    rq = requant_scale.cpu() if requant_scale is not None else None
    return requantize(y.to(torch.bfloat16), epilogue.requant, rq)
