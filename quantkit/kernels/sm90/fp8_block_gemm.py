"""Hopper (sm_90a) FP8 block-scaled GEMM with fused epilogues, in CuTeDSL.

Computes, for FP8 E4M3 ``x[M, K]`` with FP32 scales ``x_scale[M, K/128]`` (one per row per 128 K)
and FP8 E4M3 ``w[N', K]`` with FP32 scales ``w_scale[N'/128, K/128]`` (one per 128x128 block)::

    acc[m, n] = sum_kb (sum_{k in kb} x[m, k] * w[n, k]) * x_scale[m, kb] * w_scale[n // 128, kb]

in FP32, then the :class:`~quantkit.kernels.epilogue.Epilogue` (bias, activation incl. interleaved
SwiGLU, residual, requant to fp8-block), and stores bf16 ``[M, N]`` (or FP8 + FP32 group scales).

Structure (one CTA per SM, persistent over output tiles, visited in raster groups of
``TileConfig.raster`` N-tiles so the operands a wave reads stay in L2):

* warpgroup 0, warp 0 — producer: TMA loads of the ``x`` tile (``tile_m x 128``), the ``w`` tile
  (``tile_n x 128``) and the tile's ``tile_m`` activation scales into a ring of shared-memory stages
  (multicast across a cluster when the cluster shape asks for it);
* warpgroups 1.. — consumers, each owning a ``64 x tile_n`` sub-tile: per 128-K block,
  WGMMA into a temporary FP32 accumulator, then *promotion* ``acc += tmp * x_scale[row] *
  w_scale`` outside the tensor core (with two temporaries, one block's promotion overlaps the
  next block's WGMMAs). A tile's epilogue runs in registers (right after its mainloop, or once the
  next tile's first K blocks are issued: ``TileConfig.defer_epilogue``), with the bias already in
  registers since the mainloop's start (``TileConfig.early_bias``), and the tile leaves through
  shared memory in one TMA store group. SiLU and GELU-tanh cost one ``tanh.approx`` per element
  (``TileConfig.act_tanh``; within the 1e-3 float64 gate of the GPU tests).

With ``TileConfig.pdl`` the kernel launches as a programmatic dependent of the one before it on
the stream: the producer loads the first tile's first weight stages, then waits for that kernel
(``griddepcontrol.wait``) before any activation load, and the consumers wait before their first
output; every CTA lets the next kernel launch as it starts.

With ``TileConfig.splits`` > 1 (small-M grids that fill few SMs) each tile's K is split over a
thread-block cluster of that many CTAs, one tile per CTA: splits 1.. leave their FP32 partial in
their drained operand stages and split 0 adds them through distributed shared memory
(:func:`.split_k.dsl_cluster`), then runs the epilogue.

``M`` is a runtime value (TMA zero-fills rows past ``M`` on load and clips them on store), so one
compiled kernel serves every ``M``; ``N'`` and ``K`` must be multiples of 128.

The activation scales are read by TMA from an M-major copy ``x_scale_t[K/128, M4]`` (``M4 = M``
rounded up to 4, so TMA's 16-byte stride rule holds): :func:`scales_for_tma` makes it; the
activation-quantization kernel (:mod:`quantkit.kernels.sm90.act_quant`) and this kernel's
``requant`` epilogue write scales directly in that layout.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
import torch

from quantkit.kernels.cache import data_ptr, launch_stream, num_sms, use_tvm_ffi
from quantkit.kernels.epilogue import SWIGLU_GROUP, Epilogue, epilogue_operands
from quantkit.kernels.ops import kernel_op
from quantkit.kernels.sm90 import split_k
from quantkit.kernels.sm90.act_quant import ActQuantSm90, groups_per_cta, m_major_empty, quantized_empty

BLOCK = 128  # the fp8-block scale granularity along K (and along N for weights)
FP8_MAX = 448.0
MAX_SPLIT_TILES = 65535  # a K-split launch is one cluster per tile, the tiles along grid z (its limit)
_GELU_C = 2.0 * math.sqrt(2.0 / math.pi)  # gelu_tanh(x) = x * sigmoid(_GELU_C * (x + 0.044715 x^3))


@dataclass(frozen=True)
class TileConfig:
    """CTA tile and cluster shape: ``tile_m`` in {64, 128} (one consumer warpgroup per 64 rows),
    ``tile_n`` in {64, 128, 192} (192: a tile spans two weight-scale blocks, and three 96-column
    accumulators would not fit in registers, so no overlap); clusters of at most 2 CTAs multicast
    the shared operand. ``splits`` > 1: each tile's K is split over a cluster of that many CTAs
    (``K/128`` must divide by it; no multicast, raster 1, ``tile_n <= 128``)."""

    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    overlap: bool = True  # two temporaries: the next 128-K block's WGMMAs overlap this one's promotion (K/128 % unroll == 0)
    unroll: int = 8  # k-tiles per straight-line group of the overlapped mainloop (each group ends in wait_group(0))
    raster: int = 1  # tile order: groups of `raster` N-clusters walked M-tile by M-tile (1: all M, then the next N)
    defer_epilogue: bool = True  # a tile's epilogue runs once the next tile's first k-tiles are issued
    act_tanh: bool = True  # SiLU / GELU-tanh as h + h·tanh.approx(z/2), h = x/2 (one MUFU op; False: ex2 + rcp)
    early_bias: bool = True  # a tile's bf16 bias is loaded into registers as its mainloop starts (False: in its epilogue)
    splits: int = 1  # K-splits of a tile, meeting in a thread-block cluster (1: none)
    pdl: bool = False  # programmatic dependent launch: the first tile's weights load before the previous kernel ends

    @property
    def consumer_warpgroups(self) -> int:
        """Consumer warpgroups per CTA, each owning a ``64 x tile_n`` sub-tile."""
        return self.tile_m // 64

    def check(self, epilogue: Epilogue) -> None:
        """Raise ValueError if this tile cannot run ``epilogue``."""
        if self.tile_m not in (64, 128) or self.tile_n not in (64, 128, 192):
            raise ValueError(f"unsupported tile {self.tile_m}x{self.tile_n}")
        if self.tile_n == 192 and self.overlap:
            raise ValueError("tile_n = 192 needs overlap=False (two 96-column temporaries exceed the register budget)")
        if self.cluster_m * self.cluster_n > 2 or min(self.cluster_m, self.cluster_n) < 1:
            raise ValueError(f"unsupported cluster {self.cluster_m}x{self.cluster_n}")
        if self.unroll not in (2, 4, 8, 16):
            raise ValueError(f"unroll must be 2, 4, 8 or 16 k-tiles, got {self.unroll}")
        if self.raster < 1:
            raise ValueError(f"raster group must be >= 1, got {self.raster}")
        if self.splits != 1 and not (2 <= self.splits <= 8 and self.cluster_m * self.cluster_n == 1
                                     and self.raster == 1 and self.tile_n <= 128):
            raise ValueError(f"{self}: K-splits need 2..8 splits, no multicast cluster, raster 1 and tile_n <= 128")
        if epilogue.activation == "swiglu" and self.tile_n != 2 * SWIGLU_GROUP:
            raise ValueError("swiglu needs a tile holding a full gate/up group pair (tile_n = 128)")
        out_cols = self.tile_n // (2 if epilogue.activation == "swiglu" else 1)
        if epilogue.requant is not None and (epilogue.requant != "fp8-block" or out_cols != BLOCK):
            raise ValueError("requant supports fp8-block with 128 output columns per tile (tile_n = 128, no swiglu)")


def scales_for_tma(x_scale):
    """``x_scale[M, KB]`` (FP32, any strides) as the M-major ``[M, KB]`` view of a
    ``[KB, roundup(M, 4)]`` buffer, the layout the kernel's TMA reads; no copy if it already is."""
    m, kb = x_scale.shape
    m4 = -(-m // 4) * 4
    if x_scale.stride(0) == 1 and x_scale.stride(1) == m4 and x_scale.dtype == torch.float32:
        return x_scale
    buf = torch.zeros(kb, m4, dtype=torch.float32, device=x_scale.device)
    buf[:, :m] = x_scale.t()
    return buf[:, :m].t()


class Fp8BlockGemmSm90:
    """The kernel for one (tile config, epilogue, output dtype); call through ``cute.compile``."""

    def __init__(self, config: TileConfig, epilogue: Epilogue, max_active_clusters: int, bias_dtype=cutlass.BFloat16):
        config.check(epilogue)
        self.bias_dtype = bias_dtype
        self.cfg = config
        self.epi = epilogue
        self.max_active_clusters = max_active_clusters
        self.swiglu = epilogue.activation == "swiglu"
        self.requant = epilogue.requant is not None
        self.acc_dtype = cutlass.Float32
        self.out_dtype = cutlass.Float8E4M3FN if self.requant else cutlass.BFloat16
        self.tile_mnk = (config.tile_m, config.tile_n, BLOCK)
        self.out_tile_n = config.tile_n // 2 if self.swiglu else config.tile_n
        self.cluster_mn = (config.cluster_m, config.cluster_n)  # the multicast cluster
        self.splits = config.splits
        self.launch_cluster = (1, config.splits, 1) if config.splits > 1 else (*self.cluster_mn, 1)
        self.atom_layout_mnk = (config.tile_m // 64, 1, 1)
        self.num_consumers = config.consumer_warpgroups
        self.threads_per_cta = 128 * (1 + self.num_consumers)
        self.num_mma_threads = 128 * self.num_consumers
        self.producer_regs = 40
        self.consumer_regs = 232
        self.smem_capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_90")
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

    # ---------------------------------------------------------------- host side (traced once)
    @cute.jit
    def __call__(
        self,
        a_ptr: cutlass.Int64,  # x        [x_rows, K]     fp8, row-major (rows past M: whole token tiles, unread output)
        b_ptr: cutlass.Int64,  # w        [N', K]         fp8, row-major
        sa_ptr: cutlass.Int64,  # x_scale [x_rows, K/128] fp32, M-major with leading dim roundup(x_rows, 4)
        sb_ptr: cutlass.Int64,  # w_scale [ceil(N'/128), K/128] fp32, row-major
        d_ptr: cutlass.Int64,  # out      [M, N]          bf16 (fp8 with requant), row-major
        bias_ptr: cutlass.Int64,  # bias  [N']            bias_dtype (0 if unused)
        res_ptr: cutlass.Int64,  # residual [M, N]        bf16 (0 if unused)
        ds_ptr: cutlass.Int64,  # requant scales [M, N/128] fp32, M-major like x_scale (0 if unused)
        m: cutlass.Int32,
        x_rows: cutlass.Int32,  # rows of x and x_scale the TMA loads may read (>= m)
        n: cutlass.Int32,  # N' (weight rows)
        k: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        gmem = cute.AddressSpace.gmem
        k = cute.assume(k, divby=BLOCK)
        n = cute.assume(n, divby=64)
        kb = k // BLOCK
        m4 = (m + 3) // 4 * 4
        x_rows4 = (x_rows + 3) // 4 * 4
        n_out = n // 2 if self.swiglu else n
        fp8 = cutlass.Float8E4M3FN
        mA = cute.make_tensor(cute.make_ptr(fp8, a_ptr, gmem, assumed_align=16), cute.make_layout((x_rows, k), stride=(k, 1)))
        mB = cute.make_tensor(cute.make_ptr(fp8, b_ptr, gmem, assumed_align=16), cute.make_layout((n, k), stride=(k, 1)))
        mSA = cute.make_tensor(cute.make_ptr(cutlass.Float32, sa_ptr, gmem, assumed_align=16), cute.make_layout((x_rows, kb), stride=(1, x_rows4)))
        mSB = cute.make_tensor(
            cute.make_ptr(cutlass.Float32, sb_ptr, gmem, assumed_align=4), cute.make_layout(((n + BLOCK - 1) // BLOCK, kb), stride=(kb, 1))
        )
        mD = cute.make_tensor(cute.make_ptr(self.out_dtype, d_ptr, gmem, assumed_align=16), cute.make_layout((m, n_out), stride=(n_out, 1)))
        mBias = None
        if cutlass.const_expr(self.epi.bias):
            mBias = cute.make_tensor(cute.make_ptr(self.bias_dtype, bias_ptr, gmem, assumed_align=16), cute.make_layout((n,)))
        mRes = None
        if cutlass.const_expr(self.epi.residual):
            mRes = cute.make_tensor(
                cute.make_ptr(cutlass.BFloat16, res_ptr, gmem, assumed_align=16), cute.make_layout((m, n_out), stride=(n_out, 1))
            )
        mDS = None
        if cutlass.const_expr(self.requant):
            mDS = cute.make_tensor(
                cute.make_ptr(cutlass.Float32, ds_ptr, gmem, assumed_align=16), cute.make_layout((m, n_out // BLOCK), stride=(1, m4))
            )
        self.ab_dtype = fp8
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.cfg.tile_n),
        )
        # The epilogue's register layout: the same warpgroup arrangement over the output tile.
        self.tiled_mma_out = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, self.out_tile_n),
        )
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        self.mcast_a = self.cluster_mn[1]
        self.mcast_b = self.cluster_mn[0]
        out_tile = (self.cfg.tile_m, self.out_tile_n)
        # The whole output tile in smem: bf16 as (tile_m x 32)-column sub-tiles, FP8 (requant) as one
        # (tile_m x 128-byte) tile; each sub-tile spans every consumer warpgroup's rows.
        self.epi_tile = (self.cfg.tile_m, self.out_tile_n if self.requant else 32)
        self.epi_stage = self.out_tile_n // self.epi_tile[1]
        self._make_smem_layouts()
        if cutlass.const_expr(self.splits > 1 and cute.cosize(self.a_smem_staged) < self.cfg.tile_m * self.cfg.tile_n * 4):
            raise ValueError(f"{self.cfg}: the FP32 partial tile does not fit the A stages")

        tma_a, tA = self._tma_load(mA, self.a_smem_staged, (self.cfg.tile_m, BLOCK), self.mcast_a)
        tma_b, tB = self._tma_load(mB, self.b_smem_staged, (self.cfg.tile_n, BLOCK), self.mcast_b)
        tma_sa, tSA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mSA,
            cute.slice_(self.sa_smem_staged, (None, None, 0)), (self.cfg.tile_m, 1),
        )
        tma_d, tD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD,
            cute.slice_(self.epi_smem_staged, (None, None, 0)), self.epi_tile,
        )
        num_tiles = cute.zipped_divide(mD, tiler=out_tile)[(0, (None, None))].shape
        # raster > 1 rounds the N-cluster count up to a multiple of it: the kernel skips those clusters.
        if cutlass.const_expr(self.splits > 1):  # a cluster per tile: tile index n * splits + split along N
            sched = utils.PersistentTileSchedulerParams((num_tiles[0], num_tiles[1] * self.splits, 1), self.launch_cluster, 1, True)
        else:
            sched = utils.PersistentTileSchedulerParams((*num_tiles, 1), (*self.cluster_mn, 1), self.cfg.raster, True)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, self.max_active_clusters)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)], 1024]
            sSA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(self.sa_smem_staged)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(self.epi_smem_staged)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, tA, tma_b, tB, tma_sa, tSA, tma_d, tD, mSB, mD, mBias, mRes, mDS, sched,
            self.tiled_mma, self.tiled_mma_out, self.cta_layout_mnk,
            self.a_smem_staged, self.b_smem_staged, self.sa_smem_staged, self.epi_smem_staged,
        ).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=self.launch_cluster,
            min_blocks_per_mp=1, stream=stream, use_pdl=self.cfg.pdl,
        )

    def _make_smem_layouts(self) -> None:
        bytes_ab = (self.cfg.tile_m + self.cfg.tile_n) * BLOCK + self.cfg.tile_m * 4
        bytes_epi = self.epi_tile[0] * self.epi_tile[1] * self.out_dtype.width // 8 * self.epi_stage
        self.ab_stage = min(8, (self.smem_capacity - 2048 - bytes_epi) // bytes_ab)

        def staged(rows: int, dtype, major_size: int, shape, order):
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dtype, major_size), dtype
            )
            return cute.tile_to_shape(atom, shape, order=order)

        self.a_smem_staged = staged(self.cfg.tile_m, self.ab_dtype, BLOCK, (self.cfg.tile_m, BLOCK, self.ab_stage), (0, 1, 2))
        self.b_smem_staged = staged(self.cfg.tile_n, self.ab_dtype, BLOCK, (self.cfg.tile_n, BLOCK, self.ab_stage), (0, 1, 2))
        self.sa_smem_staged = cute.make_layout((self.cfg.tile_m, 1, self.ab_stage), stride=(1, 0, self.cfg.tile_m))
        self.epi_smem_staged = staged(
            self.epi_tile[0], self.out_dtype, self.epi_tile[1], (*self.epi_tile, self.epi_stage), (0, 1, 2)
        )

    @staticmethod
    def _tma_load(tensor, smem_staged, tile, mcast: int):
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1 else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=mcast
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom, mA: cute.Tensor,
        tma_b: cute.CopyAtom, mB: cute.Tensor,
        tma_sa: cute.CopyAtom, mSA: cute.Tensor,
        tma_d: cute.CopyAtom | None, mD_tma: cute.Tensor | None,
        mSB: cute.Tensor, mD: cute.Tensor,
        mBias: cute.Tensor | None, mRes: cute.Tensor | None, mDS: cute.Tensor | None,
        sched_params: utils.PersistentTileSchedulerParams,
        tiled_mma: cute.TiledMma, tiled_mma_out: cute.TiledMma, cta_layout_mnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
        sa_smem_staged: cute.Layout, epi_smem_staged: cute.ComposedLayout | None,
    ):
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel may launch once every CTA is here
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_sa)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

        cta_rank = 0  # a K-split cluster's CTAs share no operand: each is its own multicast "cluster"
        if cutlass.const_expr(self.splits == 1):
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1) if self.mcast_a > 1 else 0
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0) if self.mcast_b > 1 else 0

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        stage_bytes = (
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_staged, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
            + self.cfg.tile_m * 4
        )
        mcast_size = self.mcast_a + self.mcast_b - 1
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast_size * self.num_consumers * 4),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sSA = storage.sSA.get_tensor(sa_smem_staged)
        sD = storage.sD.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        gD = cute.local_tile(mD_tma, (self.cfg.tile_m, self.out_tile_n), (None, None))

        # (bM, bK, RestM, RestK) etc.
        gA = cute.local_tile(mA, (self.cfg.tile_m, BLOCK), (None, None))
        gB = cute.local_tile(mB, (self.cfg.tile_n, BLOCK), (None, None))
        gSA = cute.local_tile(mSA, (self.cfg.tile_m, 1), (None, None))

        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cluster_coord[1], a_cta_layout, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], b_cta_layout, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
            tma_sa, 0, cute.make_layout(1), cute.group_modes(sSA, 0, 2), cute.group_modes(gSA, 0, 2)
        )
        k_tiles = cute.size(gA, mode=[3])
        n_tiles = cute.size(gB, mode=[2])
        part = None  # K-splits: where a CTA's FP32 partial tile goes, over its A stages
        if cutlass.const_expr(self.splits > 1):
            part = cute.recast_ptr(storage.sA.data_ptr(), dtype=self.acc_dtype)

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._producer(
                    ab_pipe, sched_params, k_tiles, n_tiles, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask,
                    tma_sa, tSgS, tSsS,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consumer(
                tiled_mma, tiled_mma_out, ab_pipe, sched_params, k_tiles, n_tiles, tidx - 128, warp_idx, sA, sB, sSA, sD, gD,
                tma_d, mSB, mD, mBias, mRes, mDS, part,
            )

    @cute.jit
    def _producer(
        self, ab_pipe, sched_params, k_tiles, n_tiles, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask,
        tma_sa, tSgS, tSsS,
    ):
        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        early = cutlass.Int32(0)  # k-tiles of the first tile already loaded
        if cutlass.const_expr(self.cfg.pdl):
            # The weights do not depend on the previous kernel: fill the first stages with them, wait
            # for it (it may write x), then load those stages' activations and scales.
            tm0, tn_split0, _ = work.tile_idx
            tn0, kt_first0, kts0 = self._split_range(tn_split0, k_tiles)
            if work.is_valid_tile and self._real_tile(tn0, n_tiles):
                early = cutlass.min(kts0, self.ab_stage)
            x_state = state.clone()
            for kt in range(kt_first0, kt_first0 + early):
                ab_pipe.producer_acquire(state)
                cute.copy(tma_b, tBgB[(None, tn0, kt)], tBsB[(None, state.index)], tma_bar_ptr=ab_pipe.producer_get_barrier(state),
                          mcast_mask=b_mask)
                state.advance()
            cute.arch.griddepcontrol_wait()
            for kt in range(kt_first0, kt_first0 + early):
                bar = ab_pipe.producer_get_barrier(x_state)
                cute.copy(tma_a, tAgA[(None, tm0, kt)], tAsA[(None, x_state.index)], tma_bar_ptr=bar, mcast_mask=a_mask)
                cute.copy(tma_sa, tSgS[(None, tm0, kt)], tSsS[(None, x_state.index)], tma_bar_ptr=bar)
                x_state.advance()
        while work.is_valid_tile:
            tm, tn_split, _ = work.tile_idx
            tn, kt_first, kts = self._split_range(tn_split, k_tiles)
            if self._real_tile(tn, n_tiles):
                for kt in range(kt_first + early, kt_first + kts):
                    ab_pipe.producer_acquire(state)
                    bar = ab_pipe.producer_get_barrier(state)
                    cute.copy(tma_a, tAgA[(None, tm, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar, mcast_mask=a_mask)
                    cute.copy(tma_b, tBgB[(None, tn, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar, mcast_mask=b_mask)
                    cute.copy(tma_sa, tSgS[(None, tm, kt)], tSsS[(None, state.index)], tma_bar_ptr=bar)
                    ab_pipe.producer_commit(state)
                    state.advance()
            early = cutlass.Int32(0)
            sched.advance_to_next_work()
            work = sched.get_current_work()
        ab_pipe.producer_tail(state)

    @cute.jit
    def _consumer(
        self, tiled_mma, tiled_mma_out, ab_pipe, sched_params, k_tiles, n_tiles, ctid, warp_idx, sA, sB, sSA, sD, gD, tma_d, mSB, mD,
        mBias, mRes, mDS, part,
    ):
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # before any output store (the previous kernel may still read it)
        wg = ctid // 128
        thr_mma_wg = tiled_mma.get_slice(wg * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
        k_blocks = cute.size(tCrA, mode=[2])

        # Per-thread accumulators and the coordinates (within the tile) of each of their elements.
        thr_mma = tiled_mma.get_slice(ctid)
        tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))
        acc = cute.make_rmem_tensor(tCcAcc.shape, self.acc_dtype)
        tmp = cute.make_rmem_tensor(tCcAcc.shape, self.acc_dtype)
        tmp2 = cute.make_rmem_tensor(tCcAcc.shape, self.acc_dtype) if self.cfg.overlap else tmp
        # Element ((c, h, j), 0, 0) of a 64-row WGMMA accumulator lies in row group h (rows r, r + 8).
        row_lo = tCcAcc[((0, 0, 0), 0, 0)][0]
        row_hi = tCcAcc[((0, 1, 0), 0, 0)][0]
        n_frag = cute.size(acc, mode=[0]) // 4

        thr_mma_out = tiled_mma_out.get_slice(ctid)
        tCcOut = thr_mma_out.partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.out_tile_n)))
        out = acc
        if cutlass.const_expr(self.swiglu):
            out = cute.make_rmem_tensor(tCcOut.shape, self.acc_dtype)

        # Output: registers -> smem -> gmem by TMA, the whole tile per store group (bf16 through stmatrix
        # in 32-column sub-tiles, FP8 by column pairs at their coordinates). A tile's epilogue runs once
        # the next tile's first k-tiles are issued, so it overlaps their WGMMAs (the last tile's after the loop).
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=1, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
        )
        r2s = None
        if cutlass.const_expr(not self.requant):
            copy_r2s = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.out_dtype)
            tiled_copy_r2s = cute.make_tiled_copy_S(copy_r2s, cute.make_tiled_copy_C_atom(copy_r2s, tiled_mma_out))
            thr_r2s = tiled_copy_r2s.get_slice(ctid)
            r2s = (tiled_copy_r2s, thr_r2s.partition_D(sD), tiled_copy_r2s.retile(out), cute.shape(thr_r2s.partition_S(sD))[:3])
        # early_bias: the current tile's bias, one bf16x2 register per fragment block (an FP32 bias would
        # take 32 registers and spill: it is loaded in the epilogue).
        bias_frag = None
        if cutlass.const_expr(self.epi.bias and self.cfg.early_bias and self.bias_dtype == cutlass.BFloat16):
            bias_frag = cute.make_rmem_tensor(cute.make_layout((2, n_frag)), self.bias_dtype)
        epi = (out, tCcAcc, tCcOut, n_frag, mD.shape[0], mBias, bias_frag, mRes, mDS, sD, gD, tma_d, store_pipe, r2s, warp_idx)

        sched = utils.StaticPersistentTileScheduler.create(sched_params, cute.arch.block_idx(), cute.arch.grid_dim())
        work = sched.initial_work_tile_info()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        tiles_done = cutlass.Int32(0)
        prev_tm = cutlass.Int32(0)  # the tile whose epilogue is pending
        prev_tn = cutlass.Int32(0)
        bufs = (tmp, tmp2)
        unroll = self.cfg.unroll if self.cfg.overlap else 1
        while work.is_valid_tile:
            tm, tn_split, _ = work.tile_idx
            tn, kt_first, kts = self._split_range(tn_split, k_tiles)
            if self._real_tile(tn, n_tiles):
                seg_blocks = self._segment_blocks(tn, mSB.shape[0])
                read = state.clone()
                ops = (tCrA, tCrB, k_blocks, ab_pipe, sSA, mSB, seg_blocks, row_lo, row_hi, n_frag, acc, bufs)
                pend = (self.cfg.defer_epilogue, tiles_done, prev_tm, prev_tn, tn, epi)  # the previous tile's epilogue
                # Straight-line groups of `unroll` k-tiles, each ending in wait_group(0): ptxas serializes
                # WGMMA (C7514) when an accumulator group stays in flight across a loop back-edge. Needs
                # K/128 % unroll == 0 (the host falls back to smaller groups, else to no overlap).
                tiled_mma, state, read = self._group(tiled_mma, state, read, kt_first, unroll, ops, pend)
                for kt0 in range(kt_first + unroll, kt_first + kts, unroll):
                    tiled_mma, state, read = self._group(tiled_mma, state, read, kt0, unroll, ops)
                if cutlass.const_expr(not self.cfg.defer_epilogue and self.splits == 1):
                    self._finish_tile(acc, tm, tn, *epi)
                prev_tm = tm
                prev_tn = tn
                tiles_done += 1
            sched.advance_to_next_work()
            work = sched.get_current_work()
        if cutlass.const_expr(self.splits > 1):  # one tile per CTA: its splits meet, split 0 finishes it
            _, split, _ = cute.arch.block_idx()
            acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(cute.size(acc)))
            if split_k.dsl_cluster().cluster_sum(acc_flat, part, split, self.splits, ctid, self.num_mma_threads,
                                                 self.epi_barrier.arrive_and_wait) != 0:
                self._finish_tile(acc, prev_tm, prev_tn, *epi)
            cute.arch.cluster_wait()  # split 0 has read the peers' partials: their shared memory may go
        elif cutlass.const_expr(self.cfg.defer_epilogue):
            if tiles_done > 0:
                self._finish_tile(acc, prev_tm, prev_tn, *epi)
        store_pipe.producer_tail()

    @cute.jit
    def _group(self, tiled_mma, state, read, kt0, length: cutlass.Constexpr[int], ops, pending=None):
        """Mainloop k-tiles ``kt0 .. kt0 + length - 1`` in straight-line code: each k-tile's promotion
        overlaps the next one's WGMMAs (two temporaries), the last is waited for with
        wait_group(0). The first group of a tile (``pending`` given) initialises ``acc`` and runs the
        previous tile's deferred epilogue once its first k-tiles are issued. Returns the rebound
        ``tiled_mma`` and the consumer / read pipeline states (advanced in place, but the caller must
        rebind them: CuTeDSL carries a dynamic loop's state only through assignments)."""
        tCrA, tCrB, k_blocks, ab_pipe, sSA, mSB, seg_blocks, row_lo, row_hi, n_frag, acc, bufs = ops
        s_lo = [None] * length
        s_hi = [None] * length
        for u in cutlass.range_constexpr(length + 1):
            if cutlass.const_expr(u < length):
                tiled_mma, s_lo[u], s_hi[u] = self._issue_k_tile(
                    tiled_mma, bufs[u % 2], tCrA, tCrB, k_blocks, ab_pipe, read, kt0 + u, sSA, mSB, seg_blocks, row_lo, row_hi)
                read.advance()
            if cutlass.const_expr(pending is not None and u == min(2, length) - 1):
                deferred, tiles_done, prev_tm, prev_tn, tn, epi = pending
                if cutlass.const_expr(deferred):
                    if tiles_done > 0:
                        self._finish_tile(acc, prev_tm, prev_tn, *epi)
                _, tCcAcc, _, _, _, mBias, bias_frag, *_ = epi
                if cutlass.const_expr(bias_frag is not None):
                    self._load_bias(bias_frag, tn, mBias, tCcAcc, n_frag)
            if cutlass.const_expr(u > 0):
                cute.nvgpu.warpgroup.wait_group(1 if u < length else 0)
                ab_pipe.consumer_release(state)
                state.advance()
                self._promote(acc, bufs[(u - 1) % 2], s_lo[u - 1], s_hi[u - 1], n_frag, init=pending is not None and u == 1)
        return tiled_mma, state, read

    @cute.jit
    def _issue_k_tile(self, tiled_mma, tmp, tCrA, tCrB, k_blocks, ab_pipe, read, kt, sSA, mSB, seg_blocks, row_lo, row_hi):
        """Wait for k-tile ``kt`` in stage ``read``, WGMMA it into ``tmp``; returns ``tiled_mma`` and
        the promotion scales (x scale of rows r / r + 8 times each segment's weight scale)."""
        w_scales = [mSB[b, kt] for b in seg_blocks]
        ab_pipe.consumer_wait(read)
        tiled_mma = self._issue(tiled_mma, tmp, tCrA, tCrB, read.index, k_blocks)
        s_lo = [sSA[(row_lo, 0, read.index)] * w for w in w_scales]
        s_hi = [sSA[(row_hi, 0, read.index)] * w for w in w_scales]
        return tiled_mma, s_lo, s_hi

    @cute.jit
    def _finish_tile(self, acc, tm, tn, out, tCcAcc, tCcOut, n_frag, m_total, mBias, bias_frag, mRes, mDS, sD, gD, tma_d,
                     store_pipe, r2s, warp_idx):
        """Epilogue of tile (tm, tn): math in registers, the tile into sD, one TMA store group."""
        m0 = tm * self.cfg.tile_m
        self._epilogue_math(acc, out, tCcAcc, tCcOut, n_frag, m0, tn, m_total, mBias, bias_frag, mRes, mDS)
        gD_epi = cute.zipped_divide(gD[(None, None, tm, tn)], self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi)
        epi_tiles = cute.size(gD_epi, mode=[1])
        epi_grid = cute.make_layout(gD_epi.shape[1], stride=(gD_epi.shape[1][1], 1))
        # The previous tile's store must have read sD before anyone overwrites it.
        if warp_idx == 4:
            store_pipe.producer_acquire()
        self.epi_barrier.arrive_and_wait()
        if cutlass.const_expr(self.requant):
            self._store_fp8_smem(out, tCcOut, sD)
        else:
            tiled_copy_r2s, tRS_sD, tRS_rOut, rD_shape = r2s
            tRS_rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
            tRS_rD_out = cute.make_rmem_tensor(rD_shape, self.out_dtype)
            size_rD = cute.size(tRS_rD)
            for e in cutlass.range_constexpr(epi_tiles):
                for v in cutlass.range_constexpr(size_rD):
                    tRS_rD[v] = tRS_rOut[e * size_rD + v]
                tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
                cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, e)])
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()
        if warp_idx == 4:
            for e in cutlass.range_constexpr(epi_tiles):
                cute.copy(tma_d, bSG_sD[(None, e)], bSG_gD[(None, epi_grid.get_hier_coord(e))])
            store_pipe.producer_commit()

    def _split_range(self, tn_split, k_tiles):
        """(N-tile, first k-tile, k-tiles) of the scheduler's tile column ``tn_split``: with K-splits
        it is ``tn * splits + split``, and split ``s`` takes k-tiles ``s * k_tiles / splits`` on."""
        if self.splits == 1:
            return tn_split, 0, k_tiles
        kts = k_tiles // self.splits
        return tn_split // self.splits, tn_split % self.splits * kts, kts

    def _real_tile(self, tn, n_tiles):
        """False for the N-clusters past ``N`` that a raster group > 1 adds (whole clusters only, so
        multicast peers agree)."""
        return tn - tn % self.cfg.cluster_n < n_tiles

    @cute.jit
    def _store_fp8_smem(self, out, tCcOut, sD):
        """Requant output into the (swizzled) FP8 tile buffer: each thread's adjacent column pairs
        at their tile coordinates (2-byte stores; the swizzle keeps a pair contiguous)."""
        pairs = cute.zipped_divide(sD[(None, None, 0)], (1, 2))
        pair = cute.make_rmem_tensor(cute.make_layout((1, 2)), cutlass.Float32)
        for j in cutlass.range_constexpr(cute.size(out, mode=[0]) // 4):
            for h in cutlass.range_constexpr(2):
                coord = tCcOut[((0, h, j), 0, 0)]
                pair[0, 0] = out[((0, h, j), 0, 0)]
                pair[0, 1] = out[((1, h, j), 0, 0)]
                pairs[(None, (coord[0], coord[1] // 2))].store(pair.load().to(cutlass.Float8E4M3FN))

    @cute.jit
    def _issue(self, tiled_mma, tmp, tCrA, tCrB, stage, k_blocks):
        """WGMMA one 128-K block from smem ``stage`` into the (zeroed) temporary ``tmp``; commits.
        Returns ``tiled_mma``, whose ACCUMULATE field it changed."""
        cute.nvgpu.warpgroup.fence()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, tmp, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], tmp)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        return tiled_mma  # rebound by the caller so loops carry it

    def _segment_blocks(self, tn, num_blocks):
        """Weight-scale block row of each 64-column segment of N-tile ``tn``: one block for
        ``tile_n <= 128``; for 192, segments 0 and 2 lie in blocks ``3tn/2`` and ``3tn/2 + 1`` and
        segment 1 in the first if ``tn`` is even, else in the second (clamped to the last block)."""
        if cutlass.const_expr(self.cfg.tile_n <= BLOCK):
            return [tn * self.cfg.tile_n // BLOCK]
        first = tn * 3 // 2
        second = cutlass.min(first + 1, num_blocks - 1)
        return [first, cutlass.min(first + tn % 2, num_blocks - 1), second]

    @cute.jit
    def _promote(self, acc, tmp, s_lo, s_hi, n_frag, init: cutlass.Constexpr[bool] = False):
        """``acc += tmp * scale`` (``acc = tmp * scale`` if ``init``) with the scale of each element's
        row group (rows r, r + 8; lists ``s_lo``, ``s_hi``) and 64-column segment (fragment block
        ``j`` covers columns ``8j .. 8j+7``; one list entry serves the whole tile)."""
        for j in cutlass.range_constexpr(n_frag):
            seg = min(j // 8, len(s_lo) - 1)
            for c in cutlass.range_constexpr(2):
                for h, s in ((0, s_lo[seg]), (1, s_hi[seg])):
                    if cutlass.const_expr(init):
                        acc[((c, h, j), 0, 0)] = tmp[((c, h, j), 0, 0)] * s
                    else:
                        acc[((c, h, j), 0, 0)] = acc[((c, h, j), 0, 0)] + tmp[((c, h, j), 0, 0)] * s

    @cute.jit
    def _load_bias(self, bias_frag, tn, mBias, tCcAcc, n_frag):
        """``bias_frag[:, j]``: the bias of the column pair of this thread's fragment block ``j`` in
        N-tile ``tn`` (left unset past ``N'``; the epilogue skips those)."""
        n0 = tn * self.cfg.tile_n
        bias_pairs = cute.zipped_divide(mBias, (2,))  # columns (2p, 2p + 1) of a thread are adjacent
        for j in cutlass.range_constexpr(n_frag):
            n = n0 + tCcAcc[((0, 0, j), 0, 0)][1]
            if n < mBias.shape[0]:
                pair = bias_pairs[(None, n // 2)].load()
                for c in cutlass.range_constexpr(2):
                    bias_frag[c, j] = pair[c]

    @cute.jit
    def _epilogue_math(self, acc, out, tCcAcc, tCcOut, n_frag, m0, tn, m_total, mBias, bias_frag, mRes, mDS):
        """In registers: bias (from ``bias_frag`` if loaded early), activation (SwiGLU writes ``out``),
        residual, requant (FP32 in/out)."""
        n0 = tn * self.cfg.tile_n
        if cutlass.const_expr(self.epi.bias):
            bias_pairs = cute.zipped_divide(mBias, (2,))  # columns (2p, 2p + 1) of a thread are adjacent
            for j in cutlass.range_constexpr(n_frag):
                n = n0 + tCcAcc[((0, 0, j), 0, 0)][1]
                if n < mBias.shape[0]:
                    if cutlass.const_expr(bias_frag is not None):
                        b = bias_frag[(None, j)].load().to(cutlass.Float32)
                    else:  # loaded here, not through _load_bias: a register copy spills an FP32 bias
                        b = bias_pairs[(None, n // 2)].load().to(cutlass.Float32)
                    for h in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(2):
                            acc[((c, h, j), 0, 0)] = acc[((c, h, j), 0, 0)] + b[c]
        act = self.epi.activation
        if cutlass.const_expr(act in ("relu", "silu", "gelu_tanh")):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = self._activate(acc[i], act)
        if cutlass.const_expr(act == "swiglu"):
            half = n_frag // 2  # columns j and j + 64 of a warpgroup sit in fragment blocks j, j + half
            for j in cutlass.range_constexpr(half):
                for h in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(2):
                        g = acc[((c, h, j), 0, 0)]
                        u = acc[((c, h, j + half), 0, 0)]
                        out[((c, h, j), 0, 0)] = self._activate(g, "silu") * u
        if cutlass.const_expr(self.epi.residual):
            out_n0 = tn * self.out_tile_n
            res_pairs = cute.zipped_divide(mRes, (1, 2))  # a thread's columns (2p, 2p + 1) are adjacent
            for j in cutlass.range_constexpr(cute.size(out, mode=[0]) // 4):
                for h in cutlass.range_constexpr(2):
                    coord = tCcOut[((0, h, j), 0, 0)]
                    m = m0 + coord[0]
                    if m < m_total and out_n0 + coord[1] < mRes.shape[1]:  # a tile may reach past N
                        r = res_pairs[(None, (m, (out_n0 + coord[1]) // 2))].load().to(cutlass.Float32)
                        for c in cutlass.range_constexpr(2):
                            out[((c, h, j), 0, 0)] = out[((c, h, j), 0, 0)] + r[c]
        if cutlass.const_expr(self.requant):
            self._requant(out, tCcOut, n_frag, m0, tn, m_total, mDS)

    @cute.jit
    def _activate(self, x, act: cutlass.Constexpr[str]):
        """Elementwise ``act`` (identity, relu, silu, gelu_tanh) of the FP32 scalar ``x``."""
        y = x
        if cutlass.const_expr(act == "relu"):
            y = cute.arch.fmax(x, cutlass.Float32(0.0))
        if cutlass.const_expr(act in ("silu", "gelu_tanh")):
            z = x
            if cutlass.const_expr(act == "gelu_tanh"):
                z = _GELU_C * (x + 0.044715 * x * x * x)
            if cutlass.const_expr(self.cfg.act_tanh):  # x·σ(z) = h + h·tanh(z/2), h = x/2
                h = x * 0.5
                y = h + h * cute.math.tanh(z * 0.5, approx=True)
            else:
                y = x * cute.arch.rcp_approx(1.0 + cute.math.exp(-z))
        return y

    @cute.jit
    def _requant(self, out, tCcOut, n_frag, m0, tn, m_total, mDS):
        """fp8-block requant of each row's 128 columns ``v`` (the FP32 epilogue output):
        ``s = amax(bf16(v)) / 448`` (1 if 0) exactly, taken as ``bf16(amax |v|)`` (bf16 rounding is
        monotonic), and ``out = v * (1 / s)``, saturated by the E4M3 conversion. Against the
        reference ``bf16(v) / s`` that is two relative perturbations below 2^-8, so within one FP8 ulp."""
        for h in cutlass.range_constexpr(2):
            amax = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(n_frag):
                for c in cutlass.range_constexpr(2):
                    v = out[((c, h, j), 0, 0)]
                    amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
            for lane_bit in cutlass.range_constexpr(2):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << lane_bit))
            scale, inv_scale = _fp8_group_scale(amax.to(cutlass.BFloat16).to(cutlass.Float32))
            for j in cutlass.range_constexpr(n_frag):
                for c in cutlass.range_constexpr(2):
                    out[((c, h, j), 0, 0)] = out[((c, h, j), 0, 0)] * inv_scale
            coord = tCcOut[((0, h, 0), 0, 0)]
            m = m0 + coord[0]
            if cute.arch.lane_idx() % 4 == 0 and m < m_total:
                mDS[m, (tn * self.out_tile_n + coord[1]) // BLOCK] = scale


class Fp8BlockLinearSm90:
    """fp8-block linear of bf16 activations from one host call: :class:`.act_quant.ActQuantSm90`
    quantizes ``x`` into tile-high FP8 operands, then ``gemm`` (a :class:`Fp8BlockGemmSm90`) runs on
    them. Both launches are traced into one host function, so a linear costs one executor call
    (~20 µs of host time with tvm-ffi, H100) instead of two; the kernels are unchanged. Call
    through ``cute.compile``."""

    def __init__(self, gemm: Fp8BlockGemmSm90):
        self.quant = ActQuantSm90(rmsnorm=False, pdl=gemm.cfg.pdl)
        self.gemm = gemm

    @cute.jit
    def __call__(
        self,
        x_ptr: cutlass.Int64,  # x       [M, K]            bf16, row-major
        q_ptr: cutlass.Int64,  # quantized x [x_rows, K]   fp8 (written: M rows)
        sa_ptr: cutlass.Int64,  # its scales [x_rows, K/128] fp32, M-major with leading dim roundup(x_rows, 4)
        b_ptr: cutlass.Int64,  # w       [N', K]           fp8
        sb_ptr: cutlass.Int64,  # w_scale [ceil(N'/128), K/128] fp32
        d_ptr: cutlass.Int64,  # out     [M, N]            bf16
        bias_ptr: cutlass.Int64,
        res_ptr: cutlass.Int64,
        m: cutlass.Int32,
        x_rows: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        span: cutlass.Int32,  # act_quant's groups per CTA (act_quant.groups_per_cta)
        stream: cuda.CUstream,
    ):
        self.quant(x_ptr, cutlass.Int64(0), q_ptr, sa_ptr, m, (x_rows + 3) // 4 * 4, k, span, cutlass.Float32(0.0), stream)
        self.gemm(q_ptr, b_ptr, sa_ptr, sb_ptr, d_ptr, bias_ptr, res_ptr, cutlass.Int64(0), m, x_rows, n, k, stream)


@cute.jit
def _fp8_group_scale(amax):
    """fp8-block scale of a group with absolute maximum ``amax``: ``(s, 1/s)``, ``s = amax/448``
    (``s = 1`` for an all-zero group)."""
    scale = amax / FP8_MAX
    if amax == 0.0:
        scale = cutlass.Float32(1.0)
    return scale, 1.0 / scale


# ==================================================================== host side
# Measured dispatch (H200, benchmarks/gemm_fp8_block.py --tune / --tune-rows; benchmarks/notes/fp8_block.md):
# the fastest of the candidate tiles at M = 1, 16, 64, 128, 512, 4096 (8192 for 8192x8192), used for
# M up to that bucket.
_M_BUCKETS = (1, 16, 64, 128, 512, 1 << 31)
_S, _W = TileConfig(64, 64), TileConfig(64, 128)  # small-M tiles
# The 128x128 large-M tiles run each tile's epilogue right after its mainloop: the deferred epilogue
# was 0-8 % slower for the bare GEMM at M=4096 and no faster with bias+SiLU+requant (H200 A/B,
# benchmarks/NOTES.md session 4); the 192-column tile keeps it (up to 3 % faster there).
# 16-k-tile groups: 0.8-1.9 % faster than 8 on the 128x128 rows where K/128 divides by 16 (session 12).
_T, _L = TileConfig(128, 64), TileConfig(128, 128, unroll=16, defer_epilogue=False)  # large-M tiles
_WC = TileConfig(64, 128, 1, 2, unroll=4)  # cluster of 2 along N (A multicast); 4-k-tile groups: 7 % faster at M <= 16 on 28672x4096
_LC4 = TileConfig(128, 128, 1, 2, raster=4, unroll=16, defer_epilogue=False)  # A multicast + raster groups
_LC8 = TileConfig(128, 128, 1, 2, raster=8, unroll=16, defer_epilogue=False)
_NB4 = TileConfig(128, 192, 2, 1, overlap=False, raster=4)  # 192-column tiles, B multicast (N = 2112 is 11 of them)
_DISPATCH: dict[tuple[int, int], tuple[tuple[int, TileConfig], ...]] = {
    (n, k): tuple(zip(_M_BUCKETS, cfgs))
    for (n, k), cfgs in {
        (1024, 4096): (_S, _S, _S, _S, _S, TileConfig(128, 128)),
        (2112, 7168): (_S, _S, _S, _S, _T, _NB4),
        (4096, 4096): (_W, _W, _S, _S, _L, _L),
        (4096, 7168): (_W, _W, _S, _S, _L, _LC8),
        (4096, 14336): (_W, _W, _S, _S, _L, _LC4),
        (6144, 4096): (_WC, _W, _S, _T, _L, _NB4),
        (7168, 2048): (_WC, _WC, _S, _T, _L, _L),
        (7168, 16384): (_WC, _WC, TileConfig(64, 64, overlap=False), _T, _L, _LC4),
        (8192, 8192): (_WC, _WC, _S, _T, _L, _LC8),
        (24576, 1536): (_W, _W, _W, _T, _L, _NB4),
        (28672, 4096): (_WC, _WC, _W, _L, _L, _NB4),
    }.items()
}
# For shapes not in the table: the tile with the least summed time over the tuned shapes per bucket.
_DEFAULT: tuple[tuple[int, TileConfig], ...] = tuple(zip(_M_BUCKETS, (_WC, _W, _S, _T, _L, _LC4)))


@functools.lru_cache(maxsize=4096)  # fp8_block_linear asks on every call (its token-tile height)
def pick_config(m: int, n: int, k: int, epilogue: Epilogue = Epilogue(), num_sms: int = 132) -> TileConfig:
    """The tile config the dispatch table gives ``x[m, k] @ w[n, k].T`` with ``epilogue`` on a GPU
    of ``num_sms`` SMs; set to ``tile_n = 128`` where the epilogue needs full 128-column groups
    (swiglu, requant).

    Beyond 16 tokens, a 64x64 grid that fills at most half the SMs with runs of >= 56 k-tiles (a
    multiple of 8) splits K in two, the halves meeting in a 2-CTA cluster (H100, session 33, 3
    interleaved rounds: 2112x7168 at 32-128 tokens 7-9 % faster, 4096x14336 at 64 tokens 5 %,
    4096x7168 at 64 tokens 1 % slower). More splits lose: a cluster launch packs its CTAs into one
    GPC, so at one CTA per SM only ~31 clusters of 4 run at once (33 tiles of 2112x7168 take two
    waves, 30 % slower)."""
    for max_m, cfg in _DISPATCH.get((n, k), _DEFAULT):
        if m <= max_m:
            break
    needs_full_groups = epilogue.activation == "swiglu" or epilogue.requant is not None
    if needs_full_groups and cfg.tile_n != BLOCK:
        cfg = replace(cfg, tile_n=BLOCK, overlap=True)
    # The bias loaded as the mainloop starts: bias+SiLU(+requant) 2-6 % faster on deferred-epilogue
    # tiles and requant 0.5-1.5 % faster on immediate ones, but bf16 bias+SiLU 2-2.5 % slower on the
    # immediate 128x128 tiles (H200, one round; notes/fp8_block.md session 16).
    if not cfg.defer_epilogue and epilogue.requant is None:
        cfg = replace(cfg, early_bias=False)
    tiles, k_tiles = -(-m // 64) * -(-n // 64), k // BLOCK
    if (cfg.tile_m, cfg.tile_n, cfg.cluster_m * cfg.cluster_n) == (64, 64, 1) and m > 16 and 2 * tiles <= num_sms \
            and k_tiles >= 56 and k_tiles % 8 == 0:  # halves of whole 4-k-tile overlap groups, as measured
        cfg = replace(cfg, splits=2)
    return cfg


def _gemm_kernel(config: TileConfig, epilogue: Epilogue, bias_fp32: bool, num_sms: int) -> Fp8BlockGemmSm90:
    """The GEMM for one (config, epilogue, bias dtype) on a GPU of ``num_sms`` SMs."""
    return Fp8BlockGemmSm90(
        config, epilogue, MAX_SPLIT_TILES if config.splits > 1 else num_sms // (config.cluster_m * config.cluster_n),
        cutlass.Float32 if bias_fp32 else cutlass.BFloat16,
    )


def compile_gemm(config: TileConfig, epilogue: Epilogue, *, bias_fp32: bool = False, num_sms: int = 132,
                 tvm_ffi: bool = False, arch: str | None = None, options: str = ""):
    """Compiled kernel for one (config, epilogue, bias dtype, SM count), through :mod:`..cache`.

    The executor takes ``(x, w, x_scale, w_scale, out, bias, residual, out_scale)`` data pointers
    (0 for unused), ``M``, the rows of ``x`` its loads may read (>= M), ``N', K`` and a ``cuda.CUstream`` (with ``tvm_ffi``, CuTeDSL's apache-tvm-ffi
    calling convention, the stream handle as an int); ``M`` is dynamic."""
    from cutlass.cute.runtime import make_fake_stream

    from quantkit.kernels.cache import compile_kernel

    key = ("sm90.fp8_block_gemm", config, epilogue, bias_fp32, num_sms)
    return compile_kernel(key, _gemm_kernel(config, epilogue, bias_fp32, num_sms), *([0] * 8), BLOCK, BLOCK, 2 * BLOCK,
                          BLOCK, make_fake_stream(), arch=arch, options=options, tvm_ffi=tvm_ffi)


def compile_linear(config: TileConfig, epilogue: Epilogue, *, bias_fp32: bool = False, num_sms: int = 132,
                   tvm_ffi: bool = False, arch: str | None = None, options: str = ""):
    """Compiled :class:`Fp8BlockLinearSm90` (activation quantization, then the GEMM of ``config``
    with ``epilogue``; bf16 output), through :mod:`..cache`. The executor takes ``(x, q, x_scale,
    w, w_scale, out, bias, residual)`` data pointers (0 for unused), ``M``, the rows of ``q`` and
    ``x_scale`` (>= M), ``N', K``, the quantization's groups per CTA and a stream, as
    :func:`compile_gemm`'s."""
    from cutlass.cute.runtime import make_fake_stream

    from quantkit.kernels.cache import compile_kernel

    if epilogue.requant is not None:
        raise ValueError("the fused linear writes bf16: requant through act_quant and fp8_block_gemm")
    key = ("sm90.fp8_block_linear", config, epilogue, bias_fp32, num_sms)
    return compile_kernel(key, Fp8BlockLinearSm90(_gemm_kernel(config, epilogue, bias_fp32, num_sms)), *([0] * 8),
                          BLOCK, BLOCK, 2 * BLOCK, BLOCK, 1, make_fake_stream(), arch=arch, options=options, tvm_ffi=tvm_ffi)


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, epilogue: Epilogue, bias_fp32: bool, device: torch.device, config: TileConfig | None,
          tvm_ffi: bool, linear: bool = False):
    """The executor of one launch shape (dispatch config unless ``config``): :func:`compile_gemm`'s,
    or with ``linear`` :func:`compile_linear`'s; cached, so the per-call host path is a dict lookup."""
    config = config or pick_config(m, n, k, epilogue, num_sms(device))
    k_tiles = k // BLOCK  # per split
    if k_tiles % config.splits:
        raise ValueError(f"K/128 = {k_tiles} k-tiles do not divide into {config.splits} splits")
    if config.splits > 1 and -(-m // config.tile_m) * -(-n // config.tile_n) > MAX_SPLIT_TILES:
        raise ValueError(f"{config}: a K-split launch takes at most {MAX_SPLIT_TILES} tiles")
    k_tiles //= config.splits
    if config.overlap and k_tiles % config.unroll:
        # the largest group of 16, 8 or 4 k-tiles that divides the k-tiles, else no overlap
        fits = [u for u in (16, 8, 4) if u < config.unroll and k_tiles % u == 0]
        config = replace(config, unroll=fits[0]) if fits else replace(config, overlap=False)
    return (compile_linear if linear else compile_gemm)(config, epilogue, bias_fp32=bias_fp32, num_sms=num_sms(device),
                                                        tvm_ffi=tvm_ffi)


def _check_weight(k: int, w, w_scale, epilogue: Epilogue) -> tuple[int, int]:
    """``(N', N)`` of fp8-block weights ``w [N', K]`` with scales ``w_scale [ceil(N'/128), K/128]``
    for ``epilogue`` (``N = N'/2`` for swiglu); ValueError naming what does not fit."""
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"expected float8_e4m3fn w[N, {k}]; got {w.dtype} {tuple(w.shape)}")
    if k % BLOCK or n % 64 or ((epilogue.activation == "swiglu" or epilogue.requant) and n % (2 * BLOCK if epilogue.activation == "swiglu" else BLOCK)):
        raise ValueError(f"unsupported shape N'={n}, K={k} for {epilogue}")
    if tuple(w_scale.shape) != (-(-n // BLOCK), k // BLOCK):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} does not match w {tuple(w.shape)}: expected "
                         f"{(-(-n // BLOCK), k // BLOCK)}")
    return n, n // 2 if epilogue.activation == "swiglu" else n


def fp8_block_gemm(x, x_scale, w, w_scale, epilogue: Epilogue = Epilogue(), bias=None, residual=None,
                   config: TileConfig | None = None, out=None, m: int | None = None):
    """fp8-block GEMM + ``epilogue`` on a Hopper GPU (see the module docstring for the math).

    ``x`` float8_e4m3fn ``[M, K]``, ``x_scale`` FP32 ``[M, K/128]`` (any strides; M-major from
    :func:`scales_for_tma` avoids a copy), ``w`` float8_e4m3fn ``[N', K]``, ``w_scale`` FP32
    ``[ceil(N'/128), K/128]``, ``bias`` bf16/FP32 ``[N']``, ``residual`` bf16 ``[M, N]``.
    Returns bf16 ``[M, N]`` (``N = N'/2`` for swiglu), or with ``requant="fp8-block"`` the pair
    (float8_e4m3fn ``[M, N]``, FP32 scales ``[M, N/128]`` in the M-major layout). K must divide by
    128 and N' by 64 (by 128 for swiglu and requant). ``out``: an optional contiguous output buffer
    (bf16 only) to write into; ``config`` overrides the dispatch table. ``m``: the rows to compute
    where ``x`` and ``x_scale`` hold more (``act_quant(..., rows=)``: whole token tiles, which
    the TMA loads read faster than a tile partly past the last row); residual and outputs have ``m``."""
    x_rows, k = x.shape
    m = x_rows if m is None else m
    if not 0 <= m <= x_rows:
        raise ValueError(f"m={m} outside the {x_rows} rows of x")
    if x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected float8_e4m3fn x[M, K]; got {x.dtype} {tuple(x.shape)}")
    n, n_out = _check_weight(k, w, w_scale, epilogue)
    if tuple(x_scale.shape) != (x_rows, k // BLOCK):
        raise ValueError(f"x_scale shape {tuple(x_scale.shape)} does not match x {tuple(x.shape)}")
    requant = epilogue.requant is not None
    if out is None or requant:
        out = torch.empty(m, n_out, dtype=torch.float8_e4m3fn if requant else torch.bfloat16, device=x.device)
    elif out.shape != (m, n_out) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n_out}] tensor")
    out_scale = m_major_empty(m, n_out // BLOCK, x.device) if requant else None
    if m == 0:
        return (out, out_scale) if requant else out
    bias, residual, bias_fp32 = epilogue_operands(epilogue, m, n, n_out, bias, residual)
    x, w = x.contiguous(), w.contiguous()
    x_scale, w_scale = scales_for_tma(x_scale), w_scale.float().contiguous()
    tvm_ffi = use_tvm_ffi()
    fn = _plan(m, n, k, epilogue, bias_fp32, x.device, config, tvm_ffi)
    fn(*map(data_ptr, (x, w, x_scale, w_scale, out, bias, residual, out_scale)), m, x_rows, n, k,
       launch_stream(x.device, tvm_ffi))
    return (out, out_scale) if requant else out


@kernel_op("quantkit::fp8_block_gemm")
def fp8_block_gemm_op(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      activation: str = "identity") -> torch.Tensor:
    """``torch.library`` op around :func:`fp8_block_gemm` (bf16 output): usable under
    ``torch.compile`` (dynamic M, no recompile) and CUDA-graph capture."""
    epilogue = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None)
    return fp8_block_gemm(x, x_scale, w, w_scale, epilogue, bias, residual)


@fp8_block_gemm_op.register_fake
def _(x, x_scale, w, w_scale, bias=None, residual=None, activation="identity"):
    return x.new_empty((x.shape[0], w.shape[0] // (2 if activation == "swiglu" else 1)), dtype=torch.bfloat16)


@kernel_op("quantkit::fp8_block_gemm_requant")
def fp8_block_gemm_requant_op(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                              activation: str = "identity") -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``quantkit::fp8_block_gemm`` but returns the next fp8-block layer's input:
    (float8_e4m3fn ``[M, N]``, FP32 scales ``[M, N/128]``, M-major)."""
    epilogue = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None, requant="fp8-block")
    return fp8_block_gemm(x, x_scale, w, w_scale, epilogue, bias, residual)


@fp8_block_gemm_requant_op.register_fake
def _(x, x_scale, w, w_scale, bias=None, residual=None, activation="identity"):
    m, n = x.shape[0], w.shape[0]
    m4 = (m + 3) // 4 * 4
    out = x.new_empty((m, n), dtype=torch.float8_e4m3fn)
    return out, torch.empty_strided((m, n // BLOCK), (1, m4), dtype=torch.float32, device=x.device)


def fp8_block_linear(x, w, w_scale, epilogue: Epilogue = Epilogue(), bias=None, residual=None, pdl: bool | None = None):
    """fp8-block linear of bf16 ``x [M, K]`` (bf16 output): the decode GEMV
    (:mod:`.fp8_block_gemv`, activations quantized in-kernel) where it runs and is the faster
    (:func:`.fp8_block_gemv.use_gemv`: up to 8 tokens, or 16 on one-wave weights), else the
    activation quantization (:mod:`.act_quant`) and :func:`fp8_block_gemm`, launched by one host
    call (:class:`Fp8BlockLinearSm90`). Both compute the same function; operands as
    :func:`fp8_block_gemm` with bf16 ``x``.

    Beyond 16 tokens the quantized activations are allocated in whole token tiles (the GEMM's TMA
    loads of a tile partly past M run slowly: H100, session 25, the GEMM on tile-padded rows 4096x14336
    at M = 65 33 µs against 52, at M = 129 48 against 68; 6144x4096 at M = 17 12 against 17;
    28672x4096 at M = 17-100 within 2 µs either way; H200, session 26, the whole linear on Llama-3-8B
    shapes at M = 17-200: as fast to 1.66x faster than on x's own rows). At 17-128 tokens both
    kernels launch as programmatic dependents (``TileConfig.pdl``): the GEMM's prologue and first
    weight stages overlap the quantization, and the quantization's launch the kernel before it
    (H100, CUDA graphs, five Llama-3 and DeepSeek-V3 weights, outputs bit-identical: the linear
    5-32 % faster at 32-64 tokens, 0-16 % at 96-128; at 512 -2 to +5 %, so plain launches there);
    ``pdl`` overrides that choice (beyond 16 tokens)."""
    from quantkit.kernels.sm90 import fp8_block_gemv

    m, k = x.shape
    n = w.shape[0]
    if fp8_block_gemv.use_gemv(m, n, k, epilogue, num_sms(x.device)):
        return fp8_block_gemv.fp8_block_gemv(x, w, w_scale, epilogue, bias, residual)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"expected bf16 x[M, K]; got {x.dtype} {tuple(x.shape)}")
    if epilogue.requant is not None:
        raise ValueError("fp8_block_linear writes bf16: requant through act_quant and fp8_block_gemm")
    n, n_out = _check_weight(k, w, w_scale, epilogue)
    out = torch.empty(m, n_out, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    bias, residual, bias_fp32 = epilogue_operands(epilogue, m, n, n_out, bias, residual)
    tvm_ffi = use_tvm_ffi()
    rows, fn = _linear_plan(m, n, k, epilogue, bias_fp32, x.device, 16 < m <= 128 if pdl is None else pdl, tvm_ffi)
    q, x_scale = quantized_empty(rows, k, x.device)
    x, w, w_scale = x.contiguous(), w.contiguous(), w_scale.float().contiguous()
    fn(x.data_ptr(), q.data_ptr(), x_scale.data_ptr(), w.data_ptr(), w_scale.data_ptr(), out.data_ptr(), data_ptr(bias),
       data_ptr(residual), m, rows, n, k, groups_per_cta(m, k, rmsnorm=False), launch_stream(x.device, tvm_ffi))
    return out


@functools.lru_cache(maxsize=4096)  # the eager per-call path: one dict lookup
def _linear_plan(m: int, n: int, k: int, epilogue: Epilogue, bias_fp32: bool, device: torch.device, pdl: bool,
                 tvm_ffi: bool):
    """``(rows, executor)`` of :func:`fp8_block_linear` for one launch shape: the quantized
    operands' height (whole token tiles beyond 16 tokens; the padded M stays in its dispatch
    bucket) and :func:`compile_linear`'s executor for the dispatch tile with ``pdl``."""
    config = _linear_config(m, n, k, epilogue, num_sms(device), pdl)
    rows = -(-m // config.tile_m) * config.tile_m if m > 16 else m
    return rows, _plan(m, n, k, epilogue, bias_fp32, device, config, tvm_ffi, linear=True)


def _linear_config(m: int, n: int, k: int, epilogue: Epilogue, sms: int, pdl: bool) -> TileConfig:
    """:func:`pick_config`'s tile with ``pdl`` set, for :func:`fp8_block_linear` (through
    :func:`_linear_plan`'s cache)."""
    return replace(pick_config(m, n, k, epilogue, sms), pdl=pdl)


@kernel_op("quantkit::fp8_block_linear")
def fp8_block_linear_op(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                        residual: torch.Tensor | None = None, activation: str = "identity") -> torch.Tensor:
    """``torch.library`` op around :func:`fp8_block_linear`: one graph for every M (the choice of
    kernels happens inside the op)."""
    epilogue = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None)
    return fp8_block_linear(x, w, w_scale, epilogue, bias, residual)


@fp8_block_linear_op.register_fake
def _(x, w, w_scale, bias=None, residual=None, activation="identity"):
    return x.new_empty((x.shape[0], w.shape[0] // (2 if activation == "swiglu" else 1)), dtype=torch.bfloat16)
