"""Blackwell (sm_100) block-scaled GEMMs: host API and ``torch.library`` custom ops.

:func:`blockscaled_gemm` checks the operands, compiles (once per variant, through
:mod:`quantkit.kernels.cache`) and launches the CuTeDSL kernel of
:mod:`quantkit.kernels.sm100.blockscaled_gemm`, which is imported only on first use (CuTeDSL reads
its target arch once, at import). On a device that is not sm_100 it raises ``RuntimeError`` before
compiling anything, so a dispatcher can fall back.

Operand formats (``fmt``):

========  ================================  ======================================================
fmt       values ``x_q [M, ·]``, ``w_q``    block scales (flat, Blackwell 128×4 swizzled layout)
========  ================================  ======================================================
nvfp4     uint8 ``[·, K/2]``, 2 E2M1/byte   ``float8_e4m3fn``, one per 16 K elements
mxfp8     float8_e4m3fn ``[·, K]``          uint8 E8M0 (``float8_e8m0fnu`` accepted), one per 32
========  ================================  ======================================================

The output is bf16 ``[M, N]`` or, with ``epilogue.requant``, the next layer's activation:
``nvfp4`` → (uint8 ``[M, N/2]``, float8_e4m3fn swizzled scales) under the static FP32 tensor scale
``requant_scale``; ``mxfp8`` → (float8_e4m3fn ``[M, N]``, uint8 E8M0 swizzled scales). Swizzled
scale rows beyond ``M`` (padding up to a multiple of 128) are left unwritten.
"""
from __future__ import annotations

import functools

import torch

from quantkit.kernels import cache
from quantkit.kernels.epilogue import IDENTITY, Epilogue
from quantkit.kernels.ops import kernel_op

FORMATS = ("nvfp4", "mxfp8")
_VALUE_DTYPE = {"nvfp4": torch.uint8, "mxfp8": torch.float8_e4m3fn}
_SCALE_DTYPES = {"nvfp4": (torch.float8_e4m3fn,), "mxfp8": (torch.uint8, torch.float8_e8m0fnu)}
_BLOCK = {"nvfp4": 16, "mxfp8": 32}
_PACK = {"nvfp4": 2, "mxfp8": 1}  # values per byte
K_MULTIPLE = 128


def swizzled_numel(rows: int, cols: int) -> int:
    """Bytes of a 128×4-swizzled scale tensor for ``rows × cols`` scales (rows → 128s, cols → 4s)."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


def default_tile(m: int, n: int) -> tuple[int, int]:
    """Output tile (M, N): 256-row 2-CTA tiles once M exceeds one 128-row tile, N 128."""
    return (256 if m > 128 else 128, 128)


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda:
        raise RuntimeError(f"sm100 block-scaled GEMM needs CUDA tensors, got device {t.device}")
    cap = torch.cuda.get_device_capability(t.device)
    if cap != (10, 0):
        name = torch.cuda.get_device_name(t.device)
        raise RuntimeError(f"sm100 block-scaled GEMM needs a Blackwell sm_100 GPU (tcgen05, compiled for "
                           f"sm_100a); {t.device} is {name}, sm_{cap[0]}{cap[1]}")


def _check_operands(x_q, x_scale, w_q, w_scale, fmt, alpha, epilogue, bias, residual, requant_scale, tile):
    """Raise ValueError naming the first operand the kernel cannot take; return (m, n, k)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    for name, t in (("x_q", x_q), ("w_q", w_q)):
        if t.dim() != 2 or t.dtype != _VALUE_DTYPE[fmt] or not t.is_contiguous():
            raise ValueError(f"{fmt}: {name} must be a contiguous 2-D {_VALUE_DTYPE[fmt]} tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
    m, k = x_q.shape[0], x_q.shape[1] * _PACK[fmt]
    n = w_q.shape[0]
    if w_q.shape[1] * _PACK[fmt] != k:
        raise ValueError(f"{fmt}: K mismatch, x_q {tuple(x_q.shape)} vs w_q {tuple(w_q.shape)}")
    if k % K_MULTIPLE or m == 0:
        raise ValueError(f"{fmt}: needs K divisible by {K_MULTIPLE} and M > 0, got M={m}, K={k}")
    if n % tile[1]:
        raise ValueError(f"{fmt}: N={n} weight rows must be divisible by the tile N {tile[1]}")
    for name, t, rows in (("x_scale", x_scale, m), ("w_scale", w_scale, n)):
        want = swizzled_numel(rows, k // _BLOCK[fmt])
        if t.dtype not in _SCALE_DTYPES[fmt] or t.numel() != want or not t.is_contiguous():
            raise ValueError(f"{fmt}: {name} must be {want} contiguous swizzled {_SCALE_DTYPES[fmt][0]} scales, got "
                             f"{t.numel()} {t.dtype}")
    n_out = n // 2 if epilogue.activation == "swiglu" else n
    if epilogue.bias and (bias is None or bias.shape != (n,) or bias.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError(f"epilogue.bias needs a bf16/FP32 bias of shape ({n},)")
    if epilogue.residual and (residual is None or residual.shape != (m, n_out) or residual.dtype != torch.bfloat16
                              or not residual.is_contiguous()):
        raise ValueError(f"epilogue.residual needs a contiguous bf16 residual of shape ({m}, {n_out})")
    if epilogue.requant not in (None, "nvfp4", "mxfp8"):
        raise ValueError(f"sm100 kernel cannot requantize to {epilogue.requant!r}")
    if epilogue.requant == "nvfp4" and (requant_scale is None or requant_scale.numel() != 1
                                        or requant_scale.dtype != torch.float32):
        raise ValueError("requant='nvfp4' needs the next layer's FP32 tensor scale as requant_scale")
    if alpha is not None and (alpha.numel() != 1 or alpha.dtype != torch.float32):
        raise ValueError("alpha must be a one-element FP32 tensor")
    for name, t in (("x_q", x_q), ("w_q", w_q), ("x_scale", x_scale), ("w_scale", w_scale), ("bias", bias),
                    ("residual", residual)):
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    return m, n, k


@functools.lru_cache(maxsize=None)
def compile_variant(fmt: str, tile: tuple[int, int], epilogue: Epilogue, *, has_alpha: bool = True,
                    bias_dtype: torch.dtype = torch.bfloat16, max_active_clusters: int = 148,
                    arch: str | None = None, options: str = ""):
    """Compile (or fetch from the cache) one kernel variant; returns the CuTeDSL executor.

    ``arch`` (e.g. ``"sm_100a"``) compiles without a GPU; ``options`` go to ``cute.compile`` (e.g.
    ``"--keep-ptx --keep-cubin --dump-dir D"``)."""
    cache.pin_arch(arch)
    import cuda.bindings.driver as cuda
    import cutlass

    from quantkit.kernels.sm100.blockscaled_gemm import BlockscaledGemmKernel, compile_args

    cute_bias = cutlass.BFloat16 if bias_dtype == torch.bfloat16 else cutlass.Float32
    key = ("sm100_blockscaled_gemm", fmt, tuple(tile), epilogue, has_alpha, bias_dtype, max_active_clusters, options)
    kernel = BlockscaledGemmKernel(fmt, tuple(tile), epilogue, has_alpha)
    return cache.compile_kernel(key, kernel, *compile_args(fmt, epilogue, cute_bias), max_active_clusters,
                                cuda.CUstream(0), arch=arch, options=options)


def blockscaled_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *,
                     fmt: str, alpha: torch.Tensor | None = None, epilogue: Epilogue = IDENTITY,
                     bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                     requant_scale: torch.Tensor | None = None, tile: tuple[int, int] | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``epilogue(alpha · dq(x_q) @ dq(w_q).T)`` on an sm_100 GPU (see the module docstring for
    the operand formats). ``alpha``: FP32 one-element device tensor (NVFP4: ``s_g(x)·s_g(w)``),
    ``None`` for 1. Returns bf16 ``[M, N]`` or the requantized ``(values, swizzled scales)``.

    Raises ``RuntimeError`` on a non-sm_100 device and ``ValueError`` for operands the kernel does
    not take (both before any compilation)."""
    _check_device(x_q)
    tile = tuple(tile or default_tile(x_q.shape[0], w_q.shape[0]))
    m, n, k = _check_operands(x_q, x_scale, w_q, w_scale, fmt, alpha, epilogue, bias, residual, requant_scale, tile)
    n_out = n // 2 if epilogue.activation == "swiglu" else n
    dev = x_q.device
    if epilogue.requant is None:
        out, out_scale = torch.empty(m, n_out, dtype=torch.bfloat16, device=dev), None
    elif epilogue.requant == "nvfp4":
        out = torch.empty(m, n_out // 2, dtype=torch.uint8, device=dev)
        out_scale = torch.empty(swizzled_numel(m, n_out // 16), dtype=torch.float8_e4m3fn, device=dev)
    else:
        out = torch.empty(m, n_out, dtype=torch.float8_e4m3fn, device=dev)
        out_scale = torch.empty(swizzled_numel(m, n_out // 32), dtype=torch.uint8, device=dev)

    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    cluster = 2 if tile[0] == 256 else 1
    executor = compile_variant(fmt, tile, epilogue, has_alpha=alpha is not None,
                               bias_dtype=bias.dtype if bias is not None else torch.bfloat16,
                               max_active_clusters=sm_count // cluster, arch=cache.device_arch(dev))
    _launch(executor, fmt, epilogue, x_q, w_q, x_scale, w_scale, out, out_scale, alpha, bias, residual,
            requant_scale, m, n, k)
    return out if out_scale is None else (out, out_scale)


def _launch(executor, fmt, epilogue, x_q, w_q, x_scale, w_scale, out, out_scale, alpha, bias, residual,
            requant_scale, m, n, k) -> None:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from quantkit.kernels.sm100.blockscaled_gemm import FORMATS as DEVICE_FORMATS

    f = DEVICE_FORMATS[fmt]

    def ptr(dtype, t, align=16):
        return make_ptr(dtype, (t if t is not None else x_q).data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    out_dtype = cutlass.BFloat16 if epilogue.requant is None else cutlass.Uint32
    bias_dtype = cutlass.Float32 if bias is not None and bias.dtype == torch.float32 else cutlass.BFloat16
    stream = cuda.CUstream(torch.cuda.current_stream(x_q.device).cuda_stream)
    executor(ptr(f.values, x_q), ptr(f.values, w_q), ptr(f.scale, x_scale), ptr(f.scale, w_scale),
             ptr(out_dtype, out), ptr(cutlass.Uint8, out_scale), ptr(cutlass.Float32, alpha, 4),
             ptr(bias_dtype, bias), ptr(cutlass.BFloat16, residual), ptr(cutlass.Float32, requant_scale, 4),
             cutlass.Int32(m), cutlass.Int32(n), cutlass.Int32(k), stream)


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (torch.compile, CUDA graphs)
# ---------------------------------------------------------------------------------------------
def _out_shape(x_q: torch.Tensor, w_q: torch.Tensor, activation: str) -> tuple[int, int]:
    n = w_q.shape[0]
    return x_q.shape[0], n // 2 if activation == "swiglu" else n


@kernel_op("quantkit::sm100_blockscaled_gemm")
def sm100_blockscaled_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                           alpha: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None,
                           fmt: str, activation: str) -> torch.Tensor:
    """Custom-op form of :func:`blockscaled_gemm` with a bf16 output ``[M, N]``."""
    epi = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None)
    return blockscaled_gemm(x_q, x_scale, w_q, w_scale, fmt=fmt, alpha=alpha, epilogue=epi, bias=bias,
                            residual=residual)


@sm100_blockscaled_gemm.register_fake
def _(x_q, x_scale, w_q, w_scale, alpha, bias, residual, fmt, activation):
    return x_q.new_empty(_out_shape(x_q, w_q, activation), dtype=torch.bfloat16)


@kernel_op("quantkit::sm100_blockscaled_gemm_requant")
def sm100_blockscaled_gemm_requant(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                                   w_scale: torch.Tensor, alpha: torch.Tensor | None, bias: torch.Tensor | None,
                                   residual: torch.Tensor | None, requant_scale: torch.Tensor | None, fmt: str,
                                   activation: str, requant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom-op form of :func:`blockscaled_gemm` with a requantized output ``(values, scales)``."""
    epi = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None, requant=requant)
    return blockscaled_gemm(x_q, x_scale, w_q, w_scale, fmt=fmt, alpha=alpha, epilogue=epi, bias=bias,
                            residual=residual, requant_scale=requant_scale)


@sm100_blockscaled_gemm_requant.register_fake
def _(x_q, x_scale, w_q, w_scale, alpha, bias, residual, requant_scale, fmt, activation, requant):
    m, n = _out_shape(x_q, w_q, activation)
    if requant == "nvfp4":
        return (x_q.new_empty((m, n // 2), dtype=torch.uint8),
                x_q.new_empty((swizzled_numel(m, n // 16),), dtype=torch.float8_e4m3fn))
    return (x_q.new_empty((m, n), dtype=torch.float8_e4m3fn),
            x_q.new_empty((swizzled_numel(m, n // 32),), dtype=torch.uint8))


__all__ = ["FORMATS", "blockscaled_gemm", "compile_variant", "default_tile", "sm100_blockscaled_gemm",
           "sm100_blockscaled_gemm_requant", "swizzled_numel"]


from quantkit.kernels.sm100 import backend as _backend  # noqa: E402,F401  (registers the dispatcher backend)
