"""W4A8: NVFP4 weights served through an FP8 (E4M3 x E4M3) GEMM, FP8 per-token activations.

Hopper has no FP4 tensor cores, so an NVFP4 weight ``w = e2m1(q) · s_b · s_g`` (see
:mod:`quantkit.formats.nvfp4`) is converted to E4M3 on the fly. ``e2m1(q) · s_b`` carries up to six
significant bits and spans up to ``6 · 448``, so it is not always an E4M3 value. The rounding is:

1. **Row exponent.** For each weight row ``n``: ``c_n = floor(log2(max_b s_b[n, b]))`` over the
   row's block scales (``c_n = 0`` for a row whose scales are all zero). Then
   ``s_b · 2^-c_n < 2`` for every block of the row, so ``|e2m1 · s_b · 2^-c_n| < 12``.
2. **One rounding per weight.** ``w8[n, k] = e4m3(e2m1(q[n, k]) · s_b[n, k//16] · 2^-c_n)``,
   round-to-nearest-even of the exact product (the product is exact in FP16, where the kernel
   forms it; no saturation can occur). Values below ``2^-6`` land on E4M3's subnormal grid
   (step ``2^-9``); with the row maximum near ``12`` that only affects weights ``2^-10.6``
   below the row maximum.
3. **Activations.** FP8 per token, dynamic (:mod:`quantkit.formats.fp8`, block ``(1, 0)``):
   ``s_x[m] = amax_m / 448`` (an all-zero row gets 1), ``xq = e4m3(x / s_x)``.
4. **GEMM.** ``acc[m, n] = (Σ_k xq[m, k] · w8[n, k]) · s_x[m] · 2^c_n · s_g`` in FP32, then the
   epilogue (:mod:`quantkit.kernels.epilogue`).

The ``nvfp4-w4a8`` format applies this only where it pays on Hopper: for an input of ``M`` tokens
(all leading dims flattened) and ``N'`` weight rows it computes the W4A8 accumulator when
:func:`use_w4a8` ``(M, N')`` holds, else the exact W4A16 one ``x @ dequant(w).T`` (bf16/FP32
activations, not quantized). :func:`format_accumulate` is that function; every backend computes
it, so a kernel equals the reference at every M on any device.

Error of the weight conversion: ``|w8 · 2^c_n · s_g - w| <= 2^-4 |w|`` where the scaled value is
E4M3-normal (``>= 2^-6``), else ``<= 2^-10 · 2^c_n · s_g`` (half a subnormal step).
"""
from __future__ import annotations

import torch

from quantkit.formats import fp8
from quantkit.formats.base import QuantizedWeight
from quantkit.formats.codecs import e2m1_decode, unpack_nibbles

BLOCK = 16


# (N' at least, M from which W4A8 runs): the crossover of W4A8 (incl. its activation quantization,
# whose cost grows with M·K, not with N') and W4A16, measured on the H200 for N' = 1024..57344
# (benchmarks/notes/w4a8_format.md) and, for N' >= 6144 at 24-256 tokens, re-timed on the H100
# since the 256-token W4A8 grids (benchmarks/NOTES.md, sessions 48-49: from 65 tokens, where both
# kernels run 128-token tiles, W4A8 is faster from 10240 rows; from 33 tokens, where both run
# two-warpgroup 64-token tiles, from 33792 rows: 57344x8192, and in session 50 53248x16384 and
# 59136x8192); the first row whose N' bound holds applies.
W4A8_FROM_M = ((33792, 33), (10240, 65), (6144, 160), (3072, 384), (2048, 2048), (0, 4096))


def use_w4a8(m: int, n: int) -> bool:
    """Whether ``nvfp4-w4a8`` computes the W4A8 function for ``M = m`` tokens and ``N' = n`` weight
    rows (else W4A16): from M = 33 when N' >= 33792, 65 when N' >= 10240, 160 when N' >= 6144,
    384 when N' >= 3072, 2048 when N' >= 2048, else 4096 (:data:`W4A8_FROM_M`)."""
    return m >= next(m_from for n_from, m_from in W4A8_FROM_M if n >= n_from)


def row_exponents(scale: torch.Tensor) -> torch.Tensor:
    """int32 ``[N]``: ``c_n = floor(log2(max_b s_b[n, b]))`` for E4M3 block scales ``[N, K/16]``
    (0 where the row's scales are all zero)."""
    smax = scale.float().amax(dim=1)
    _, exp = torch.frexp(torch.where(smax > 0, smax, torch.ones_like(smax)))  # smax = m * 2^exp, m in [.5, 1)
    return torch.where(smax > 0, exp - 1, torch.zeros_like(exp)).to(torch.int32)


def weight_to_fp8(packed: torch.Tensor, scale: torch.Tensor, exponents: torch.Tensor | None = None) -> torch.Tensor:
    """``float8_e4m3fn [N, K]``: ``e4m3(e2m1(q) · s_b · 2^-c_n)`` for packed E2M1 ``uint8 [N, K/2]``,
    E4M3 block scales ``[N, K/16]`` and row exponents ``c_n`` (default :func:`row_exponents`)."""
    c = row_exponents(scale) if exponents is None else exponents
    n = packed.shape[0]
    vals = e2m1_decode(unpack_nibbles(packed)).reshape(n, -1, BLOCK)
    s = torch.ldexp(scale.float(), -c.to(torch.float32)[:, None])  # exact power-of-two shift
    return (vals * s[..., None]).reshape(n, -1).to(torch.float8_e4m3fn)  # exact product, one RNE


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq float8_e4m3fn [M, K], s_x FP32 [M])``: dynamic per-token FP8 of ``x [M, K]``."""
    q, s = fp8.quantize(x, (1, 0))
    return q, s[:, 0]


def accumulate(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """The W4A8 accumulator ``acc [M, N]`` (FP32; summed in float64, then rounded once) for
    activations ``x [M, K]`` and an NVFP4 weight (packed, block scales, FP32 tensor scale)."""
    c = row_exponents(scale)
    return _accumulate_fp8(x, weight_to_fp8(packed, scale, c), c, tensor_scale)


def _accumulate_fp8(x: torch.Tensor, w8: torch.Tensor, c: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """:func:`accumulate` from the converted weight ``w8 [N, K]`` and its row exponents ``c [N]``."""
    xq, sx = quantize_activation(x)
    acc = xq.double() @ w8.double().T
    factor = sx.double()[:, None] * torch.ldexp(torch.ones_like(c, dtype=torch.float64), c)[None, :]
    return (acc * factor * tensor_scale.double()).float()


def format_accumulate(x: torch.Tensor, qweight: QuantizedWeight, weight: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 accumulator ``[M, N']`` of the ``nvfp4-w4a8`` format for ``x [M, K]`` (bf16/FP32) and an
    NVFP4 ``qweight [N', K]``: :func:`accumulate` when :func:`use_w4a8` ``(M, N')``, else
    ``x @ dequant(w).T`` (``weight``: a cached dequantized copy). The E4M3 weight of the W4A8
    branch is cached in ``qweight.layouts["w4a8"]`` (:meth:`QuantizedWeight.cached`)."""
    if not use_w4a8(x.shape[0], qweight.shape[0]):
        w = qweight.dequantize() if weight is None else weight
        return x.to(w.dtype) @ w.T

    def build():
        c = row_exponents(qweight.scale)
        return weight_to_fp8(qweight.data, qweight.scale, c), c

    w8, c = qweight.cached("w4a8", build)
    return _accumulate_fp8(x, w8, c, qweight.tensor_scale)
