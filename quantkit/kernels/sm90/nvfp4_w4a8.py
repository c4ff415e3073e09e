"""W4A8 on Hopper: per-token FP8 activation quantization (CuTeDSL) feeding the NVFP4 GEMM of
:mod:`.nvfp4_gemm` in its FP8 mode. Numerics: :mod:`quantkit.formats.w4a8`. The ``nvfp4-w4a8``
format's op (:func:`nvfp4_w4a8_format_op`) picks W4A8 or W4A16 per call by
:func:`quantkit.formats.w4a8.use_w4a8`, inside the op: one graph for every M under
``torch.compile``.

The quantization kernel (one CTA per row) loads the row once into registers (rows up to
``THREADS * GROUP * 8`` = 32768 columns; longer ones are read twice, the second time from L2),
takes its amax, and writes ``xq`` with K permuted within every 16 columns (:func:`.nvfp4_gemm.
w4a8_k_permutation`) so the GEMM's FP8 fragment slots see the columns its weight bytes hold:
``s[m] = amax/448`` (1 for an all-zero row), ``xq = e4m3(x / s)`` with a correctly rounded FP32
division (one reciprocal per row and two FMAs per element, :func:`.act_quant.div_rn`) and a
saturating round-to-nearest-even, as :func:`quantkit.formats.w4a8.quantize_activation`.
"""
import functools
import threading

import torch

from quantkit.formats.w4a8 import use_w4a8
from quantkit.kernels.epilogue import Epilogue
from quantkit.kernels.cache import launch_stream, use_tvm_ffi
from quantkit.kernels.ops import kernel_op
from quantkit.kernels.sm90.nvfp4_gemm import (Config, Nvfp4Sm90Weight, launch_gemm, nvfp4_w4a16, output_shape,
                                              weight_from_tensors)

THREADS = 256
GROUP = 16  # columns one thread converts at a time: one permuted 16-byte store
HELD = (1, 2, 4, 8)  # groups per thread kept in registers between the passes (compiled variants; rows up to K = 32768)

_lock = threading.Lock()
_KERNEL = None


def _build_act_quant():
    """Define the CuTeDSL activation-quantization kernel (imports CuTeDSL)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from quantkit.kernels.sm90.act_quant import div_rn, lifted_divisor

    @dsl_user_op
    def e4m3x2(lo, hi, *, loc=None, ip=None):
        """16-bit pair ``(e4m3(lo), e4m3(hi))`` (lo in the low byte), RNE, saturating."""
        return Uint32(llvm.inline_asm(
            T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            "{.reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; cvt.u32.u16 $0, t;}",
            "=r,f,f", has_side_effects=False, loc=loc, ip=ip))

    class ActQuantW4A8:
        """One CTA per row: amax (block reduction), then 16-column groups -> 16 permuted bytes; each
        thread holds up to ``held`` groups in registers between the two (fewer registers, more CTAs
        per SM for short rows)."""

        def __init__(self, held: int):
            self.held = held

        @cute.jit
        def __call__(self, x_ptr: Int64, q_ptr: Int64, s_ptr: Int64, m: Int32, k: Int32, stream):
            mS = cute.make_tensor(cute.make_ptr(Float32, s_ptr, cute.AddressSpace.gmem, assumed_align=4),
                                  cute.make_layout(m))
            self.kernel(x_ptr, q_ptr, mS, k).launch(grid=(m, 1, 1), block=(THREADS, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, x_ptr: Int64, q_ptr: Int64, mS: cute.Tensor, k: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            groups = k // GROUP
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32), 16)
            vals = cute.make_rmem_tensor(GROUP, cutlass.BFloat16)
            held = cute.make_rmem_tensor((GROUP, self.held), cutlass.BFloat16)
            in_regs = groups <= THREADS * self.held
            amax = Float32(0.0)
            if in_regs:  # every load of the row in flight at once, kept for the second pass
                for j in cutlass.range_constexpr(self.held):
                    if tidx + j * THREADS < groups:
                        self.load(x_ptr, row, k, tidx + j * THREADS, held[None, j])
                for j in cutlass.range_constexpr(self.held):
                    if tidx + j * THREADS < groups:
                        amax = self.group_amax(held[None, j], amax)
            else:
                for g in cutlass.range(tidx, groups, THREADS, unroll=1):
                    self.load(x_ptr, row, k, g, vals)
                    amax = self.group_amax(vals, amax)
            for off in cutlass.range_constexpr(5):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
            if tidx % 32 == 0:
                red[tidx // 32] = amax
            cute.arch.sync_threads()
            amax = red[0]
            for w in cutlass.range_constexpr(1, THREADS // 32):
                amax = cute.arch.fmax(amax, red[w])
            scale = amax / Float32(448.0)
            if amax == Float32(0.0):
                scale = Float32(1.0)
            if tidx == 0:
                mS[row] = scale
            divisor = lifted_divisor(scale)
            if in_regs:
                for j in cutlass.range_constexpr(self.held):
                    if tidx + j * THREADS < groups:
                        self.store(q_ptr, row, k, tidx + j * THREADS, held[None, j], divisor)
            else:  # the second pass re-reads the row (from L2)
                for g in cutlass.range(tidx, groups, THREADS, unroll=1):
                    self.load(x_ptr, row, k, g, vals)
                    self.store(q_ptr, row, k, g, vals, divisor)

        @cute.jit
        def group_amax(self, vals, amax):
            """``max(amax, |vals|)`` over one group."""
            for i in cutlass.range_constexpr(GROUP):
                v = vals[i].to(Float32)
                amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
            return amax

        @cute.jit
        def store(self, q_ptr, row, k, g, vals, divisor):
            """Group ``g`` of row ``row`` divided by the row scale (``divisor``: :func:`lifted_divisor`),
            as 16 E4M3 bytes in permuted order, one 16-byte store."""
            lift, div, inv = divisor
            words = cute.make_rmem_tensor(4, Uint32)
            for c in cutlass.range_constexpr(4):  # byte 4c + j <- column (2c, 2c+1, 2c+8, 2c+9)[j]
                q = [div_rn(vals[i].to(Float32) * lift, div, inv) for i in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)]
                words[c] = e4m3x2(q[0], q[1]) | (e4m3x2(q[2], q[3]) << 16)
            dst = q_ptr + Int64(row) * k + g * GROUP
            cute.autovec_copy(words, cute.make_tensor(cute.make_ptr(Uint32, dst, cute.AddressSpace.gmem, assumed_align=16),
                                                      cute.make_layout(4)))

        @cute.jit
        def load(self, x_ptr, row, k, g, vals):
            """Columns ``16g .. 16g+15`` of row ``row`` into ``vals`` (two 16-byte loads)."""
            src = x_ptr + (Int64(row) * k + g * GROUP) * 2
            cute.autovec_copy(cute.make_tensor(cute.make_ptr(cutlass.BFloat16, src, cute.AddressSpace.gmem,
                                                             assumed_align=16), cute.make_layout(GROUP)), vals)

    return ActQuantW4A8


def held_groups(k: int) -> int:
    """The :data:`HELD` variant for rows of ``k`` columns: the fewest groups per thread that hold
    the row (the largest for rows longer than that; they are read twice)."""
    per_thread = -(-k // (GROUP * THREADS))
    return next((h for h in HELD if per_thread <= h), HELD[-1])


def compile_act_quant(held: int = HELD[-1], tvm_ffi: bool = False, arch: str | None = None, options: str = ""):
    """The compiled activation-quantization kernel holding up to ``held`` groups per thread
    (through :mod:`..cache`). Its executor takes data pointers ``(x bf16 [M, K], xq [M, K] E4M3,
    s FP32 [M])``, ``M``, ``K`` and a stream (a ``cuda.CUstream``; with ``tvm_ffi``, CuTeDSL's
    apache-tvm-ffi calling convention, an int)."""
    global _KERNEL
    from quantkit.kernels.cache import compile_kernel, pin_arch

    arch = pin_arch(arch)
    from cutlass.cute.runtime import make_fake_stream

    with _lock:
        if _KERNEL is None:
            _KERNEL = _build_act_quant()
    return compile_kernel(("sm90.nvfp4_w4a8.act_quant", held), _KERNEL(held), 0, 0, 0, 1, 128, make_fake_stream(),
                          arch=arch, options=options, tvm_ffi=tvm_ffi)


@functools.lru_cache(maxsize=None)
def _executor(held: int, tvm_ffi: bool):
    """:func:`compile_act_quant`'s executor, cached: the per-call host path is a dict lookup."""
    return compile_act_quant(held, tvm_ffi)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``x [M, K]`` (K a multiple of 16) -> (E4M3 ``xq [M, K]`` in the GEMM's permuted K
    order, FP32 ``s [M]``): :func:`quantkit.formats.w4a8.quantize_activation` of
    ``x[:, w4a8_k_permutation(K)]``, on the GPU."""
    m, k = x.shape
    if x.dtype != torch.bfloat16 or k % GROUP:
        raise ValueError(f"expected bf16 x[M, K] with K % {GROUP} == 0, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        tvm_ffi = use_tvm_ffi()
        _executor(held_groups(k), tvm_ffi)(x.data_ptr(), xq.data_ptr(), s.data_ptr(), m, k,
                                           launch_stream(x.device, tvm_ffi))
    return xq, s


def nvfp4_w4a8_quantized(xq: torch.Tensor, x_scale: torch.Tensor, w: Nvfp4Sm90Weight, epilogue: Epilogue = Epilogue(),
                         bias=None, residual=None, config: Config | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The W4A8 GEMM alone, on activations already quantized by :func:`quantize_activation`."""
    if xq.dtype != torch.float8_e4m3fn or xq.dim() != 2 or xq.shape[1] != w.k or x_scale.shape != (xq.shape[0],):
        raise ValueError(f"expected E4M3 xq[M, {w.k}] and FP32 x_scale[M]; got {xq.dtype} {tuple(xq.shape)}, "
                         f"{tuple(x_scale.shape)}")
    return launch_gemm(xq.contiguous(), w, epilogue, True, x_scale.float().contiguous(), bias, residual, config, out)


def nvfp4_w4a8(x: torch.Tensor, w: Nvfp4Sm90Weight, epilogue: Epilogue = Epilogue(), bias=None, residual=None,
               config: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``epilogue(acc)`` with ``acc`` the W4A8 accumulator of :mod:`quantkit.formats.w4a8` (its
    ``accumulate`` is the reference): bf16 ``x [M, K]``, a prepared NVFP4 weight ``[N', K]``,
    optional ``bias [N']`` (bf16/FP32) and bf16 ``residual [M, N]``; returns bf16 ``[M, N]``."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"expected bf16 x[M, {w.k}], got {x.dtype} {tuple(x.shape)}")
    xq, xs = quantize_activation(x)
    return nvfp4_w4a8_quantized(xq, xs, w, epilogue, bias, residual, config, out)


@kernel_op("quantkit::nvfp4_w4a8")
def nvfp4_w4a8_op(x: torch.Tensor, tiles: torch.Tensor, row_exp: torch.Tensor, tensor_scale: torch.Tensor,
                  n: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  activation: str = "identity") -> torch.Tensor:
    """``torch.library`` op around :func:`nvfp4_w4a8` on a prepared weight's tensors (``n``: N')."""
    epi = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None)
    return nvfp4_w4a8(x, weight_from_tensors(tiles, row_exp, tensor_scale, n), epi, bias, residual)


@nvfp4_w4a8_op.register_fake
def _(x, tiles, row_exp, tensor_scale, n, bias=None, residual=None, activation="identity"):
    return x.new_empty(output_shape(x, n, activation), dtype=torch.bfloat16)


@kernel_op("quantkit::nvfp4_w4a8_format")
def nvfp4_w4a8_format_op(x: torch.Tensor, tiles: torch.Tensor, row_exp: torch.Tensor, tensor_scale: torch.Tensor,
                         n: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                         activation: str = "identity") -> torch.Tensor:
    """The ``nvfp4-w4a8`` format on a prepared weight's tensors: :func:`nvfp4_w4a8` when
    ``use_w4a8(M, n)``, else :func:`.nvfp4_gemm.nvfp4_w4a16` (bf16 ``x [M, K]`` -> bf16 ``[M, N]``)."""
    epi = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None)
    fn = nvfp4_w4a8 if use_w4a8(x.shape[0], n) else nvfp4_w4a16
    return fn(x, weight_from_tensors(tiles, row_exp, tensor_scale, n), epi, bias, residual)


@nvfp4_w4a8_format_op.register_fake
def _(x, tiles, row_exp, tensor_scale, n, bias=None, residual=None, activation="identity"):
    return x.new_empty(output_shape(x, n, activation), dtype=torch.bfloat16)
