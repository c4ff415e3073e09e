"""Hopper (sm_90a) decode GEMV on fp8-block weights (``M <= 16`` tokens), in CuTeDSL.

Computes what :mod:`.act_quant` followed by :mod:`.fp8_block_gemm` computes, in one kernel that
reads bf16 activations: per 1x128 group the activations are quantized in registers exactly as the
activation-quantization kernel does (``s = amax/448``, ``q = e4m3(x / s)``, RNE, saturating; the
division is a branch-free correctly rounded sequence, :func:`.act_quant.div_rn`), and

    acc[m, n] = sum_kb (sum_{k in kb} q[m, k] * w[n, k]) * s[m, kb] * w_scale[n // 128, kb]

in FP32 (warp-level ``mma.sync.m16n8k32`` on E4M3, a fresh accumulator per 128-K block, promoted
with the two scales), then the epilogue (bias, activation incl. interleaved SwiGLU, residual) and
a bf16 store. At decode the GEMM's two kernels (quantize, then a 64-row WGMMA tile per CTA) cost
more than the weight bytes do; this kernel streams the FP8 weight as it is stored (``[N, K]``
row-major, no re-layout) at the byte rate.

The skeleton — a private ``cp.async`` ring per warp, K runs per warp, partial sums meeting in
shared memory or in a K-split cluster's distributed shared memory, PDL, the epilogue — is the NVFP4
GEMV's (:mod:`.nvfp4_gemv`); this module supplies the weight format:

* a ring slot holds a 64x128 FP8 weight tile (rows of 128 bytes, 16-byte chunks XOR-swizzled by
  ``row % 8``: the fragment loads are free of bank conflicts), the tile's weight-block scale and
  the k-tile's ``tokens x 128`` bf16 activations;
* the MMA's K order is permuted (the same way for both operands): lane ``(g, c)`` owns bytes
  ``32c .. 32c+31`` of each 128-byte row, so its A fragments are two 16-byte loads per row and its B
  fragments are the 32 activations of token ``g`` it quantizes itself (the group amax is a
  2-step shuffle over the 4 lanes of the token); with 9-16 tokens a second 8-token fragment
  (token ``g + 8``) reuses each A fragment.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantkit.kernels.cache import data_ptr, launch_stream, num_sms, use_tvm_ffi
from quantkit.kernels.epilogue import SWIGLU_GROUP, Epilogue, epilogue_operands
from quantkit.kernels.sm90 import nvfp4_gemv as gv

BK = 128  # K per k-tile: one activation group, one weight-scale block
ROWS = 64  # weight rows per warp tile
W_TILE = ROWS * BK  # FP8 weight bytes of a tile
SLOT_HEAD = W_TILE + 16  # + the tile's weight-block scale (16 bytes keep the activations aligned)
FRAG, MAX_M = gv.FRAG, gv.MAX_M  # tokens per MMA fragment (the MMA N), and two fragments


@dataclass(frozen=True)
class Fp8GemvConfig(gv.GemvConfig):
    """:class:`.nvfp4_gemv.GemvConfig` with fp8-block ring slots; K-splits only as clusters."""

    def check(self, epilogue: Epilogue) -> None:
        super().check(epilogue)
        if self.splits > 1 and not self.cluster:
            raise ValueError("the fp8-block GEMV splits K only across a cluster (cluster=True)")

    def slot_bytes(self) -> int:
        """One ring slot: the weight tile, its scale and ``tokens`` activation rows."""
        return SLOT_HEAD + self.tokens * gv.X_ROW


def pick_gemv_config(m: int, n: int, k: int, epilogue: Epilogue, num_sms: int = 132) -> Fp8GemvConfig:
    """The GEMV config for ``m`` tokens (rules fitted to the H200 sweep of
    ``benchmarks/gemv_fp8_block.py --tune``, ``benchmarks/notes/fp8_block.md`` v7): PDL, ring slots
    for the next power of two of ``m``, the deepest ring (3 or 2 slots) the shape allows.

    * The grid fits one wave of 8-warp CTAs (one per SM): 8 warps; where it fills at most half the
      SMs and each warp keeps >= 4 k-tiles, a 2-way K-split cluster doubles it.
    * 1-4 waves: 4-warp CTAs, two per SM (half the wave-quantization tail).
    * More: 8 warps."""
    tiles = 2 if epilogue.activation == "swiglu" else 1
    tokens = 1 << max(0, m - 1).bit_length()
    ctas = n // (ROWS * tiles)

    def deepest(warps: int, splits: int = 1, per_sm: int = 1) -> Fp8GemvConfig | None:
        for stages in (3, 2):
            cfg = Fp8GemvConfig(warps, tiles, stages, splits, tokens, pdl=True, cluster=splits > 1)
            if cfg.smem_bytes() <= gv._SMEM and cfg.ctas_per_sm() >= per_sm:
                return cfg
        return None

    if ctas <= num_sms:
        splits = 2 if (2 * ctas <= num_sms and (k // BK) // (8 // tiles) >= 4) else 1
        return deepest(8, splits)
    if ctas <= 4 * num_sms:
        return deepest(4, per_sm=2) or deepest(8)
    return deepest(8)


# ---------------------------------------------------------------------------------------- kernel
@functools.cache  # built on first use: importing cutlass is slow
def _kernel_class():
    """Define the CuTeDSL kernel (imports CuTeDSL; called on first compile)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from quantkit.kernels.sm90.act_quant import div_rn, lifted_divisor
    from quantkit.kernels.sm90.fp8_block_gemm import FP8_MAX

    @dsl_user_op
    def cp_async_4(dst_smem, src_gmem, *, loc=None, ip=None):
        """``cp.async.ca`` of 4 bytes global -> shared."""
        llvm.inline_asm(None, [Int32(dst_smem).ir_value(loc=loc, ip=ip), Int64(src_gmem).ir_value(loc=loc, ip=ip)],
                        "cp.async.ca.shared.global [$0], [$1], 4;", "r,l", has_side_effects=True, loc=loc, ip=ip)

    @dsl_user_op
    def bf16_bits_to_f32(bits, *, loc=None, ip=None):
        """The FP32 whose bit pattern is ``bits`` (a bf16 in the high half, zeros below)."""
        return Float32(llvm.inline_asm(T.f32(), [Uint32(bits).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
                                       has_side_effects=False, loc=loc, ip=ip))

    @dsl_user_op
    def pack_e4m3x4(v0, v1, v2, v3, *, loc=None, ip=None):
        """Four FP32 values as E4M3 (RNE, saturating) in one 32-bit word, ``v0`` in the low byte."""
        return Uint32(llvm.inline_asm(
            T.i32(), [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", has_side_effects=False, loc=loc, ip=ip))

    class Fp8BlockGemvSm90(gv._kernel_class()):
        """One (config, epilogue, bias dtype) fp8-block GEMV; call through ``cute.compile``."""

        def make_fragments(self):
            """Registers of one k-tile, per 8-token fragment: the lane's 32 quantized activations
            (8 words) and the promotion factors of its two token columns."""
            nf = self.mt // FRAG
            return cute.make_rmem_tensor((8, nf), Uint32), cute.make_rmem_tensor((2, nf), Float32)

        @cute.jit
        def issue_weights(self, ring_addr, w_ptr, aux_ptr, rb, kt, slot, lane, k):
            """Copies of rows ``64 rb ..`` x columns ``128 kt ..`` of the FP8 weight (16 bytes per lane
            and copy; chunk ``ch`` of row ``r`` lands at chunk ``ch ^ (r % 8)``) and of the tile's
            weight-block scale into ring slot ``slot``."""
            dst = ring_addr + slot * self.slot
            src = w_ptr + Int64(rb * ROWS) * k + kt * BK
            for q in cutlass.range_constexpr(W_TILE // 512):
                r = 4 * q + lane // 8
                ch = lane % 8
                self.copy_16(dst + r * BK + (ch ^ (r % 8)) * 16, src + Int64(r) * k + ch * 16, 16)
            if lane == 0:
                cp_async_4(dst + W_TILE, aux_ptr + (Int64(rb // 2) * (k // BK) + kt) * 4)

        def ring_views(self, storage):
            """The ring as (word, chunk, row, slot, warp) weight tiles, (word, chunk, lane c, token,
            slot, warp) activations and (slot, warp) weight-block scales."""
            cfg = self.cfg
            slot_words = self.slot // 4
            ring_words = cfg.stages * slot_words
            words = cute.recast_ptr(storage.ring.data_ptr(), dtype=Uint32)
            sW = cute.make_tensor(words, cute.make_layout((4, 8, ROWS, cfg.stages, cfg.warps),
                                                          stride=(1, 4, BK // 4, slot_words, ring_words)))
            sX = cute.make_tensor(words + self.x_offset // 4, cute.make_layout(
                (4, 4, 4, cfg.tokens, cfg.stages, cfg.warps), stride=(1, 4, 16, gv.X_ROW // 4, slot_words, ring_words)))
            w_scale = cute.make_tensor(cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32) + W_TILE // 4,
                                       cute.make_layout((cfg.stages, cfg.warps), stride=(slot_words, ring_words)))
            return sW, sX, w_scale

        @cute.jit
        def load_fragments(self, frag, storage, slot, warp, lane):
            """The activations of ring slot ``slot`` quantized per token (lane ``(g, c)``: tokens
            ``g + 8f``, elements ``32c .. 32c+31``) and the promotion factors."""
            cfg = self.cfg
            rq, fac = frag
            _, sX, w_scale = self.ring_views(storage)
            g, c = lane // 4, lane % 4
            ws = w_scale[slot, warp]
            for f in cutlass.range_constexpr(self.mt // FRAG):
                xw = cute.make_rmem_tensor((4, 4), Uint32)  # 32 bf16 of token g + 8f (zero past the slot's)
                if cutlass.const_expr(cfg.tokens < FRAG * (f + 1)):
                    xw.fill(0)
                if g + FRAG * f < cfg.tokens:
                    for q in cutlass.range_constexpr(4):
                        cute.autovec_copy(sX[None, q, c, g + FRAG * f, slot, warp], xw[None, q])
                xv = cute.make_rmem_tensor((32,), Float32)
                amax = Float32(0.0)
                for i in cutlass.range_constexpr(16):
                    word = xw[i % 4, i // 4]
                    xv[2 * i] = bf16_bits_to_f32(word << 16)
                    xv[2 * i + 1] = bf16_bits_to_f32(word & Uint32(0xFFFF0000))
                    for e in cutlass.range_constexpr(2):
                        amax = cute.arch.fmax(amax, cute.arch.fmax(xv[2 * i + e], -xv[2 * i + e]))
                for b in cutlass.range_constexpr(2):  # the 4 lanes of a token hold its 128 elements
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << b))
                num = amax  # s = amax/448, 1 for an all-zero group (selected before dividing: no zero dividend)
                if amax == 0.0:
                    num = Float32(FP8_MAX)
                scale = num / FP8_MAX
                lift, b, inv = lifted_divisor(scale)
                for w in cutlass.range_constexpr(8):
                    rq[w, f] = pack_e4m3x4(*[div_rn(xv[4 * w + i] * lift, b, inv) for i in range(4)])
                fac[0, f] = cute.arch.shuffle_sync(scale, 8 * c) * ws  # token 8f + 2c's scale (lane 4 * 2c)
                fac[1, f] = cute.arch.shuffle_sync(scale, 8 * c + 4) * ws

        @cute.jit
        def accumulate(self, frag, acc, storage, slot, warp, lane):
            """Per strip: its A fragments from the ring slot (lane ``(g, c)``: bytes ``32c ..`` of rows
            ``g`` and ``g + 8``), then per 8-token fragment the k-tile's four ``m16n8k32`` MMAs into a
            fresh accumulator, promoted into ``acc`` with the tokens' scales times the weight-block scale."""
            rq, fac = frag
            sW, _, _ = self.ring_views(storage)
            g, c = lane // 4, lane % 4
            for s in cutlass.range_constexpr(4):
                ra = cute.make_rmem_tensor((4, 2, 2), Uint32)  # (word, 16-byte chunk, row half)
                for h in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(2):
                        cute.autovec_copy(sW[None, (2 * c + j) ^ g, 16 * s + 8 * h + g, slot, warp], ra[None, j, h])
                for f in cutlass.range_constexpr(self.mt // FRAG):
                    d = [Float32(0.0)] * 4
                    for b in cutlass.range_constexpr(4):
                        j, w = b // 2, 2 * (b % 2)  # bytes 8b .. 8b+7 of the lane's 32: chunk j, words w, w+1
                        d = self.mma("m16n8k32.row.col.f32.e4m3.e4m3.f32",
                                     [ra[w, j, 0], ra[w, j, 1], ra[w + 1, j, 0], ra[w + 1, j, 1]],
                                     rq[2 * b, f], rq[2 * b + 1, f], d)
                    for i in cutlass.range_constexpr(4):
                        acc[i, s, f] = acc[i, s, f] + d[i] * fac[i % 2, f]

        @cute.jit
        def alpha(self, aux_ptr):
            """No factor beyond the promotion's scales."""
            return Float32(1.0)

    return Fp8BlockGemvSm90


def compile_gemv(config: Fp8GemvConfig, epilogue: Epilogue, *, bias_fp32: bool = False, tvm_ffi: bool = False,
                 arch: str | None = None, options: str = ""):
    """The compiled GEMV for one (config, epilogue, bias dtype), through :mod:`..cache`. The
    executor takes data pointers ``(x, w, w_scale, out, bias, residual, 0, 0)`` (0 when unused),
    then ``M, N, N_out, K`` and the stream (``cuda.CUstream``, or with ``tvm_ffi`` its handle as an int)."""
    from cutlass.cute.runtime import make_fake_stream

    from quantkit.kernels.cache import compile_kernel, pin_arch

    arch = pin_arch(arch)
    kernel = _kernel_class()(config, epilogue, bias_fp32)
    key = ("sm90.fp8_block_gemv", config, epilogue, bias_fp32)
    n = 2 * ROWS
    n_out = n // (2 if epilogue.activation == "swiglu" else 1)
    return compile_kernel(key, kernel, *([0] * 8), 1, n, n_out, BK, make_fake_stream(), arch=arch, options=options,
                          tvm_ffi=tvm_ffi)


# ---------------------------------------------------------------------------------------- host
@functools.lru_cache(maxsize=4096)
def _plan(tokens: int, n: int, k: int, epilogue: Epilogue, bias_fp32: bool, device: torch.device,
          config: Fp8GemvConfig | None, tvm_ffi: bool):
    """The executor of one launch shape, cached: the per-call host path is a dict lookup."""
    config = config or pick_gemv_config(tokens, n, k, epilogue, num_sms(device))
    config.check(epilogue)
    return compile_gemv(config, epilogue, bias_fp32=bias_fp32, tvm_ffi=tvm_ffi)


def use_gemv(m: int, n: int, k: int, epilogue: Epilogue, num_sms: int) -> bool:
    """Whether :func:`.fp8_block_gemm.fp8_block_linear` takes the GEMV for ``m`` tokens: where it
    :func:`supports` the call, and (H200,
    ``notes/fp8_block.md`` v7): up to 8 tokens always (1.2-1.9x bf16 on 13 shapes; 1.0-3.0x
    act_quant + GEMM, parity only at 8 tokens on multi-wave weights); 9-16 tokens where the weight is
    one wave of 8-warp CTAs (0.93-1.34x bf16, 1.29-1.91x the two kernels; on multi-wave weights the
    two kernels were 3-30 % faster)."""
    rows = 2 * SWIGLU_GROUP if epilogue.activation == "swiglu" else ROWS
    return supports(m, n, k, epilogue) and (m <= FRAG or n // rows <= num_sms)


def supports(m: int, n: int, k: int, epilogue: Epilogue) -> bool:
    """Whether the GEMV computes ``x[m, k] @ w[n, k]`` with ``epilogue`` (bf16 output only)."""
    rows = 2 * SWIGLU_GROUP if epilogue.activation == "swiglu" else ROWS
    return 0 < m <= MAX_M and k % BK == 0 and n % rows == 0 and epilogue.requant is None


def fp8_block_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, epilogue: Epilogue = Epilogue(),
                   bias=None, residual=None, config: Fp8GemvConfig | None = None, out=None) -> torch.Tensor:
    """fp8-block linear of bf16 ``x [M <= 16, K]`` on a Hopper GPU: float8_e4m3fn ``w [N', K]``, FP32
    ``w_scale [ceil(N'/128), K/128]``, ``bias`` bf16/FP32 ``[N']``, ``residual`` bf16 ``[M, N]``;
    returns bf16 ``[M, N]`` (``N = N'/2`` for swiglu), equal to
    ``fp8_block_gemm(*act_quant(x), w, w_scale, epilogue, ...)`` up to FP32 summation order."""
    m, k = x.shape
    n = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.float8_e4m3fn or w.shape[1] != k:
        raise ValueError(f"expected bf16 x[M, K] and float8_e4m3fn w[N, K]; got {x.dtype} {tuple(x.shape)}, "
                         f"{w.dtype} {tuple(w.shape)}")
    if not supports(m, n, k, epilogue):
        raise ValueError(f"the fp8-block GEMV does not run M={m}, N'={n}, K={k} with {epilogue}")
    if tuple(w_scale.shape) != (-(-n // BK), k // BK):
        raise ValueError(f"w_scale {tuple(w_scale.shape)} does not match w {tuple(w.shape)}")
    if config is not None and m > config.tokens:
        raise ValueError(f"{config} serves at most {config.tokens} tokens, got {m}")
    n_out = n // 2 if epilogue.activation == "swiglu" else n
    bias, residual, bias_fp32 = epilogue_operands(epilogue, m, n, n_out, bias, residual)
    if out is None:
        out = torch.empty(m, n_out, dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n_out) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n_out}] tensor")
    # the kernel copies 16-byte chunks of both
    x, w = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (x.contiguous(), w.contiguous()))
    w_scale = w_scale.float().contiguous()
    tvm_ffi = use_tvm_ffi()
    fn = _plan(1 << (m - 1).bit_length(), n, k, epilogue, bias_fp32, x.device, config, tvm_ffi)
    fn(*map(data_ptr, (x, w, w_scale, out, bias, residual)), 0, 0, m, n, n_out, k, launch_stream(x.device, tvm_ffi))
    return out
