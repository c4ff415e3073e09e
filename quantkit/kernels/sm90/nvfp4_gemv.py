"""Hopper (sm_90a) decode GEMV on NVFP4 weights (W4A16, ``M <= 16`` tokens), in CuTeDSL.

At decode only the weight bytes matter; a 64-row WGMMA tile with a producer warpgroup, mbarriers
and a shared-memory stage per k-tile is more machinery than the byte stream needs. Here each warp
streams its own run of the weight tiles that :func:`.nvfp4_gemm.prepare` lays out (no second
copy of the weight) through a private ``cp.async`` ring in shared memory (16-byte copies, several
tiles in flight per warp, no mbarriers), decodes them with the GEMM's exact register decode
(:func:`.nvfp4_gemm.dsl_ops`) and multiplies with warp-level ``mma.sync.m16n8k16`` (bf16 in,
FP32 accumulate; tokens are the MMA N, padded to 8 with zero-filled copies; 9-16 tokens take a
second 8-token fragment that reuses each decoded weight fragment).

* A prepared 64x128 tile is 4 strips of 16 rows; strip ``s`` of the tile is exactly the A
  fragment of ``mma.m16n8k16`` for lane ``l`` at thread ``32 s + l`` of the WGMMA layout, so one
  warp covers the whole tile (4 accumulators, the activation fragment reused 4 times).
* The activations of a k-tile (``M x 128`` bf16) ride in the same ring slot, rows padded to 272
  bytes so that the B-fragment loads are free of bank conflicts.
* A CTA holds ``tiles`` 64-row tiles (2 for SwiGLU: the gate and up halves of a 128-row group)
  and ``warps`` warps; warp ``w`` takes tile ``w % tiles`` and the ``w // tiles``-th contiguous
  run of the CTA's k-tiles. Partial sums meet in shared memory (fixed order); with ``splits > 1``
  the CTAs of one row block meet through the split-K turnstile of the GEMM (the last CTA to
  arrive sums the partials in split order: deterministic) or, with ``cluster``, as one
  thread-block cluster through distributed shared memory (each CTA sums, in split order, the
  output columns it owns) before the fused epilogue (tensor scale, bias, activation incl.
  SwiGLU, residual) writes bf16.
* With ``pdl`` the weight copies of the first ring slots start before ``griddepcontrol.wait``
  (no kernel writes weights); activations, partials and outputs only after it.
* Host: (config, executor) cached per launch shape; where apache-tvm-ffi is installed the
  executor is CuTeDSL's tvm-ffi one (16 µs per eager launch on the H200 host vs 69 µs through
  the default executor, ``benchmarks/notes/nvfp4.md``).

:func:`.nvfp4_gemm.nvfp4_w4a16` runs this kernel for decode batches (:func:`use_gemv`).
The weight format is a set of hooks (``make_fragments``, ``issue_weights``, ``load_fragments``,
``accumulate``, ``alpha``; the config's ``slot_bytes`` and ``tile_tokens``): the fp8-block GEMV
(:mod:`.fp8_block_gemv`) subclasses this kernel with its own.
"""

import dataclasses
import functools
from dataclasses import dataclass

import torch

from quantkit.kernels.cache import launch_stream, num_sms, use_tvm_ffi
from quantkit.kernels.epilogue import SWIGLU_GROUP, Epilogue
from quantkit.kernels.sm90 import nvfp4_gemm as ng
from quantkit.kernels.sm90 import split_k

FRAG = 8  # tokens per MMA fragment: the MMA N
MAX_M = 2 * FRAG  # tokens: two fragments
WIDE_MAX_K = 8192  # 9-16 tokens take the GEMV on one-wave weights up to this K (use_gemv)
X_ROW = 272  # bytes per token row of a k-tile's activations in the ring (256 + 16: no bank conflicts)
_SMEM = 227 * 1024


@dataclass(frozen=True)
class GemvConfig:
    """``warps`` per CTA, ``tiles`` 64-row tiles per CTA (2 for SwiGLU), ``stages`` ring slots per
    warp (``stages - 1`` k-tiles in flight), ``splits`` K-splits across CTAs, ``tokens`` activation
    rows a ring slot holds (1, 2, 4, 8 or 16: the most tokens it serves), ``pdl``: programmatic
    dependent launch (the weight copies of the first slots start before the previous grid ends),
    ``cluster``: the ``splits`` CTAs of a row block form one thread-block cluster and meet in
    distributed shared memory instead of the global split-K turnstile (2..8 splits)."""

    warps: int = 4
    tiles: int = 1
    stages: int = 4
    splits: int = 1
    tokens: int = FRAG
    pdl: bool = False
    cluster: bool = False

    TOKENS = (1, 2, 4, 8, 16)  # ring-slot token counts

    @property
    def tile_tokens(self) -> int:
        """Token columns of the partial sums: 8 per MMA N fragment."""
        return MAX_M if self.tokens > FRAG else FRAG

    def check(self, epilogue: Epilogue) -> None:
        """Raise ValueError if this config cannot run ``epilogue``."""
        threads = 32 * self.warps
        if (self.tiles not in (1, 2) or self.warps % self.tiles or self.stages < 2 or self.splits < 1
                or self.tokens not in self.TOKENS or (SWIGLU_GROUP * self.tile_tokens) % threads
                or self.smem_bytes() > _SMEM
                or (self.cluster and not 2 <= self.splits <= 8)):
            raise ValueError(f"unsupported GEMV config {self}")
        if (epilogue.activation == "swiglu") != (self.tiles == 2):
            raise ValueError("swiglu needs tiles=2 (the gate and up halves of a 128-row group), and only swiglu")
        if epilogue.requant is not None:
            raise ValueError("the sm90 GEMVs write bf16 only (no requant epilogue)")

    def slot_bytes(self) -> int:
        """One ring slot: a weight tile and ``tokens`` activation rows."""
        return ng.TILE_BYTES + self.tokens * X_ROW

    def smem_bytes(self) -> int:
        """Shared memory per CTA: the warps' rings, the reduced tile (twice with ``cluster``: the
        CTA's own partial, read by its peers, and the cluster sums it owns), 1 KB reserved by the system."""
        tile = ng.ROWS * self.tiles * self.tile_tokens * 4
        return self.warps * self.stages * self.slot_bytes() + tile * (2 if self.cluster else 1) + 1024 + 64

    def ctas_per_sm(self) -> int:
        """CTAs that fit one SM's shared memory."""
        return max(1, _SMEM // self.smem_bytes())


def pick_gemv_config(m: int, n_pad: int, k: int, epilogue: Epilogue, num_sms: int = 132) -> GemvConfig:
    """The decode GEMV's config for ``m`` tokens (rules fitted to the H200 sweeps in
    ``benchmarks/notes/nvfp4.md``): 8 warps, PDL, ring slots for the next power of two of ``m``
    tokens; a 2-way K-split (a cluster meeting in distributed shared memory) where the weight has
    at most half a CTA per SM and each warp would run >= 12 k-tiles, or at most a quarter of a CTA
    per SM (k/v projections) and >= 4 k-tiles per warp. 3 stages (one CTA per SM) when the grid
    takes an odd number of rounds at one CTA per SM, else 2 (two CTAs per SM, the same number of
    half-size rounds): with two per SM an odd count leaves the last round half empty (H100 A/B,
    session 25: 3 stages 5-17 % faster there, 2 stages up to 13 % faster on even counts). 9-16
    tokens: one CTA per SM at any depth, so 3 stages where they fit, else 2."""
    tiles = 2 if epilogue.activation == "swiglu" else 1
    warps = 8
    ctas = n_pad // (ng.ROWS * tiles)
    k_tiles_per_warp = (k // ng.BK) // (warps // tiles)
    deep = 2 * ctas <= num_sms and k_tiles_per_warp >= 12
    narrow = 4 * ctas <= num_sms and k_tiles_per_warp >= 4
    splits = 2 if deep or narrow else 1
    tokens = 1 << max(0, m - 1).bit_length()
    stages = 3 if tokens > FRAG or -(-ctas * splits // num_sms) % 2 else 2
    cfg = GemvConfig(warps, tiles, stages, splits, tokens, pdl=True, cluster=splits > 1)
    return cfg if cfg.smem_bytes() <= _SMEM else dataclasses.replace(cfg, stages=2)


def use_gemv(m: int, n_pad: int, k: int, epilogue: Epilogue, num_sms: int) -> bool:
    """Whether W4A16 at ``M = m`` tokens on a prepared ``[n_pad, k]`` weight runs this GEMV
    rather than the WGMMA kernel: up to 8 tokens always (H200: faster at every shape); 9-16 tokens
    (two 8-token MMA fragments) where the weight is one wave of GEMV CTAs and ``k <= 8192`` (H100,
    ``benchmarks/notes/nvfp4.md`` session 30: 1.04-1.47x as fast as the WGMMA kernel there; 1-34 %
    slower on multi-wave weights, and from 2 % faster to 4 % slower at K = 14336 and 28672)."""
    if m <= FRAG:
        return True
    rows = ng.ROWS * (2 if epilogue.activation == "swiglu" else 1)
    return m <= MAX_M and n_pad // rows <= num_sms and k <= WIDE_MAX_K


# ---------------------------------------------------------------------------------------- kernel
@functools.cache  # built on first use: importing cutlass is slow
def _kernel_class():
    """Define the CuTeDSL kernel (imports CuTeDSL; called on first compile)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    ops = ng.dsl_ops()
    ld_dsmem_f32 = split_k.dsl_cluster().ld_dsmem_f32

    @dsl_user_op
    def cp_async_16(dst_smem, src_gmem, src_bytes, *, loc=None, ip=None):
        """``cp.async.cg`` of 16 bytes global -> shared; bytes past ``src_bytes`` (0 or 16) are zero."""
        llvm.inline_asm(
            None,
            [Int32(dst_smem).ir_value(loc=loc, ip=ip), Int64(src_gmem).ir_value(loc=loc, ip=ip),
             Int32(src_bytes).ir_value(loc=loc, ip=ip)],
            "cp.async.cg.shared.global.L2::128B [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True, loc=loc, ip=ip)

    @dsl_user_op
    def mma_sync(shape_types: str, a, b0, b1, c, *, loc=None, ip=None):
        """``mma.sync.aligned.<shape_types>`` (e.g. ``m16n8k16.row.col.f32.bf16.bf16.f32``), FP32
        accumulate: A registers ``a`` (4), B ``b0, b1``, C ``c`` (4 FP32); returns D (4 FP32)."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * 4),
            [Uint32(v).ir_value(loc=loc, ip=ip) for v in (*a, b0, b1)]
            + [Float32(v).ir_value(loc=loc, ip=ip) for v in c],
            f"mma.sync.aligned.{shape_types} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, loc=loc, ip=ip)
        return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]

    class Nvfp4GemvSm90:
        """One (config, epilogue, bias dtype) GEMV; call through ``cute.compile``."""

        copy_16 = staticmethod(cp_async_16)  # for the subclasses' ``issue_weights``
        mma = staticmethod(mma_sync)  # and their ``accumulate``

        def __init__(self, config: GemvConfig, epilogue: Epilogue, bias_fp32: bool):
            config.check(epilogue)
            self.cfg, self.epi = config, epilogue
            self.bias_dtype = Float32 if bias_fp32 else cutlass.BFloat16
            self.swiglu = epilogue.activation == "swiglu"
            self.groups = config.warps // config.tiles  # warps per tile (k runs)
            self.rows = ng.ROWS * config.tiles  # weight rows per CTA
            self.threads = 32 * config.warps
            self.slot = config.slot_bytes()
            self.x_offset = self.slot - config.tokens * X_ROW  # the activations follow the weight tile
            self.mt = config.tile_tokens  # token columns of the partial sums

        @cute.jit
        def __call__(self, x_ptr: Int64, w_ptr: Int64, aux_ptr: Int64, out_ptr: Int64, bias_ptr: Int64,
                     res_ptr: Int64, ws_ptr: Int64, cnt_ptr: Int64, m: Int32, n_pad: Int32, n_out: Int32, k: Int32,
                     stream):
            gmem = cute.AddressSpace.gmem
            k = cute.assume(k, divby=ng.BK)
            n_rows = n_out * 2 if self.swiglu else n_out
            mOut = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, out_ptr, gmem, assumed_align=2),
                                    cute.make_layout((m, n_out), stride=(n_out, 1)))
            mBias, mRes = None, None
            if cutlass.const_expr(self.epi.bias):
                mBias = cute.make_tensor(cute.make_ptr(self.bias_dtype, bias_ptr, gmem, assumed_align=2),
                                         cute.make_layout(n_rows))
            if cutlass.const_expr(self.epi.residual):
                mRes = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, res_ptr, gmem, assumed_align=2),
                                        cute.make_layout((m, n_out), stride=(n_out, 1)))

            @cute.struct
            class SharedStorage:
                ring: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Uint8, self.cfg.warps * self.cfg.stages * self.slot], 128]
                fin: cute.struct.Align[cute.struct.MemRange[Float32, self.rows * self.mt], 16]
                fsum: cute.struct.Align[cute.struct.MemRange[Float32, self.rows * self.mt if self.cfg.cluster else 4], 16]
                flag: cute.struct.MemRange[Int32, 4]

            self.shared_storage = SharedStorage
            cluster = {"cluster": (1, self.cfg.splits, 1)} if self.cfg.cluster else {}
            self.kernel(x_ptr, w_ptr, aux_ptr, mOut, mBias, mRes, ws_ptr, cnt_ptr, m, n_out, n_rows, k).launch(
                grid=(n_pad // self.rows, self.cfg.splits, 1), block=[self.threads, 1, 1], stream=stream,
                use_pdl=self.cfg.pdl, **cluster,
                # registers for as many CTAs as the shared memory holds; all of it as shared memory
                min_blocks_per_mp=self.cfg.ctas_per_sm(), preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, x_ptr: Int64, w_ptr: Int64, aux_ptr: Int64, mOut: cute.Tensor,
                   mBias: cute.Tensor | None, mRes: cute.Tensor | None, ws_ptr: Int64, cnt_ptr: Int64,
                   m: Int32, n_out: Int32, n_rows: Int32, k: Int32):
            cfg = self.cfg
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = tidx % 32
            bx, bz, _ = cute.arch.block_idx()
            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)

            k_tiles = k // ng.BK
            lo = bz * k_tiles // cfg.splits
            span = (bz + 1) * k_tiles // cfg.splits - lo
            grp = warp // cfg.tiles
            my_lo = lo + grp * span // self.groups
            count = lo + (grp + 1) * span // self.groups - my_lo
            rb = bx * cfg.tiles + warp % cfg.tiles  # this warp's 64-row block
            ring_addr = storage.ring.data_ptr().toint() + warp * (cfg.stages * self.slot)

            acc = cute.make_rmem_tensor((4, 4, self.mt // FRAG), Float32)  # (C register, strip, 8-token fragment)
            acc.fill(0.0)
            frag = self.make_fragments()

            # prologue: fill the ring (with PDL the weights first: no previous kernel writes them)
            if cutlass.const_expr(cfg.pdl):
                for i in cutlass.range_constexpr(cfg.stages - 1):
                    if i < count:
                        self.issue_weights(ring_addr, w_ptr, aux_ptr, rb, my_lo + i, i, lane, k)
                cute.arch.griddepcontrol_wait()
            for i in cutlass.range_constexpr(cfg.stages - 1):
                if i < count:
                    if cutlass.const_expr(not cfg.pdl):
                        self.issue_weights(ring_addr, w_ptr, aux_ptr, rb, my_lo + i, i, lane, k)
                    self.issue_x(ring_addr, x_ptr, my_lo + i, i, lane, m, k)
                cute.arch.cp_async_commit_group()
            for i in cutlass.range(count, unroll=1):
                cute.arch.cp_async_wait_group(cfg.stages - 2)
                cute.arch.sync_warp()  # every lane's copies of slot i % stages have landed
                self.load_fragments(frag, storage, i % cfg.stages, warp, lane)
                # refill the slot read in the previous iteration (its registers are consumed)
                nxt = i + cfg.stages - 1
                if nxt < count:
                    self.issue_weights(ring_addr, w_ptr, aux_ptr, rb, my_lo + nxt, nxt % cfg.stages, lane, k)
                    self.issue_x(ring_addr, x_ptr, my_lo + nxt, nxt % cfg.stages, lane, m, k)
                cute.arch.cp_async_commit_group()
                self.accumulate(frag, acc, storage, i % cfg.stages, warp, lane)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()
            # this warp's partial [64 rows, mt tokens] into its own ring slot 0 (FP32)
            ring_words = cfg.stages * self.slot // 4
            g, c = lane // 4, lane % 4
            part = cute.make_tensor(cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32),
                                    cute.make_layout((ng.ROWS, self.mt, cfg.warps), stride=(self.mt, 1, ring_words)))
            for f in cutlass.range_constexpr(self.mt // FRAG):
                for s in cutlass.range_constexpr(4):
                    for j in cutlass.range_constexpr(4):
                        part[16 * s + g + 8 * (j // 2), FRAG * f + 2 * c + j % 2, warp] = acc[j, s, f]
            cute.arch.sync_threads()
            if self.reduce(storage, tidx, bx, bz, ws_ptr, cnt_ptr) != 0:
                self.store(storage, tidx, bx, bz, self.alpha(aux_ptr), mOut, mBias, mRes, m, n_out, n_rows)
            if cutlass.const_expr(cfg.cluster):
                cute.arch.cluster_wait()  # the peers have read this CTA's partial: its shared memory may go

        # ---- the weight format: NVFP4 tiles of nvfp4_gemm.prepare (the fp8-block GEMV overrides these)
        def make_fragments(self):
            """Register fragments of one k-tile: codes (word, half, strip), scales (word, strip),
            activations (b0 | b1, k16 block, 8-token fragment)."""
            return (cute.make_rmem_tensor((4, 2, 4), Uint32), cute.make_rmem_tensor((4, 4), Uint32),
                    cute.make_rmem_tensor((2, 8, self.mt // FRAG), Uint32))

        @cute.jit
        def load_fragments(self, frag, storage, slot, warp, lane):
            """Ring slot ``slot`` of warp ``warp`` into the registers ``frag``."""
            cfg = self.cfg
            rc, rs, rx = frag
            slot_words = self.slot // 4
            ring_words = cfg.stages * slot_words  # per warp
            words = cute.recast_ptr(storage.ring.data_ptr(), dtype=Uint32)
            # per (slot, warp), as 32-bit words: codes (word, lane, strip, half), scales (word, quad,
            # strip), activations (token, word)
            sCode = cute.make_tensor(words, cute.make_layout((4, 32, 4, 2, cfg.stages, cfg.warps),
                                                             stride=(1, 4, 128, 512, slot_words, ring_words)))
            sScale = cute.make_tensor(words + ng.CODE_BYTES // 4, cute.make_layout(
                (4, 8, 4, cfg.stages, cfg.warps), stride=(1, 4, 32, slot_words, ring_words)))
            sX = cute.make_tensor(words + ng.TILE_BYTES // 4, cute.make_layout(
                (cfg.tokens, X_ROW // 4, cfg.stages, cfg.warps), stride=(X_ROW // 4, 1, slot_words, ring_words)))
            g, c = lane // 4, lane % 4
            for s in cutlass.range_constexpr(4):
                for h in cutlass.range_constexpr(2):
                    cute.autovec_copy(sCode[None, lane, s, h, slot, warp], rc[None, h, s])
                cute.autovec_copy(sScale[None, lane // 4, s, slot, warp], rs[None, s])
            if cutlass.const_expr(cfg.tokens < self.mt):
                rx.fill(0)  # tokens past the slot's rows: zero B columns
            for f in cutlass.range_constexpr(self.mt // FRAG):
                if g + FRAG * f < cfg.tokens:
                    for b in cutlass.range_constexpr(8):
                        rx[0, b, f] = sX[g + FRAG * f, 8 * b + c, slot, warp]
                        rx[1, b, f] = sX[g + FRAG * f, 8 * b + c + 4, slot, warp]

        @cute.jit
        def accumulate(self, frag, acc, storage, slot, warp, lane):
            """Decode the k-tile's weights in registers and ``acc += w · x`` (``mma.m16n8k16``, one
            per 8-token fragment of each decoded weight fragment)."""
            rc, rs, rx = frag
            for b in cutlass.range_constexpr(8):
                for s in cutlass.range_constexpr(4):
                    a = ops.decode_w4a16(rc[b % 4, b // 4, s], rs[b // 2, s], b)
                    for f in cutlass.range_constexpr(self.mt // FRAG):
                        d = mma_sync("m16n8k16.row.col.f32.bf16.bf16.f32", a, rx[0, b, f], rx[1, b, f],
                                     [acc[0, s, f], acc[1, s, f], acc[2, s, f], acc[3, s, f]])
                        for j in cutlass.range_constexpr(4):
                            acc[j, s, f] = d[j]

        @cute.jit
        def alpha(self, aux_ptr):
            """The FP32 factor of every sum: the tensor scale times the decode's 2^-7."""
            gs = cute.make_tensor(cute.make_ptr(Float32, aux_ptr, cute.AddressSpace.gmem, assumed_align=4),
                                  cute.make_layout(1))
            return gs[0] * 128.0

        @cute.jit
        def issue_weights(self, ring_addr, w_ptr, aux_ptr, rb, kt, slot, lane, k):
            """Copies of row block ``rb``'s prepared weight tile ``kt`` into ring slot ``slot``, 16 bytes
            per lane and copy."""
            dst = ring_addr + slot * self.slot
            src = w_ptr + (Int64(rb) * (k // ng.BK) + kt) * ng.TILE_BYTES
            for q in cutlass.range_constexpr(ng.TILE_BYTES // 512):
                cp_async_16(dst + (32 * q + lane) * 16, src + (32 * q + lane) * 16, 16)

        @cute.jit
        def issue_x(self, ring_addr, x_ptr, kt, slot, lane, m, k):
            """Copies of the activations' 128 columns of k-tile ``kt`` into ring slot ``slot`` (rows
            from token ``m`` zero-filled)."""
            dst = ring_addr + slot * self.slot + self.x_offset
            for q in cutlass.range_constexpr(-(-self.cfg.tokens * 16 // 32)):
                chunk = 32 * q + lane
                tok = chunk // 16
                if chunk < self.cfg.tokens * 16:
                    nbytes = Int32(0)
                    x_src = x_ptr
                    if tok < m:
                        nbytes = Int32(16)
                        x_src = x_ptr + (Int64(tok) * k + kt * ng.BK) * 2 + (chunk % 16) * 16
                    cp_async_16(dst + tok * X_ROW + (chunk % 16) * 16, x_src, nbytes)

        @cute.jit
        def reduce(self, storage, tidx, bx, bz, ws_ptr, cnt_ptr):
            """Sum the warps' partials (fixed order) into ``fin [rows, 8]``; across K-splits through
            the workspace and the per-row-block counter (the last CTA to arrive sums in split order),
            or with ``cluster`` into ``fsum``: each CTA the rows it owns, summed over the cluster's
            ``fin`` in split order. Returns 1 in a CTA that holds full sums (0 in the other CTAs of a
            turnstile-split row block)."""
            cfg = self.cfg
            fin = storage.fin.get_tensor(cute.make_layout((self.rows, self.mt), stride=(self.mt, 1)))
            flag = storage.flag.get_tensor(cute.make_layout(4))
            ring_f = cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32)
            warp_floats = cfg.stages * self.slot // 4
            per_thread = self.rows * self.mt // self.threads
            vals = cute.make_rmem_tensor((per_thread,), Float32)
            for e in cutlass.range_constexpr(per_thread):
                idx = tidx + e * self.threads  # (row of the CTA, token) = (idx // 8, idx % 8)
                t = (idx // self.mt) // ng.ROWS
                off = ((idx // self.mt) % ng.ROWS) * self.mt + idx % self.mt
                total = Float32(0.0)
                for grp in cutlass.range_constexpr(self.groups):
                    total = total + ring_f[(grp * cfg.tiles + t) * warp_floats + off]
                vals[e] = total
            is_last = Int32(1)
            if cutlass.const_expr(cfg.splits > 1 and not cfg.cluster):
                stride = cute.arch.grid_dim()[0] * self.rows * self.mt  # floats per split
                mine = ws_ptr + Int64(bx * self.rows * self.mt + tidx) * 4
                ws = cute.make_tensor(cute.make_ptr(Float32, mine, cute.AddressSpace.gmem, assumed_align=4),
                                      cute.make_layout((per_thread, cfg.splits), stride=(self.threads, stride)))
                counter = cute.make_ptr(Int32, cnt_ptr, cute.AddressSpace.gmem, assumed_align=4) + bx
                is_last = split_k.dsl_reduce()(vals, ws, bz, cfg.splits, counter, tidx, flag, cute.arch.sync_threads,
                                               per_thread)
            for e in cutlass.range_constexpr(per_thread):
                idx = tidx + e * self.threads
                fin[idx // self.mt, idx % self.mt] = vals[e]
            cute.arch.sync_threads()
            if cutlass.const_expr(cfg.cluster):
                cute.arch.cluster_arrive()  # release: this CTA's partial is in its shared memory
                cute.arch.cluster_wait()  # acquire: so are the peers'
                fsum = storage.fsum.get_tensor(cute.make_layout((self.rows, self.mt), stride=(self.mt, 1)))
                fin_addr = storage.fin.data_ptr().toint()
                for e in cutlass.range_constexpr(per_thread):
                    idx = tidx + e * self.threads
                    if self.owner(idx // self.mt) == bz:
                        total = ld_dsmem_f32(fin_addr + idx * 4, 0)
                        for j in cutlass.range_constexpr(1, cfg.splits):
                            total = total + ld_dsmem_f32(fin_addr + idx * 4, j)
                        fsum[idx // self.mt, idx % self.mt] = total
                cute.arch.cluster_arrive()  # done reading the peers (each waits for this before it exits)
                cute.arch.sync_threads()
            return is_last

        def owner(self, row):
            """The cluster rank that sums and stores weight row ``row`` of the CTA's tile (with SwiGLU
            the gate and up rows of an output column go together)."""
            return (row % SWIGLU_GROUP) % self.cfg.splits

        @cute.jit
        def store(self, storage, tidx, bx, bz, alpha, mOut, mBias, mRes, m, n_out, n_rows):
            """``alpha``, bias, activation, residual on the sums (``fin``, with ``cluster`` the owned rows
            of ``fsum``); bf16 stores (consecutive threads: consecutive output columns)."""
            sums = storage.fsum if self.cfg.cluster else storage.fin
            fin = sums.get_tensor(cute.make_layout((self.rows, self.mt), stride=(self.mt, 1)))
            cols = SWIGLU_GROUP if self.swiglu else self.rows
            row0 = bx * self.rows
            col0 = bx * SWIGLU_GROUP if self.swiglu else row0
            for e in cutlass.range_constexpr(cols * self.mt // self.threads):
                idx = tidx + e * self.threads
                tok = idx // cols
                r = idx % cols
                col = col0 + r
                mine = True
                if cutlass.const_expr(self.cfg.cluster):
                    mine = self.owner(r) == bz
                if tok < m and col < n_out and mine:
                    v = fin[r, tok] * alpha
                    if cutlass.const_expr(self.epi.bias):
                        v = v + mBias[row0 + r].to(Float32)
                    if cutlass.const_expr(self.swiglu):
                        u = fin[SWIGLU_GROUP + r, tok] * alpha
                        if cutlass.const_expr(self.epi.bias):
                            u = u + mBias[row0 + SWIGLU_GROUP + r].to(Float32)
                        v = v / (1.0 + cute.math.exp(-v)) * u
                    else:
                        v = ops.activate(v, self.epi.activation)
                    if cutlass.const_expr(self.epi.residual):
                        v = v + mRes[tok, col].to(Float32)
                    mOut[tok, col] = v.to(cutlass.BFloat16)

    return Nvfp4GemvSm90


def compile_gemv(config: GemvConfig, epilogue: Epilogue, *, bias_fp32: bool = False, tvm_ffi: bool = False,
                 arch: str | None = None, options: str = ""):
    """The compiled GEMV for one (config, epilogue, bias dtype), through :mod:`..cache`. The
    executor takes data pointers ``(x, tiles, tensor_scale, out, bias, residual, workspace,
    counters)`` (0 when unused), then ``M, N_pad, N_out, K`` and the stream: a ``cuda.CUstream``,
    or with ``tvm_ffi`` (CuTeDSL's apache-tvm-ffi calling convention, a C++ argument path) the
    stream handle as an int."""
    from quantkit.kernels.cache import compile_kernel, pin_arch

    arch = pin_arch(arch)
    from cutlass.cute.runtime import make_fake_stream

    kernel = _kernel_class()(config, epilogue, bias_fp32)
    key = ("sm90.nvfp4_gemv", config, epilogue, bias_fp32)
    n_out = ng.ROW_PAD // (2 if epilogue.activation == "swiglu" else 1)
    return compile_kernel(key, kernel, *([0] * 8), 1, ng.ROW_PAD, n_out, ng.BK, make_fake_stream(), arch=arch,
                          options=options, tvm_ffi=tvm_ffi)


# ---------------------------------------------------------------------------------------- host
@functools.lru_cache(maxsize=4096)
def _plan(tokens: int, n_pad: int, k: int, epilogue: Epilogue, bias_fp32: bool, device: torch.device,
          config: GemvConfig | None, tvm_ffi: bool):
    """(config, executor) of one launch shape, cached: the per-call host path is a dict lookup."""
    config = config or pick_gemv_config(tokens, n_pad, k, epilogue, num_sms(device))
    config.check(epilogue)
    return config, compile_gemv(config, epilogue, bias_fp32=bias_fp32, tvm_ffi=tvm_ffi)


def launch_gemv(x: torch.Tensor, w: ng.Nvfp4Sm90Weight, epilogue: Epilogue, bias, residual, config: GemvConfig | None,
                out: torch.Tensor) -> torch.Tensor:
    """Run the GEMV on bf16 ``x [M <= 16, K]`` (contiguous, 16-byte aligned) into ``out``; the
    caller (:func:`.nvfp4_gemm.launch_gemm`) has checked shapes and epilogue operands."""
    m, k = x.shape
    if not 0 < m <= MAX_M:
        raise ValueError(f"the GEMV takes 1..{MAX_M} tokens, got {m}")
    if config is not None and m > config.tokens:
        raise ValueError(f"{config} serves at most {config.tokens} tokens, got {m}")
    n_pad = w.row_exp.shape[0]
    tvm_ffi = use_tvm_ffi()
    bias_fp32 = bias is not None and bias.dtype == torch.float32
    config, fn = _plan(1 << (m - 1).bit_length(), n_pad, k, epilogue, bias_fp32, x.device, config, tvm_ffi)
    ws = counters = None
    if config.splits > 1 and not config.cluster:
        ctas = n_pad // (ng.ROWS * config.tiles)
        split_k.check_tiles(ctas)
        ws = torch.empty(config.splits * ctas * ng.ROWS * config.tiles * config.tile_tokens, dtype=torch.float32,
                         device=x.device)
        counters = split_k.counter_buffer(x.device)
    stream = launch_stream(x.device, tvm_ffi)
    fn(x.data_ptr(), w.tiles.data_ptr(), w.tensor_scale.data_ptr(), out.data_ptr(),
       0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(),
       0 if ws is None else ws.data_ptr(), 0 if counters is None else counters.data_ptr(), m, n_pad, out.shape[1], k,
       stream)
    return out
