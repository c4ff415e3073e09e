"""Device code: persistent block-scaled GEMM for Blackwell (sm_100a), NVFP4×NVFP4 and MXFP8×MXFP8.

``out[m, n] = epilogue(alpha · Σ_k x̂[m, k] · ŵ[n, k])`` with ``x̂``, ``ŵ`` the block-dequantized
operands (the tensor core applies the block scales; the FP32 ``alpha`` carries NVFP4 tensor scales).

Operands, exactly as :mod:`quantkit.kernels.emulate` reads them:

* values ``x_q [M, K]`` / ``w_q [N', K]`` K-major: E2M1 packed two per byte (element ``2j`` in the
  low nibble) for ``nvfp4``, E4M3 bytes for ``mxfp8``;
* block scales in the Blackwell 128×4 swizzled layout (``quantkit.formats.layouts``): E4M3 per 16
  (``nvfp4``) or E8M0 per 32 (``mxfp8``) K elements. The kernel's view of them is CuTe's
  ``tile_atom_to_shape_SF`` layout, which is that byte formula (``tests`` check it at trace time).

Warp roles (one CTA = 6 warps, persistent over output tiles):

* warp 5, TMA: values and scales of A and B into a ``num_ab_stage``-deep shared-memory ring;
* warp 4, MMA: ``tcgen05.cp`` of the scales from shared to tensor memory, then
  ``tcgen05.mma.kind::{mxf4nvf4,mxf8f6f4}.block_scale`` into an FP32 tensor-memory accumulator
  (2 stages for 128-wide tiles, so the epilogue of tile i overlaps the mainloop of tile i+1);
* warps 0-3, epilogue: each thread owns one accumulator row and reads it 32 columns at a time
  (``tcgen05.ld 32x32b.x32``), applies alpha, bias, activation (SwiGLU pairs the gate and up
  column blocks of :data:`~quantkit.kernels.epilogue.SWIGLU_GROUP`), residual, rounds to bf16 and
  stores bf16, or requantizes (NVFP4: E2M1 + E4M3 scale per 16 under a static FP32 tensor scale;
  MXFP8: E4M3 + E8M0 scale per 32) with the scales written in the swizzled layout.

A 256-row tile runs on a 2-CTA cluster (``tcgen05.mma.cta_group::2``): each CTA loads half of A
and half of B and owns 128 accumulator rows. The scheduler is a static persistent one: cluster
``c`` takes output tiles ``c, c + G, c + 2G, ...`` (G = launched clusters), M fastest.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from quantkit.kernels.epilogue import SWIGLU_GROUP, Epilogue

EPI_N = 32  # accumulator columns per epilogue step (one tcgen05.ld 32x32b.x32 per thread)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6
MX_E4M3_EMAX = 8  # E4M3_MAX = 1.75 · 2**8
E4M3_MAX_MANTISSA = 0x600000  # the FP32 mantissa field of 1.75


@dataclass(frozen=True)
class OperandFormat:
    """What the MMA reads for one quantkit format."""

    values: type  # CuTe element type of x_q / w_q
    scale: type  # CuTe element type of the block scales
    block: int  # K elements per scale


FORMATS = {
    "nvfp4": OperandFormat(cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, 16),
    "mxfp8": OperandFormat(cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU, 32),
}
TILES = ((128, 128), (128, 256), (256, 128), (256, 256))  # (M, N); M = 256 -> 2-CTA


# ---------------------------------------------------------------------------------------------
# Scalar conversions the epilogue needs, as PTX (sm_100a has them as single instructions).
# ---------------------------------------------------------------------------------------------
def _asm(ret, args, text, constraints):
    return llvm.inline_asm(ret, args, text, constraints, has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def pack_e2m1x8(v, *, loc=None, ip=None) -> cutlass.Uint32:
    """Eight FP32 values -> one word of E2M1 codes (RNE, saturating), ``v[i]`` in nibble ``i``."""
    args = [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in v]
    text = ("{ .reg .b8 b0, b1, b2, b3;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b0, $2, $1;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b1, $4, $3;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b2, $6, $5;\n"
            "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $7;\n"
            "mov.b32 $0, {b0, b1, b2, b3}; }")
    return cutlass.Uint32(_asm(T.i32(), args, text, "=r" + ",f" * 8))


@dsl_user_op
def pack_e4m3x4(v, *, loc=None, ip=None) -> cutlass.Uint32:
    """Four FP32 values -> one word of E4M3 bytes (RNE, saturating to ±448), ``v[i]`` in byte ``i``."""
    args = [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in v]
    text = ("{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }")
    return cutlass.Uint32(_asm(T.i32(), args, text, "=r" + ",f" * 4))


@dsl_user_op
def e4m3_round(x, *, loc=None, ip=None) -> tuple[cutlass.Uint32, cutlass.Float32]:
    """FP32 -> (E4M3 byte, its FP32 value): RNE, saturating. Both bytes of the x2 conversion hold
    ``x``, so the decode does not depend on which half the hardware reads first."""
    xv = cutlass.Float32(x).ir_value(loc=loc, ip=ip)
    code = _asm(T.i32(), [xv], "{ .reg .b16 h;\ncvt.rn.satfinite.e4m3x2.f32 h, $1, $1;\ncvt.u32.u16 $0, h; }",
                "=r,f")
    value = _asm(T.f32(), [code],
                 "{ .reg .b16 h, lo, hi; .reg .b32 w;\ncvt.u16.u32 h, $1;\ncvt.rn.f16x2.e4m3x2 w, h;\n"
                 "mov.b32 {lo, hi}, w;\ncvt.f32.f16 $0, lo; }", "=f,r")
    return cutlass.Uint32(code) & cutlass.Uint32(0xFF), cutlass.Float32(value)


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> cutlass.Uint32:
    """The IEEE bits of an FP32 value."""
    return cutlass.Uint32(_asm(T.i32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f"))


@dsl_user_op
def f32_from_bits(bits, *, loc=None, ip=None) -> cutlass.Float32:
    """The FP32 value of 32 IEEE bits."""
    return cutlass.Float32(_asm(T.f32(), [cutlass.Uint32(bits).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r"))


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
class BlockscaledGemmKernel:
    """One compiled variant: format × (tile M, tile N) × epilogue × optional operands.

    ``__call__`` (host side of the JIT function) builds TMA descriptors and launches
    :meth:`kernel`. Runtime arguments: pointers to ``x_q, w_q, x_scale, w_scale, out, out_scale,
    alpha, bias, residual, requant_scale`` (unused ones are ignored; pass any pointer), the
    problem ``m, n, k`` (``n`` = weight rows N') and the stream. ``max_active_clusters`` is a
    compile-time bound on the persistent grid.
    """

    def __init__(self, fmt: str, tile_mn: tuple[int, int], epilogue: Epilogue, has_alpha: bool):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
        if tuple(tile_mn) not in TILES:
            raise ValueError(f"unsupported tile {tile_mn}; valid: {TILES}")
        if epilogue.requant not in (None, "nvfp4", "mxfp8"):
            raise ValueError(f"requant {epilogue.requant!r} is not produced by the sm100 kernel")
        self.fmt = FORMATS[fmt]
        self.epi = epilogue
        self.has_alpha = has_alpha
        self.use_2cta = tile_mn[0] == 256
        self.cluster_mn = (2, 1) if self.use_2cta else (1, 1)
        self.cta_group = tcgen05.CtaGroup.TWO if self.use_2cta else tcgen05.CtaGroup.ONE
        self.mma_mn = tuple(tile_mn)
        self.acc_dtype = cutlass.Float32
        self.epilog_warps = (0, 1, 2, 3)
        self.mma_warp = 4
        self.tma_warp = 5
        self.threads = 32 * 6
        self.epilog_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(self.epilog_warps))
        self.tmem_alloc_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (1 + len(self.epilog_warps)))
        self.smem_capacity = SmemAllocator.capacity_in_bytes("sm_100")
        self.tmem_cols = cute.arch.get_max_tmem_alloc_cols("sm_100")
        swiglu = epilogue.activation == "swiglu"
        self.out_tile_n = tile_mn[1] // 2 if swiglu else tile_mn[1]
        self.out_steps = self.out_tile_n // EPI_N

    # ----- trace-time configuration -----
    def _tiled_mma(self, cta_group, mma_mn):
        f = self.fmt
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            f.values, f.values, OperandMajorMode.K, OperandMajorMode.K, f.scale, f.block, cta_group, mma_mn)

    def _setup(self):
        f = self.fmt
        tiled_mma = self._tiled_mma(self.cta_group, self.mma_mn)
        self.atom_v = 2 if self.use_2cta else 1
        self.mma_mn_sfb = (self.mma_mn[0] // self.atom_v, cute.round_up(self.mma_mn[1], 128))
        tiled_mma_sfb = self._tiled_mma(tcgen05.CtaGroup.ONE, self.mma_mn_sfb)
        inst_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        self.mma_tiler = (*self.mma_mn, inst_k * 4)
        self.mma_tiler_sfb = (*self.mma_mn_sfb, inst_k * 4)
        self.cta_tile = (self.mma_mn[0] // self.atom_v, self.mma_mn[1], self.mma_tiler[2])
        self.cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_mn, 1)), (tiled_mma.thr_id.shape,))
        self.cluster_layout_sfb_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster_mn, 1)),
                                                         (tiled_mma_sfb.thr_id.shape,))
        self.mcast_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.mcast_b = cute.size(self.cluster_layout_vmnk.shape[1])
        self.epi_tile = (cute.make_layout(self.cta_tile[0]), cute.make_layout(EPI_N))

        self.num_acc_stage = 2 if self.mma_mn[1] == 128 else 1
        a1 = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, f.values, 1)
        b1 = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, f.values, 1)
        sfa1 = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, f.block, 1)
        sfb1 = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, f.block, 1)
        stage_bytes = (cute.size_in_bytes(f.values, a1) + cute.size_in_bytes(f.values, b1)
                       + cute.size_in_bytes(f.scale, sfa1) + cute.size_in_bytes(f.scale, sfb1))
        reserved = 1024  # barriers, tensor-memory handle, alignment
        self.num_ab_stage = (self.smem_capacity - reserved) // stage_bytes

        self.a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, f.values, self.num_ab_stage)
        self.b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, f.values, self.num_ab_stage)
        self.sfa_smem = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, f.block, self.num_ab_stage)
        self.sfb_smem = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, f.block, self.num_ab_stage)

        self.acc_cols = self.cta_tile[1] * self.num_acc_stage
        self.sfa_cols = (self.cta_tile[0] // 32) * 4
        self.sfb_cols = (self.mma_mn_sfb[1] // 32) * 4
        assert self.acc_cols + self.sfa_cols + self.sfb_cols <= self.tmem_cols
        return tiled_mma, tiled_mma_sfb

    # ----- host side of the JIT function -----
    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, sfa_ptr: cute.Pointer, sfb_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, out_sf_ptr: cute.Pointer, alpha_ptr: cute.Pointer, bias_ptr: cute.Pointer,
                 residual_ptr: cute.Pointer, requant_scale_ptr: cute.Pointer, m: cutlass.Int32, n: cutlass.Int32,
                 k: cutlass.Int32, max_active_clusters: cutlass.Constexpr, stream: cuda.CUstream):
        f = self.fmt
        tiled_mma, tiled_mma_sfb = self._setup()
        n_out = n // 2 if cutlass.const_expr(self.epi.activation == "swiglu") else n

        mA = cute.make_tensor(a_ptr, cute.make_ordered_layout((m, cute.assume(k, 128), 1), order=(1, 0, 2)))
        mB = cute.make_tensor(b_ptr, cute.make_ordered_layout((cute.assume(n, 128), cute.assume(k, 128), 1),
                                                              order=(1, 0, 2)))
        mSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.tile_atom_to_shape_SF(mA.shape, f.block))
        mSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.tile_atom_to_shape_SF(mB.shape, f.block))

        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_mn, tiled_mma.thr_id)
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_mn, tiled_mma.thr_id)
        sfb_op = sm100_utils.cluster_shape_to_tma_atom_SFB(self.cluster_mn, tiled_mma.thr_id)
        a_smem1 = cute.slice_(self.a_smem, (None, None, None, 0))
        b_smem1 = cute.slice_(self.b_smem, (None, None, None, 0))
        sfa_smem1 = cute.slice_(self.sfa_smem, (None, None, None, 0))
        sfb_smem1 = cute.slice_(self.sfb_smem, (None, None, None, 0))
        cl = self.cluster_layout_vmnk.shape
        tma_a, tA = cute.nvgpu.make_tiled_tma_atom_A(a_op, mA, a_smem1, self.mma_tiler, tiled_mma, cl)
        tma_b, tB = cute.nvgpu.make_tiled_tma_atom_B(b_op, mB, b_smem1, self.mma_tiler, tiled_mma, cl)
        tma_sfa, tSFA = cute.nvgpu.make_tiled_tma_atom_A(a_op, mSFA, sfa_smem1, self.mma_tiler, tiled_mma, cl,
                                                         internal_type=cutlass.Int16)
        tma_sfb, tSFB = cute.nvgpu.make_tiled_tma_atom_B(sfb_op, mSFB, sfb_smem1, self.mma_tiler_sfb, tiled_mma_sfb,
                                                         self.cluster_layout_sfb_vmnk.shape,
                                                         internal_type=cutlass.Int16)
        self.tma_bytes = (cute.size_in_bytes(f.values, a_smem1) + cute.size_in_bytes(f.values, b_smem1)
                          + cute.size_in_bytes(f.scale, sfa_smem1) + cute.size_in_bytes(f.scale, sfb_smem1)
                          ) * self.atom_v

        # Output views: bf16 [M, N] or requantized words [M, N·bits/32] + swizzled scales.
        out_words = n_out if cutlass.const_expr(self.epi.requant is None) else (
            n_out // 8 if cutlass.const_expr(self.epi.requant == "nvfp4") else n_out // 4)
        mOut = cute.make_tensor(out_ptr, cute.make_layout((m, out_words), stride=(cute.assume(out_words, 4), 1)))
        out_block = 16 if cutlass.const_expr(self.epi.requant == "nvfp4") else 32
        mOutSF = cute.make_tensor(out_sf_ptr, blockscaled_utils.tile_atom_to_shape_SF((m, n_out, 1), out_block))
        mBias = cute.make_tensor(bias_ptr, cute.make_layout(n))
        mResidual = cute.make_tensor(residual_ptr, cute.make_layout((m, n_out), stride=(cute.assume(n_out, 32), 1)))

        # Persistent grid: one cluster per (cluster-M, N) tile until max_active_clusters.
        tiles_m = cute.ceil_div(m, self.mma_mn[0])
        tiles_n = n // self.mma_mn[1]
        num_clusters = cutlass.min(tiles_m * tiles_n, max_active_clusters)

        @cute.struct
        class SharedStorage:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage]
            tmem_dealloc: cutlass.Int64
            tmem_holding: cutlass.Int32
            sA: cute.struct.Align[cute.struct.MemRange[f.values, cute.cosize(self.a_smem.outer)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[f.values, cute.cosize(self.b_smem.outer)], 1024]
            sSFA: cute.struct.Align[cute.struct.MemRange[f.scale, cute.cosize(self.sfa_smem)], 1024]
            sSFB: cute.struct.Align[cute.struct.MemRange[f.scale, cute.cosize(self.sfb_smem)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tiled_mma, tiled_mma_sfb, tma_a, tA, tma_b, tB, tma_sfa, tSFA, tma_sfb, tSFB,
                    mOut, mOutSF, alpha_ptr, mBias, mResidual, requant_scale_ptr, tiles_m, tiles_n,
                    self.cluster_layout_vmnk, self.cluster_layout_sfb_vmnk, self.a_smem, self.b_smem,
                    self.sfa_smem, self.sfb_smem, self.epi_tile).launch(
            grid=(self.cluster_mn[0], num_clusters, 1), block=[self.threads, 1, 1],
            cluster=(*self.cluster_mn, 1), stream=stream, min_blocks_per_mp=1)

    # ----- the kernel -----
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tiled_mma_sfb: cute.TiledMma,
               tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_sfa: cute.CopyAtom, mSFA: cute.Tensor, tma_sfb: cute.CopyAtom, mSFB: cute.Tensor,
               mOut: cute.Tensor, mOutSF: cute.Tensor, alpha_ptr: cute.Pointer, mBias: cute.Tensor,
               mResidual: cute.Tensor, requant_scale_ptr: cute.Pointer, tiles_m: cutlass.Int32,
               tiles_n: cutlass.Int32, cluster_vmnk: cute.Layout, cluster_sfb_vmnk: cute.Layout,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, sfa_smem: cute.Layout,
               sfb_smem: cute.Layout, epi_tile: cute.Tile):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == self.tma_warp:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)

        bidx, cluster_id, _ = cute.arch.block_idx()
        _, num_clusters, _ = cute.arch.grid_dim()
        v = bidx % self.atom_v
        is_leader = v == 0
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        crd_vmnk = cluster_vmnk.get_flat_coord(rank)
        crd_sfb_vmnk = cluster_sfb_vmnk.get_flat_coord(rank)
        tidx, _, _ = cute.arch.thread_idx()

        storage = SmemAllocator().allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_full.data_ptr(), num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mcast_a + self.mcast_b - 1),
            tx_count=self.tma_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_full.data_ptr(), num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * len(self.epilog_warps) * self.atom_v),
            cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        tmem = TmemAllocator(storage.tmem_holding.ptr, barrier_for_retrieve=self.tmem_alloc_barrier,
                             allocator_warp_id=self.epilog_warps[0], is_two_cta=self.use_2cta,
                             two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sSFA = storage.sSFA.get_tensor(sfa_smem)
        sSFB = storage.sSFB.get_tensor(sfb_smem)

        # (bM, bK, RestM, RestK, RestL) / (bN, bK, RestN, RestK, RestL)
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        gSFA = cute.local_tile(mSFA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gSFB = cute.local_tile(mSFB, cute.slice_(self.mma_tiler_sfb, (0, None, None)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        thr_mma = tiled_mma.get_slice(v)
        thr_mma_sfb = tiled_mma_sfb.get_slice(v)

        tCgA = thr_mma.partition_A(gA)
        tCgB = thr_mma.partition_B(gB)
        tCgSFA = thr_mma.partition_A(gSFA)
        tCgSFB = thr_mma_sfb.partition_B(gSFB)
        a_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
        b_cta = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)
        sfb_cta = cute.make_layout(cute.slice_(cluster_sfb_vmnk, (0, None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(tma_a, crd_vmnk[2], a_cta, cute.group_modes(sA, 0, 3),
                                           cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, crd_vmnk[1], b_cta, cute.group_modes(sB, 0, 3),
                                           cute.group_modes(tCgB, 0, 3))
        tAsSFA, tAgSFA = cpasync.tma_partition(tma_sfa, crd_vmnk[2], a_cta, cute.group_modes(sSFA, 0, 3),
                                               cute.group_modes(tCgSFA, 0, 3))
        tAsSFA = cute.filter_zeros(tAsSFA)
        tAgSFA = cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cpasync.tma_partition(tma_sfb, crd_sfb_vmnk[1], sfb_cta, cute.group_modes(sSFB, 0, 3),
                                               cute.group_modes(tCgSFB, 0, 3))
        tBsSFB = cute.filter_zeros(tBsSFB)
        tBgSFB = cute.filter_zeros(tBgSFB)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))

        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp == self.tma_warp:
            self._producer(ab_pipe, k_tiles, tiles_m, tiles_n, cluster_id, num_clusters, cluster_vmnk,
                           cluster_sfb_vmnk, crd_vmnk, crd_sfb_vmnk, tma_a, tAsA, tAgA, tma_b, tBsB, tBgB,
                           tma_sfa, tAsSFA, tAgSFA, tma_sfb, tBsSFB, tBgSFB)
        if warp == self.mma_warp:
            self._mma(tiled_mma, tmem, ab_pipe, acc_pipe, k_tiles, tiles_m, tiles_n, cluster_id, num_clusters,
                      is_leader, tCtAcc_fake, tCrA, tCrB, sSFA, sSFB, sfa_smem, sfb_smem)
        if warp < self.mma_warp:
            self._epilogue(thr_mma, tmem, acc_pipe, tiles_m, tiles_n, cluster_id, num_clusters,
                           tidx, epi_tile, tCtAcc_fake, mOut, mOutSF, alpha_ptr, mBias, mResidual,
                           requant_scale_ptr)

    @cute.jit
    def _tile_coord(self, tile: cutlass.Int32, tiles_m: cutlass.Int32):
        """MMA tile (m, n) of linear cluster tile index ``tile`` (M fastest)."""
        return tile % tiles_m, tile // tiles_m

    # ----- warp 5: TMA loads -----
    @cute.jit
    def _producer(self, ab_pipe, k_tiles, tiles_m, tiles_n, cluster_id, num_clusters, cluster_vmnk,
                  cluster_sfb_vmnk, crd_vmnk, crd_sfb_vmnk,
                  tma_a, tAsA, tAgA, tma_b, tBsB, tBgB, tma_sfa, tAsSFA, tAgSFA, tma_sfb, tBsSFB, tBgSFB):
        mask_a = mask_b = mask_sfa = mask_sfb = None
        if cutlass.const_expr(self.use_2cta):
            mask_a = cpasync.create_tma_multicast_mask(cluster_vmnk, crd_vmnk, mcast_mode=2)
            mask_b = cpasync.create_tma_multicast_mask(cluster_vmnk, crd_vmnk, mcast_mode=1)
            mask_sfa = cpasync.create_tma_multicast_mask(cluster_vmnk, crd_vmnk, mcast_mode=2)
            mask_sfb = cpasync.create_tma_multicast_mask(cluster_sfb_vmnk, crd_sfb_vmnk, mcast_mode=1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_ab_stage)
        for tile in cutlass.range(cluster_id, tiles_m * tiles_n, num_clusters, unroll=1):
            tm, tn = self._tile_coord(tile, tiles_m)
            gA = tAgA[(None, tm, None, 0)]
            gB = tBgB[(None, tn, None, 0)]
            gSFA = tAgSFA[(None, tm, None, 0)]
            gSFB = tBgSFB[(None, tn, None, 0)]
            state.reset_count()
            for _ in cutlass.range(k_tiles, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, gA[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=mask_a)
                cute.copy(tma_b, gB[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=mask_b)
                cute.copy(tma_sfa, gSFA[(None, state.count)], tAsSFA[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=mask_sfa)
                cute.copy(tma_sfb, gSFB[(None, state.count)], tBsSFB[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=mask_sfb)
                state.advance()
        ab_pipe.producer_tail(state)

    # ----- warp 4: scale copies and MMAs -----
    @cute.jit
    def _mma(self, tiled_mma, tmem, ab_pipe, acc_pipe, k_tiles, tiles_m, tiles_n, cluster_id, num_clusters,
             is_leader, tCtAcc_fake, tCrA, tCrB, sSFA, sSFB, sfa_smem, sfb_smem):
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        sfa_ptr = cute.recast_ptr(acc_ptr + self.acc_cols, dtype=self.fmt.scale)
        sfb_ptr = cute.recast_ptr(acc_ptr + self.acc_cols + self.sfa_cols, dtype=self.fmt.scale)
        tCtSFA = cute.make_tensor(sfa_ptr, blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, self.fmt.block, cute.slice_(sfa_smem, (None, None, None, 0))))
        tCtSFB = cute.make_tensor(sfb_ptr, blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, self.fmt.block, cute.slice_(sfb_smem, (None, None, None, 0))))
        s2t_sfa, sSFA_s2t, tSFA_s2t = self._s2t_partition(sSFA, tCtSFA)
        s2t_sfb, sSFB_s2t, tSFB_s2t = self._s2t_partition(sSFB, tCtSFB)

        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_ab_stage)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
        for _ in cutlass.range(cluster_id, tiles_m * tiles_n, num_clusters, unroll=1):
            acc = tCtAcc[(None, None, None, acc_state.index)]
            if is_leader:
                acc_pipe.producer_acquire(acc_state)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                if is_leader:
                    ab_pipe.consumer_wait(ab_state)
                    stage = (None, None, None, None, ab_state.index)
                    cute.copy(s2t_sfa, sSFA_s2t[stage], tSFA_s2t)
                    cute.copy(s2t_sfb, sSFB_s2t[stage], tSFB_s2t)
                    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                        blk = (None, None, kb, ab_state.index)
                        cute.gemm(tiled_mma, acc, [tCrA[blk], tCtSFA[(None, None, kb)]],
                                  [tCrB[blk], tCtSFB[(None, None, kb)]], acc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_pipe.consumer_release(ab_state)
                ab_state.advance()
            if is_leader:
                acc_pipe.producer_commit(acc_state)
            acc_state.advance()
        acc_pipe.producer_tail(acc_state)

    def _s2t_partition(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """tcgen05.cp (4x32x128b) partition of the staged shared-memory scales and their TMEM home."""
        sSF_compact = cute.filter_zeros(sSF)
        tSF_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.fmt.scale)
        copy = tcgen05.make_s2t_copy(atom, tSF_compact)
        thr = copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(sSF_compact))
        return copy, src, thr.partition_D(tSF_compact)

    # ----- warps 0-3: epilogue -----
    @cute.jit
    def _epilogue(self, thr_mma, tmem, acc_pipe, tiles_m, tiles_n, cluster_id, num_clusters,
                  tidx, epi_tile, tCtAcc_fake, mOut, mOutSF, alpha_ptr, mBias, mResidual, requant_scale_ptr):
        tmem.allocate(self.tmem_cols)
        tmem.wait_for_alloc()
        acc_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)

        # TMEM -> register copy: thread t of warp w reads accumulator row 32w + t, EPI_N columns.
        t2r_atom = sm100_utils.get_tmem_load_op(self.cta_tile, LayoutEnum.ROW_MAJOR, cutlass.Float32,
                                                self.acc_dtype, epi_tile, self.use_2cta)
        tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], epi_tile)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = thr_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, STAGE)
        # The (m, n) coordinate of every accumulator element, partitioned the same way.
        cAcc = cute.local_tile(cute.make_identity_tensor((tiles_m * self.mma_mn[0], tiles_n * self.mma_mn[1])),
                               self.mma_tiler[:2], (None, None))
        tCcAcc = thr_mma.partition_C(cAcc)  # (MMA, MMA_M, MMA_N, RestM, RestN)
        tTR_cAcc = thr_t2r.partition_D(cute.flat_divide(tCcAcc[((None, None), 0, 0, None, None)], epi_tile))
        frag = tTR_cAcc[(None, None, None, 0, 0, 0, 0)]
        # The epilogue relies on register i holding column n0 + i of the thread's row.
        assert all(frag.layout(i) == (0, i) for i in range(EPI_N)), f"unexpected TMEM load layout {frag}"
        tTR_rAcc = cute.make_rmem_tensor(frag.shape, self.acc_dtype)
        tTR_rUp = cute.make_rmem_tensor(frag.shape, self.acc_dtype)

        alpha = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_alpha):
            alpha = cute.make_tensor(cute.recast_ptr(alpha_ptr, dtype=cutlass.Float32), cute.make_layout(1))[0]
        qscale = cutlass.Float32(1.0)
        if cutlass.const_expr(self.epi.requant == "nvfp4"):
            qscale = cute.make_tensor(cute.recast_ptr(requant_scale_ptr, dtype=cutlass.Float32),
                                      cute.make_layout(1))[0]
        m = mOut.shape[0]

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stage)
        for tile in cutlass.range(cluster_id, tiles_m * tiles_n, num_clusters, unroll=1):
            tm, tn = self._tile_coord(tile, tiles_m)
            acc = tTR_tAcc[(None, None, None, 0, None, acc_state.index)]  # (T2R, T2R_M, T2R_N, EPI_N)
            coords = tTR_cAcc[(None, None, None, 0, None, tm, tn)]
            acc_pipe.consumer_wait(acc_state)
            for step in cutlass.range(self.out_steps, unroll=1):
                col = step
                if cutlass.const_expr(self.epi.activation == "swiglu"):
                    per_group = SWIGLU_GROUP // EPI_N
                    col = (step // per_group) * 2 * per_group + step % per_group
                cute.copy(t2r, acc[(None, None, None, col)], tTR_rAcc)
                if cutlass.const_expr(self.epi.activation == "swiglu"):
                    cute.copy(t2r, acc[(None, None, None, col + SWIGLU_GROUP // EPI_N)], tTR_rUp)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before reading the registers
                first = coords[(None, None, None, col)][0]
                row, n0 = first[0], first[1]
                y = self._bias(tTR_rAcc.load() * alpha, mBias, n0)
                if cutlass.const_expr(self.epi.activation == "swiglu"):
                    up = self._bias(tTR_rUp.load() * alpha, mBias, n0 + SWIGLU_GROUP)
                    y = self._silu(y) * up
                    n0 = (n0 // (2 * SWIGLU_GROUP)) * SWIGLU_GROUP + n0 % SWIGLU_GROUP  # output column
                else:
                    y = self._activation(y)
                self._store(y, row, n0, m, mOut, mOutSF, mResidual, qscale, frag.shape)
            acc_pipe.consumer_release(acc_state)  # every tcgen05.ld of this tile has been waited for
            acc_state.advance()

        tmem.relinquish_alloc_permit()
        self.epilog_barrier.arrive_and_wait()
        tmem.free(acc_ptr)

    # ----- epilogue pieces (per thread: one row, EPI_N consecutive columns) -----
    @cute.jit
    def _bias(self, y: cute.TensorSSA, mBias: cute.Tensor, n0: cutlass.Int32) -> cute.TensorSSA:
        """``y + bias[n0 : n0 + EPI_N]`` in FP32 (identity without a bias)."""
        if cutlass.const_expr(self.epi.bias):
            rBias = cute.make_rmem_tensor(y.shape, mBias.element_type)
            cute.autovec_copy(cute.make_tensor(mBias.iterator + cute.assume(n0, EPI_N), cute.make_layout(y.shape)),
                              rBias)
            y = y + rBias.load().to(cutlass.Float32)
        return y

    @cute.jit
    def _silu(self, y: cute.TensorSSA) -> cute.TensorSSA:
        return y / (1.0 + cute.math.exp(-y))

    @cute.jit
    def _activation(self, y: cute.TensorSSA) -> cute.TensorSSA:
        """The elementwise activations of :data:`~quantkit.kernels.epilogue.ACTIVATIONS` in FP32."""
        act = self.epi.activation
        if cutlass.const_expr(act == "relu"):
            y = cute.where(y > 0.0, y, cute.full_like(y, 0.0))
        elif cutlass.const_expr(act == "silu"):
            y = self._silu(y)
        elif cutlass.const_expr(act == "gelu_tanh"):
            inner = 0.7978845608028654 * (y + 0.044715 * y * y * y)
            y = 0.5 * y * (1.0 + cute.math.tanh(inner))
        return y

    @cute.jit
    def _store(self, y: cute.TensorSSA, row: cutlass.Int32, n0: cutlass.Int32, m: cutlass.Int32,
               mOut: cute.Tensor, mOutSF: cute.Tensor, mResidual: cute.Tensor, qscale: cutlass.Float32, shape):
        """Residual, bf16 rounding, then the bf16 store or the requantized store of row ``row``,
        output columns ``[n0, n0 + EPI_N)``; rows ``>= m`` are not stored."""
        in_bounds = row < m
        if cutlass.const_expr(self.epi.residual):
            rRes = cute.make_rmem_tensor(shape, mResidual.element_type)
            rRes.fill(0.0)
            if in_bounds:
                cute.autovec_copy(cute.make_tensor(mResidual.iterator + cute.assume(row * mResidual.shape[1] + n0,
                                                                                   EPI_N),
                                                   cute.make_layout(shape)), rRes)
            y = y + rRes.load().to(cutlass.Float32)
        y16 = y.to(cutlass.BFloat16)
        if cutlass.const_expr(self.epi.requant is None):
            rOut = cute.make_rmem_tensor(shape, cutlass.BFloat16)
            rOut.store(y16)
            if in_bounds:
                cute.autovec_copy(rOut, cute.make_tensor(mOut.iterator + cute.assume(row * mOut.shape[1] + n0, EPI_N),
                                                         cute.make_layout(shape)))
        else:
            rY = cute.make_rmem_tensor(cute.size(shape), cutlass.Float32)
            rY.store(y16.to(cutlass.Float32))
            per_word = 8 if cutlass.const_expr(self.epi.requant == "nvfp4") else 4
            rWords = cute.make_rmem_tensor(EPI_N // per_word, cutlass.Uint32)
            if cutlass.const_expr(self.epi.requant == "nvfp4"):
                self._quant_nvfp4(rY, rWords, row, n0, in_bounds, mOutSF, qscale)
            else:
                self._quant_mxfp8(rY, rWords, row, n0, in_bounds, mOutSF)
            if in_bounds:
                words = EPI_N // per_word
                cute.autovec_copy(rWords, cute.make_tensor(
                    mOut.iterator + cute.assume(row * mOut.shape[1] + n0 // per_word, words), cute.make_layout(words)))

    @cute.jit
    def _quant_nvfp4(self, rY: cute.Tensor, rWords: cute.Tensor, row: cutlass.Int32, n0: cutlass.Int32,
                     in_bounds: cutlass.Boolean, mOutSF: cute.Tensor, tensor_scale: cutlass.Float32):
        """NVFP4 of ``rY`` (bf16-exact FP32), the FP32 arithmetic of ``quantkit.formats.nvfp4``:
        ``s_b = e4m3(clamp((amax/6)/s_g, 2**-6, 448))``, ``q = e2m1(y · ((1/s_g)/s_b))``."""
        inv_ts = 1.0 / tensor_scale
        for b in cutlass.range_constexpr(EPI_N // 16):
            amax = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(16):
                amax = cute.arch.fmax(amax, cute.math.abs(rY[b * 16 + i]))
            sb = (amax / E2M1_MAX) / tensor_scale
            sb = cute.arch.fmin(cute.arch.fmax(sb, E4M3_TINY), E4M3_MAX)
            code, sb_value = e4m3_round(sb)
            recip = inv_ts / sb_value
            for w in cutlass.range_constexpr(2):
                rWords[b * 2 + w] = pack_e2m1x8([rY[b * 16 + w * 8 + i] * recip for i in range(8)])
            if in_bounds:
                mOutSF[(row, n0 + b * 16, 0)] = cutlass.Uint8(code)

    @cute.jit
    def _quant_mxfp8(self, rY: cute.Tensor, rWords: cute.Tensor, row: cutlass.Int32, n0: cutlass.Int32,
                     in_bounds: cutlass.Boolean, mOutSF: cute.Tensor):
        """MXFP8 of ``rY`` by the rounded-up rule of ``quantkit.formats.mx``:
        ``e = clamp(ceil(log2(amax / 448)) + 127, 0, 254)``, ``q = e4m3(y · 2**(127-e))``. With
        ``amax = 1.f · 2**(E-127)``, ``amax / 448 = (1.f / 1.75) · 2**(E-135)``, so ``e = E - 8``,
        plus one when ``1.f > 1.75`` (read off the FP32 bits; the FP32 quotient never rounds
        across a power of two, so this equals the formats' ``fl(amax / 448)``)."""
        for b in cutlass.range_constexpr(EPI_N // 32):
            amax = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(32):
                amax = cute.arch.fmax(amax, cute.math.abs(rY[b * 32 + i]))
            bits = f32_bits(amax)
            biased = cutlass.Int32((bits >> 23) & 0xFF)
            above = cutlass.Int32(((bits & 0x7FFFFF) + (0x7FFFFF - E4M3_MAX_MANTISSA)) >> 23)  # 1.f > 1.75
            e = cutlass.max(cutlass.min(biased - MX_E4M3_EMAX + above, 254), 0)
            recip = f32_from_bits(cutlass.Uint32(254 - cutlass.min(e, 253)) << 23)
            for w in cutlass.range_constexpr(8):
                rWords[b * 8 + w] = pack_e4m3x4([rY[b * 32 + w * 4 + i] * recip for i in range(4)])
            if in_bounds:
                mOutSF[(row, n0 + b * 32, 0)] = cutlass.Uint8(e)


def compile_args(fmt: str, epilogue: Epilogue, bias_dtype: type = cutlass.BFloat16):
    """Placeholder pointers/scalars with the dtypes :class:`BlockscaledGemmKernel` is traced with
    (addresses are runtime values, so one compile serves every problem size)."""
    from cutlass.cute.runtime import make_ptr

    f = FORMATS[fmt]
    out_dtype = {None: cutlass.BFloat16, "nvfp4": cutlass.Uint32, "mxfp8": cutlass.Uint32}[epilogue.requant]
    gmem = cute.AddressSpace.gmem
    return [make_ptr(f.values, 0, gmem, assumed_align=16), make_ptr(f.values, 0, gmem, assumed_align=16),
            make_ptr(f.scale, 0, gmem, assumed_align=16), make_ptr(f.scale, 0, gmem, assumed_align=16),
            make_ptr(out_dtype, 0, gmem, assumed_align=16), make_ptr(cutlass.Uint8, 0, gmem, assumed_align=16),
            make_ptr(cutlass.Float32, 0, gmem, assumed_align=4), make_ptr(bias_dtype, 0, gmem, assumed_align=16),
            make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16), make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
            cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0)]


def scale_layout_offsets(rows: int, k: int, block: int) -> list[list[int]]:
    """Byte offsets ``[rows][k // block]`` that the kernel's CuTe view of a swizzled scale tensor
    (``tile_atom_to_shape_SF``, as built in ``__call__``) assigns to scale ``(r, j)``, evaluated
    at trace time (no GPU needed); tests compare them with the layout contract."""
    offsets = []

    @cute.jit
    def trace(rows: cutlass.Constexpr, k: cutlass.Constexpr, block: cutlass.Constexpr):
        layout = blockscaled_utils.tile_atom_to_shape_SF((rows, k, 1), block)
        offsets.extend([layout((r, j * block, 0)) for j in range(k // block)] for r in range(rows))

    cute.compile(trace, rows, k, block)
    return offsets
