"""Split-K across CTAs, shared by the sm90 kernels, two ways:

* serial (the *turnstile*, :func:`dsl_reduce`): each CTA of a tile publishes its FP32 partial to a
  workspace and counts its arrival on the tile's counter; the last CTA to arrive sums all partials
  in split order (deterministic whatever the arrival order), resets the counter to 0 and runs the
  epilogue. Nothing waits on another CTA, so any grid size and residency is safe;
* as one thread-block cluster (:func:`dsl_cluster`): the splits of a tile are co-resident, leave
  their partials in their own shared memory and split 0 adds them through distributed shared
  memory, in the same order (the same sums, bit for bit).
"""
from __future__ import annotations

import functools

import torch

COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def counter_buffer(device: torch.device) -> torch.Tensor:
    """Per-device split-K tile counters (int32 ``[COUNTERS]``); zero between launches (each kernel
    resets its own). Launches sharing a device must be stream-ordered (one stream, or a CUDA graph)."""
    buf = _counters.get(device)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():  # the zero fill would only run at replay
            raise RuntimeError("the first split-K launch on a device is being captured in a CUDA graph: "
                               "run the layer once eagerly before capturing (as a warm-up)")
        buf = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def check_tiles(tiles: int) -> None:
    """Raise ValueError if ``tiles`` split tiles do not fit the counter buffer."""
    if tiles > COUNTERS:
        raise ValueError(f"{tiles} split-K tiles exceed the counter buffer ({COUNTERS})")


@functools.cache
def dsl_reduce():
    """The device side (imports CuTeDSL): ``reduce(vals, ws, split, splits, counter, tid, flag,
    barrier, chunk) -> Int32``, called by every thread of the CTA's reducing threads.

    ``vals``: the thread's FP32 partial (register tensor ``[n]``); ``ws``: where the thread's
    partials of every split live (gmem FP32 ``[n, splits]``, any layout); ``split``: this CTA's
    split; ``counter``: the tile's int32 counter (gmem pointer); ``tid``: the thread's index among
    the reducing threads; ``flag``: an int32 shared-memory tensor (one element used); ``barrier``:
    a callable synchronizing the reducing threads; ``chunk``: values loaded per split at once (a
    divisor of ``n``; bounds the registers the sum holds). Returns 1 in the last CTA to arrive,
    whose ``vals`` then hold the sum over splits (in split order), else 0."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    @cute.jit
    def reduce(vals: cute.Tensor, ws: cute.Tensor, split: Int32, splits: cutlass.Constexpr[int], counter: cute.Pointer,
               tid: Int32, flag: cute.Tensor, barrier, chunk: cutlass.Constexpr[int]) -> Int32:
        cute.autovec_copy(vals, ws[None, split])
        barrier()  # release: the CTA's stores precede the one acq_rel atomic (cumulative)
        if tid == 0:
            flag[0] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        barrier()
        is_last = Int32(0)
        if flag[0] == splits - 1:
            is_last = Int32(1)
        if is_last != 0:
            cute.arch.fence_acq_rel_gpu()
            tiles = cute.zipped_divide(ws, (chunk, 1))  # ((chunk, 1), (n / chunk, splits))
            parts = cute.make_rmem_tensor((chunk, splits), Float32)
            for c in cutlass.range_constexpr(cute.size(vals) // chunk):
                for j in cutlass.range_constexpr(splits):  # every split's loads in flight at once
                    cute.autovec_copy(tiles[(None, 0), (c, j)], parts[None, j])
                for v in cutlass.range_constexpr(chunk):
                    total = parts[v, 0]
                    for j in cutlass.range_constexpr(1, splits):
                        total = total + parts[v, j]
                    vals[c * chunk + v] = total
            if tid == 0:
                cute.make_tensor(counter, cute.make_layout(1))[0] = Int32(0)  # ready for the next launch
        return is_last

    return reduce


@functools.cache
def dsl_cluster():
    """The device side of K-splits meeting in one thread-block cluster (imports CuTeDSL), a
    namespace of:

    * ``ld_dsmem_f32(smem_addr, rank)``: the FP32 at shared address ``smem_addr`` of the cluster's
      CTA ``rank`` (``mapa`` + ``ld.shared::cluster``);
    * ``cluster_sum(vals, part, split, splits, tid, threads, barrier) -> Int32``, called by every
      reducing thread of every CTA of the cluster (cluster rank = ``split``) after its mainloop:
      ``barrier()`` (a callable synchronizing the CTA's reducing threads) runs first, so that no
      mainloop still reads the shared memory at ``part`` (an FP32 shared-memory pointer, 16-byte
      aligned, room for ``threads`` x ``n`` values); ``vals`` is the thread's FP32 partial (register
      tensor ``[n]``, ``n % 4 == 0``). Splits 1.. store it there, 16 bytes at a time, thread-interleaved (no bank
      conflicts); split 0 loads each peer's in turn (16-byte ``ld.shared::cluster``, a peer's loads
      all in flight at once), adds them in split order and returns 1 (the others 0). Every thread
      arrives once more on the cluster barrier after the reads: each CTA must
      ``cute.arch.cluster_wait()`` before it exits, so its shared memory outlives split 0's reads.
    """
    import types

    import cutlass
    from cutlass import Float32, Int32, cute
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    @dsl_user_op
    def ld_dsmem_f32(smem_addr, rank, *, loc=None, ip=None):
        return Float32(llvm.inline_asm(
            T.f32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
            "{ .reg .u32 a; mapa.shared::cluster.u32 a, $1, $2; ld.shared::cluster.f32 $0, [a]; }", "=f,r,r",
            has_side_effects=True, loc=loc, ip=ip))

    @cute.jit
    def cluster_sum(vals: cute.Tensor, part: cute.Pointer, split: Int32, splits: cutlass.Constexpr[int], tid: Int32,
                    threads: cutlass.Constexpr[int], barrier) -> Int32:
        barrier()
        n = cute.size(vals)
        # value i of thread t at float (i // 4) * 4 * threads + 4 * t + i % 4
        layout = cute.make_layout(((4, n // 4), threads), stride=((1, 4 * threads), 4))
        mine = cute.make_tensor(vals.iterator, cute.make_layout((4, n // 4)))
        if split != 0:
            cute.autovec_copy(mine, cute.make_tensor(part, layout)[None, tid])
        cute.arch.cluster_arrive()  # release: this CTA's partial is in its shared memory
        cute.arch.cluster_wait()  # acquire: so are the peers'
        first = Int32(0)
        if split == 0:
            peer = cute.make_rmem_tensor((4, n // 4), Float32)
            for j in cutlass.range_constexpr(1, splits):
                cute.autovec_copy(cute.make_tensor(cute.arch.map_dsmem_ptr(part, j), layout)[None, tid], peer)
                for i in cutlass.range_constexpr(n):
                    mine[i] = mine[i] + peer[i]
            first = Int32(1)
        cute.arch.cluster_arrive()  # done reading the peers
        return first

    return types.SimpleNamespace(ld_dsmem_f32=ld_dsmem_f32, cluster_sum=cluster_sum)
