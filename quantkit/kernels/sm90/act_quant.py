"""Activation quantization for the fp8-block GEMM: bf16 ``x[M, K]`` -> FP8 E4M3 + FP32 scale per
1x128 group, optionally fused with RMSNorm, as a CuTeDSL kernel (runs on sm_90a and later).

Numerics (``quantkit.formats.fp8``, DeepSeek-V3 activations): per group of 128 along K,
``s = amax/448`` (``s = 1`` for an all-zero group) and ``q = e4m3(x / s)`` (RNE, saturating).
With RMSNorm (``norm_weight`` given) the quantized tensor is the bf16 RMSNorm output as Hugging Face
Llama computes it: ``y = bf16(norm_weight * bf16(x * rsqrt(mean(x^2) + eps)))`` (mean and rsqrt
in FP32). :func:`act_quant_reference` is that definition in PyTorch.

The scales come out M-major, as the ``[M, K/128]`` view of a ``[K/128, roundup(M, 4)]`` buffer,
which is the layout :mod:`quantkit.kernels.sm90.fp8_block_gemm` loads by TMA.

Kernel: a warp quantizes one group at a time, each lane 4 consecutive elements of it (8-byte
loads, 4-byte FP8 stores), with the loads of its next 4 groups issued together; the group amax is
a 5-step warp shuffle, and the divisions by the scale are :func:`div_rn` (one reciprocal per
group, :func:`lifted_divisor`). A CTA of 4 warps takes a
``span`` of consecutive groups of one row, each warp every 4th: the whole row with RMSNorm (a first
pass sums squares over the row: warp shuffle, then the 4 warps through shared memory; the second
pass re-reads the row from L1/L2) or from ``SPLIT_ROWS`` rows up; 4 groups below that (grid
``M x K/512``: at decode sizes every group's load is in flight at once, where a row's CTA would
walk its groups one after another).
"""
from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from quantkit.formats import fp8
from quantkit.kernels.cache import launch_stream, use_tvm_ffi
from quantkit.kernels.ops import kernel_op

GROUP = 128
FP8_MAX = 448.0
_FLT_MIN = 2.0**-126  # the smallest normal FP32
_WARPS = 4
_UNROLL = 4  # groups a warp loads at once
# Up to this many rows a CTA takes 4 groups (one per warp), from here on a whole row: at M = 1-16
# 1.6-1.8 µs instead of 4.6-7.3; at M = 8192, K = 16384 the row CTAs measured 153 µs, 4-group
# CTAs 177 (H200, benchmarks/notes/fp8_block.md session 10).
SPLIT_ROWS = 512


@dsl_user_op
def rcp_rn(b, *, loc=None, ip=None):
    """``1/b`` correctly rounded (``rcp.rn.f32``)."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(b).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;",
                                           "=f,f", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def div_rn(a, b, y, *, loc=None, ip=None):
    """``a / b`` correctly rounded for ``b > 0``, given ``y = rcp_rn(b)``: Markstein's correction
    ``q = a·y``, ``q + (a − b·q)·y`` (two FMAs; exact for normal quotients, and a subnormal one is
    far below E4M3's smallest value), with the sign of ``a`` (the sum would turn ``-0`` into ``+0``).
    Branch-free, unlike ``div.rn.f32``, whose slow path every zero dividend takes."""
    return cutlass.Float32(llvm.inline_asm(
        T.f32(), [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, y)],
        "{ .reg .f32 q, r, nb, d; mul.rn.f32 q, $1, $3; neg.f32 nb, $2; fma.rn.f32 r, nb, q, $1; "
        "fma.rn.f32 d, r, $3, q; copysign.f32 $0, $1, d; }", "=f,f,f,f", has_side_effects=False, loc=loc, ip=ip))


@cute.jit
def lifted_divisor(scale):
    """``(f, b, y)`` such that ``div_rn(x * f, b, y)`` is the correctly rounded ``x / scale`` for a
    group's values (``|x| <= 448 * scale``; quotients below the normal range aside, which E4M3
    rounds to 0 either way): ``b = scale * f``, ``y = rcp_rn(b)``, and ``f = 2^64`` where ``scale``
    is subnormal (its reciprocal would overflow), else 1. Both products are exact, so the quotient
    is unchanged."""
    f = cutlass.Float32(1.0)
    if scale < _FLT_MIN:
        f = cutlass.Float32(2.0**64)
    b = scale * f
    return f, b, rcp_rn(b)


def act_quant_reference(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """PyTorch definition of the kernel: ``(float8_e4m3fn [M, K], FP32 [M, K/128])`` for bf16
    ``x[M, K]``, after HF-Llama RMSNorm with bf16 ``norm_weight[K]`` when given."""
    if norm_weight is not None:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
        x = norm_weight.to(torch.bfloat16) * normed
    return fp8.quantize(x, (1, GROUP))


class ActQuantSm90:
    """bf16 -> fp8-block activation quantization (optionally after RMSNorm); call through ``cute.compile``."""

    def __init__(self, rmsnorm: bool, pdl: bool = False):
        self.rmsnorm = rmsnorm
        self.pdl = pdl  # programmatic dependent launch: starts before the previous kernel ends, lets the next start

    @cute.jit
    def __call__(
        self,
        x_ptr: cutlass.Int64,  # bf16 [M, K] row-major
        w_ptr: cutlass.Int64,  # bf16 [K] RMSNorm weight (0 without RMSNorm)
        q_ptr: cutlass.Int64,  # fp8 [M, K] row-major
        s_ptr: cutlass.Int64,  # fp32 [M, K/128], M-major with leading dim ld (>= roundup(M, 4), a multiple of 4)
        m: cutlass.Int32,
        ld: cutlass.Int32,
        k: cutlass.Int32,
        span: cutlass.Int32,  # groups per CTA: K/128 (whole rows; required with RMSNorm) or 4
        eps: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        gmem = cute.AddressSpace.gmem
        k = cute.assume(k, divby=GROUP)
        ld = cute.assume(ld, divby=4)
        mX = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, x_ptr, gmem, assumed_align=16), cute.make_layout((m, k), stride=(k, 1)))
        mW = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, w_ptr, gmem, assumed_align=16), cute.make_layout((k,)))
        mQ = cute.make_tensor(cute.make_ptr(cutlass.Float8E4M3FN, q_ptr, gmem, assumed_align=16), cute.make_layout((m, k), stride=(k, 1)))
        mS = cute.make_tensor(cute.make_ptr(cutlass.Float32, s_ptr, gmem, assumed_align=16), cute.make_layout((m, k // GROUP), stride=(1, ld)))
        grid = (m, (k // GROUP + span - 1) // span, 1)
        self.kernel(mX, mW, mQ, mS, span, eps).launch(grid=grid, block=(32 * _WARPS, 1, 1), stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, span: cutlass.Int32,
               eps: cutlass.Float32):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel (the GEMM) may launch now
            cute.arch.griddepcontrol_wait()  # the previous kernel wrote x
        tidx, _, _ = cute.arch.thread_idx()
        row, chunk, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        k = mX.shape[1]
        groups = k // GROUP
        # (4, K/4): column j holds elements 4j .. 4j+3 of the row
        xrow = cute.zipped_divide(mX[(row, None)], (4,))
        qrow = cute.zipped_divide(mQ[(row, None)], (4,))
        wvec = cute.zipped_divide(mW, (4,))

        inv_rms = cutlass.Float32(1.0)
        if cutlass.const_expr(self.rmsnorm):
            smem = cutlass.memory.SmemAllocator()
            partial = smem.allocate_tensor(cutlass.Float32, cute.make_layout((_WARPS,)), byte_alignment=16)
            ss = cutlass.Float32(0.0)
            for g in cutlass.range(warp, groups, _WARPS, unroll=_UNROLL):
                v = xrow[(None, g * 32 + lane)].load().to(cutlass.Float32)
                for i in cutlass.range_constexpr(4):
                    ss = ss + v[i] * v[i]
            ss = cute.arch.warp_reduction_sum(ss)
            if lane == 0:
                partial[warp] = ss
            cute.arch.barrier()
            total = partial[0] + partial[1] + partial[2] + partial[3]
            inv_rms = cute.math.rsqrt(total / k.to(cutlass.Float32) + eps)
        first = chunk * span
        end = cutlass.min(first + span, groups)
        # _UNROLL groups per warp and step, all loaded before any is stored (the stores may alias
        # the loads for all the compiler knows): _UNROLL x 256 bytes in flight per warp
        for g0 in cutlass.range(first + warp, end, _WARPS * _UNROLL):
            vals = [cute.make_rmem_tensor(xrow[(None, 0)].shape, cutlass.Float32) for _ in range(_UNROLL)]
            for u in cutlass.range_constexpr(_UNROLL):
                g = g0 + u * _WARPS
                if g < end:
                    vals[u].store(xrow[(None, g * 32 + lane)].load().to(cutlass.Float32))
            for u in cutlass.range_constexpr(_UNROLL):
                g = g0 + u * _WARPS
                if g < end:
                    self._quant_group(vals[u].load(), qrow, wvec, mS, row, g, lane, inv_rms)

    @cute.jit
    def _quant_group(self, v, qrow, wvec, mS, row, g, lane, inv_rms):
        """Group ``g`` of row ``row`` from its FP32 values ``v`` (lane: elements ``4 lane .. 4 lane + 3``):
        RMSNorm, amax, FP8 and scale."""
        if cutlass.const_expr(self.rmsnorm):
            w = wvec[(None, g * 32 + lane)].load().to(cutlass.Float32)
            normed = (v * inv_rms).to(cutlass.BFloat16).to(cutlass.Float32)
            v = (w * normed).to(cutlass.BFloat16).to(cutlass.Float32)
        amax = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(4):
            amax = cute.arch.fmax(amax, cute.arch.fmax(v[i], -v[i]))
        for b in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << b))
        scale = amax / FP8_MAX
        if amax == 0.0:
            scale = cutlass.Float32(1.0)
        q = cute.make_rmem_tensor((4,), cutlass.Float32)
        f, b, inv = lifted_divisor(scale)
        for i in cutlass.range_constexpr(4):
            q[i] = div_rn(v[i] * f, b, inv)
        qrow[(None, g * 32 + lane)].store(q.load().to(cutlass.Float8E4M3FN))  # cvt.rn.satfinite: +-448, NaN kept
        if lane == 0:
            mS[row, g] = scale


def compile_act_quant(rmsnorm: bool, *, pdl: bool = False, tvm_ffi: bool = False, arch: str | None = None, options: str = ""):
    """Compiled :class:`ActQuantSm90` (through :mod:`quantkit.kernels.cache`); the executor takes
    ``(x, norm_weight, q, scale)`` data pointers, ``M``, the scales' leading dimension, ``K``, the groups per CTA (``K/128`` with
    RMSNorm), ``eps`` and a ``cuda.CUstream`` (with
    ``tvm_ffi``, CuTeDSL's apache-tvm-ffi calling convention, the stream handle as an int)."""
    from cutlass.cute.runtime import make_fake_stream

    from quantkit.kernels.cache import compile_kernel

    return compile_kernel(("sm90.act_quant", rmsnorm, pdl), ActQuantSm90(rmsnorm, pdl), 0, 0, 0, 0, 1, 4, GROUP, 1, 1e-6,
                          make_fake_stream(), arch=arch, options=options, tvm_ffi=tvm_ffi)


@functools.lru_cache(maxsize=None)
def _executor(rmsnorm: bool, pdl: bool, tvm_ffi: bool):
    """:func:`compile_act_quant`'s executor, cached: the per-call host path is a dict lookup."""
    return compile_act_quant(rmsnorm, pdl=pdl, tvm_ffi=tvm_ffi)


def act_quant(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
              rows: int | None = None, pdl: bool = False):
    """fp8-block quantization of bf16 ``x[M, K]`` (K divisible by 128) on the GPU, optionally
    after RMSNorm with bf16 ``norm_weight[K]``: returns (float8_e4m3fn ``[M, K]``, FP32 scales
    ``[M, K/128]`` M-major), equal to :func:`act_quant_reference`. With ``rows`` (>= M) both
    come back ``rows`` high with the rows past M unwritten: the operands of a GEMM that reads whole
    token tiles (:func:`.fp8_block_gemm.fp8_block_gemm` with ``m=M``). ``pdl``: launched as a
    programmatic dependent of the previous kernel on the stream, letting the next one launch early."""
    m, k = x.shape
    rows = m if rows is None else rows
    if x.dtype != torch.bfloat16 or k % GROUP:
        raise ValueError(f"expected bf16 x[M, K] with K divisible by {GROUP}; got {x.dtype} {tuple(x.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (k,):
        raise ValueError(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if rows < m:
        raise ValueError(f"rows={rows} is fewer than the {m} rows of x")
    q, scale = quantized_empty(rows, k, x.device)
    if m == 0:
        return q, scale
    x = x.contiguous()
    w = norm_weight.to(torch.bfloat16).contiguous() if norm_weight is not None else None
    tvm_ffi = use_tvm_ffi()
    fn = _executor(norm_weight is not None, pdl, tvm_ffi)
    fn(x.data_ptr(), 0 if w is None else w.data_ptr(), q.data_ptr(), scale.data_ptr(), m, scale.stride(1), k,
       groups_per_cta(m, k, w is not None), eps, launch_stream(x.device, tvm_ffi))
    return q, scale


def quantized_empty(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised operands the kernel writes for ``rows`` rows of ``K`` columns: float8_e4m3fn
    ``[rows, K]`` and FP32 scales ``[rows, K/128]`` (:func:`m_major_empty`; ``stride(1)`` is the
    kernel's ``ld``)."""
    return torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device), m_major_empty(rows, k // GROUP, device)


def m_major_empty(rows: int, cols: int, device) -> torch.Tensor:
    """Uninitialised FP32 ``[rows, cols]`` with strides ``(1, roundup(rows, 4))``: the M-major scale
    layout the fp8-block GEMM loads by TMA (16-byte column stride) and its requant epilogue writes.
    One ``empty_strided`` (a sliced and transposed ``empty`` costs 3-4x the host time)."""
    return torch.empty_strided((rows, cols), (1, -(-rows // 4) * 4), dtype=torch.float32, device=device)


def groups_per_cta(m: int, k: int, rmsnorm: bool) -> int:
    """The kernel's ``span`` for ``M`` rows of ``K`` columns: whole rows with RMSNorm or from
    :data:`SPLIT_ROWS` rows up, else 4 groups (one per warp)."""
    return k // GROUP if rmsnorm or m > SPLIT_ROWS else _WARPS


@kernel_op("quantkit::fp8_act_quant")
def act_quant_op(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.library`` op around :func:`act_quant` (torch.compile, CUDA graphs)."""
    return act_quant(x, norm_weight, eps)


@act_quant_op.register_fake
def _(x, norm_weight=None, eps=1e-6):
    m, k = x.shape
    m4 = (m + 3) // 4 * 4
    return x.new_empty((m, k), dtype=torch.float8_e4m3fn), torch.empty_strided((m, k // GROUP), (1, m4), dtype=torch.float32, device=x.device)
