"""Hopper (sm_90a) GEMMs on NVFP4 weights, in CuTeDSL: W4A16 (decode) and W4A8 (prefill).

Hopper has no FP4 tensor cores: the packed E2M1 weights are decoded in registers and fed to
WGMMA as the register-sourced A operand. The problem is computed transposed,
``out^T[N, M] = W[N, K] · x^T``: weight rows fill the 64-row WGMMA M, tokens the WGMMA N
(8..256), so a decode batch of one token still uses a legal (if mostly idle) MMA while the
kernel streams the weight bytes.

* **W4A16**: ``x`` bf16 (decode batches of ``M <= 8``, and of ``M <= 16`` on one-wave weights, run
  the GEMV of :mod:`.nvfp4_gemv` on the same prepared weight instead: :func:`.nvfp4_gemv.use_gemv`). Each E2M1
  code becomes a bf16 by bit placement (``e2m1 · 2^-126``; the code 0.5 is a bf16 subnormal), times
  the block scale re-encoded at load time as ``s_b · 2^119`` in bf16, one ``mul.bf16x2`` per pair:
  the product ``e2m1 · s_b · 2^-7`` is exact. ``acc · (s_g · 2^7)`` in the epilogue.
* **W4A8**: ``x`` quantized per token to E4M3 (:mod:`quantkit.formats.w4a8`); each code becomes
  an f16 ``e2m1 · 2^-14``, times ``s_b · 2^(14-c_n)`` (one ``mul.f16x2``: exactly
  ``e2m1 · s_b · 2^-c_n``), rounded once to E4M3 (``cvt.rn.satfinite.e4m3x2.f16x2``); FP8 WGMMA.
  Both kernels read the same prepared weight: the activations' K order is permuted within each
  32-column group (:func:`w4a8_k_permutation`) so that the FP8 fragment slots line up with the
  bytes each thread holds.

Weight layout (:func:`prepare`): one 4608-byte tile per (64 weight rows, 128 K): 4096 bytes of
codes in WGMMA-fragment order (thread ``t`` reads 16 bytes at ``t·16`` and ``2048 + t·16``; one
32-bit word per thread and 16-K block holding the thread's 8 values, bits placed so that 11
shift/logic instructions decode them), then 512 bytes of re-encoded block scales (one 16-byte
word per group of 4 threads). Rows are padded to a multiple of 128.

Structure: per CTA, 1 or 2 consumer warpgroups (64 weight rows each) and a producer warpgroup
whose first warp moves each stage with ``cp.async.bulk`` (weights) and a TMA tile load
(activations) onto one mbarrier (with 2 consumer warpgroups and >= 128 tokens, ``setmaxnreg``
moves its registers to the consumers). Consumers decode one 16-K (W4A8: 32-K) block, issue its
WGMMA, and wait only for the WGMMA that last read the registers they overwrite next; nothing
but the k-loop branches between WGMMAs (ptxas would serialize them). Split-K across CTAs
(``grid.z``) for decode grids: each CTA writes its FP32 partial tile, the last to arrive
(per-tile counter, reset to 0 by it) loads all partials at once and sums them in split order
(deterministic); where one split CTA fills its SM, the splits launch as one thread-block cluster
instead (``Config.cluster``) and split 0 adds its peers' partials from their shared memory. Then
the epilogue: alpha, bias and activation (incl. interleaved SwiGLU)
in registers, then the tile goes through shared memory (as bf16 outputs, or FP32 where the
residual follows), transposed to the output's row order, so each thread adds the residual to 8
consecutive outputs and writes them with one 16-byte store. Large prefill grids run persistent
(``Config.persistent``): one CTA per SM loops over the output tiles, the producer loading the next
tile while the consumers stage the epilogue in memory beside the pipeline (else in the drained
pipeline). Host launches go through CuTeDSL's tvm-ffi executors where apache-tvm-ffi is installed
(:func:`quantkit.kernels.cache.use_tvm_ffi`).
"""
import functools
import math
from dataclasses import dataclass

import torch

from quantkit.kernels.cache import data_ptr, launch_stream, num_sms, use_tvm_ffi
from quantkit.kernels.epilogue import SWIGLU_GROUP, Epilogue, epilogue_operands
from quantkit.kernels.ops import kernel_op
from quantkit.kernels.sm90 import split_k

BK = 128  # K per pipeline stage
ROWS = 64  # weight rows per warpgroup (WGMMA M)
CODE_BYTES = ROWS * BK // 2
SCALE_BYTES = ROWS * BK // 16
TILE_BYTES = CODE_BYTES + SCALE_BYTES
ROW_PAD = 2 * ROWS  # prepared rows are a multiple of this (whole 2-warpgroup CTAs, SwiGLU pairs)
W16_EXP_BIAS = 236  # scale byte t -> bf16 bits (t << 4) + (236 << 7) = s_b * 2^119
W8_EXP_BIAS = 19  # scale byte t -> f16 bits (t << 7) + ((19 - c_n) << 10) = s_b * 2^(14 - c_n)
_GELU_C = 2.0 * math.sqrt(2.0 / math.pi)  # gelu_tanh(x) = x * sigmoid(_GELU_C * (x + 0.044715 x^3))

# ---------------------------------------------------------------------------------------- layout
# A k16 word holds the 8 values of one thread for one 16-K block, as 4 bf16x2 WGMMA registers:
# pair 0 = (row r, k, k+1), pair 1 = (row r+8, k, k+1), pair 2 = (row r, k+8, k+9),
# pair 3 = (row r+8, k+8, k+9), with r = 16*warp + lane//4 and k = 2*(lane%4).
# Decoding pair j puts its lo value's E2M1 bits (m, e0, e1, sign) at bf16 bits (6, 7, 8, 15)
# and its hi value's at (22, 23, 24, 31): magnitude bits come from rotl(word, MAG_ROT[j]),
# sign bits from rotl(word, SIGN_ROT[j]) (a rotation search found this 11-instruction set).
MAG_ROT = (0, 3, 6, 13)
SIGN_ROT = (0, 3, 1, 2)
_OUT_BITS = ((6, 7, 8, 15), (22, 23, 24, 31))  # (lo, hi) value: bf16 bit of code bits 0..3


def _source_bits() -> tuple[tuple[int, ...], ...]:
    """``src[v][i]``: the word bit holding code bit ``i`` of value ``v = 2*pair + (0 lo | 1 hi)``."""
    src = []
    for j in range(4):
        for half in range(2):
            src.append(tuple((bit - (SIGN_ROT[j] if i == 3 else MAG_ROT[j])) % 32 for i, bit in enumerate(_OUT_BITS[half])))
    flat = sorted(b for v in src for b in v)
    assert flat == list(range(32)), "decode bit layout must use every word bit exactly once"
    return tuple(src)


SOURCE_BITS = _source_bits()


def encode_scales(scale: torch.Tensor) -> torch.Tensor:
    """uint8 bytes ``t = (E + 10) << 3 | m`` for E4M3 block scales ``s = 2^E · (1 + m/8)`` (E4M3
    subnormals renormalized; ``t = 0`` for ``s = 0``): the kernels' scale byte, any shape."""
    s = scale.float()
    frac, exp = torch.frexp(torch.where(s > 0, s, torch.ones_like(s)))  # s = frac * 2^exp, frac in [.5, 1)
    t = ((exp - 1 + 10) << 3) | (frac * 16 - 8).to(torch.int32)
    return torch.where(s > 0, t, torch.zeros_like(t)).to(torch.uint8)


def decode_scales(t: torch.Tensor) -> torch.Tensor:
    """FP32 block scales from :func:`encode_scales` bytes (inverse on E4M3 values)."""
    t = t.to(torch.int32)
    val = torch.ldexp(1 + (t & 7).float() / 8, ((t >> 3) - 10).float())
    return torch.where(t > 0, val, torch.zeros_like(val))


def _fragment_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [128, 8], k [8, 128, 8]) within a 64x128 tile of value ``v`` of thread ``t`` in
    16-K block ``b``: rows r, r, r+8, r+8, r, r, r+8, r+8 and k offsets 0, 1, 0, 1, 8, 9, 8, 9."""
    t = torch.arange(128, device=device)
    r = 16 * (t // 32) + (t % 32) // 4
    c = t % 4
    dv_row = torch.tensor([0, 0, 8, 8, 0, 0, 8, 8], device=device)
    dv_k = torch.tensor([0, 1, 0, 1, 8, 9, 8, 9], device=device)
    row = r[:, None] + dv_row[None, :]
    k = 16 * torch.arange(8, device=device)[:, None, None] + (2 * c)[None, :, None] + dv_k[None, None, :]
    return row, k


@dataclass
class Nvfp4Sm90Weight:
    """An NVFP4 weight ``[N, K]`` re-laid for these kernels (:func:`prepare`).

    ``tiles``: uint8 ``[N_pad/64, K/128, 4608]``; ``row_exp``: int32 ``[N_pad]`` (W4A8 ``c_n``);
    ``tensor_scale``: FP32 ``[1]``; ``n``, ``k``: the logical shape (``N_pad = roundup(N, 128)``)."""

    tiles: torch.Tensor
    row_exp: torch.Tensor
    tensor_scale: torch.Tensor
    n: int
    k: int


def prepare(packed: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor) -> Nvfp4Sm90Weight:
    """Re-lay an NVFP4 weight (packed E2M1 ``uint8 [N, K/2]``, E4M3 block scales ``[N, K/16]``,
    FP32 tensor scale) into the tile layout both kernels load (see the module docstring).
    Codes of blocks whose scale is zero are set to zero (same dequantized weight). K must be a
    multiple of 128. Runs on the tensors' device; do it once, at load time."""
    from quantkit.formats.codecs import unpack_nibbles
    from quantkit.formats.w4a8 import row_exponents

    n, half_k = packed.shape
    k = 2 * half_k
    if packed.dtype != torch.uint8 or k % BK or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"expected uint8 [N, K/2] codes with K % {BK} == 0 and scales [N, K/16]; got "
                         f"{packed.dtype} {tuple(packed.shape)}, scales {tuple(scale.shape)}")
    scale = scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale
    dev = packed.device
    n_pad = -(-n // ROW_PAD) * ROW_PAD
    codes = unpack_nibbles(packed).view(n, k // 16, 16)
    codes = torch.where((scale.float() == 0)[..., None], torch.zeros_like(codes), codes).view(n, k)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, n_pad - n))
    t_bytes = torch.nn.functional.pad(encode_scales(scale), (0, 0, 0, n_pad - n))
    nb, kt = n_pad // ROWS, k // BK

    row, kk = _fragment_index(dev)  # [128, 8], [8, 128, 8]
    tiles = codes.view(nb, ROWS, kt, BK).permute(0, 2, 1, 3)  # [nb, kt, 64, 128]
    words = torch.zeros(nb, kt, 8, 128, dtype=torch.int64, device=dev)  # [.., k16 block b, thread t]
    for v, src in enumerate(SOURCE_BITS):
        vals = tiles[:, :, row[None, :, v].expand(8, -1), kk[..., v]].to(torch.int64)  # value v of (b, t)
        for i, bit in enumerate(src):
            words |= ((vals >> i) & 1) << bit
    words = words.view(nb, kt, 2, 4, 128).permute(0, 1, 2, 4, 3)  # word (b//4, t, b%4)
    code_bytes = _int32_bytes(words.reshape(nb, kt, CODE_BYTES // 4))

    # scales: quad q = 8*warp + lane//4 (rows r = 16*(q//8) + q%8 and r+8) owns 16 bytes:
    # word j = (t[r, 2j], t[r, 2j+1], t[r+8, 2j], t[r+8, 2j+1])
    q = torch.arange(32, device=dev)
    r = 16 * (q // 8) + q % 8
    e = torch.arange(4, device=dev)
    srow = r[:, None, None] + 8 * (e // 2)[None, None, :]  # [32, 1, 4]
    sblk = 2 * torch.arange(4, device=dev)[None, :, None] + (e % 2)[None, None, :]  # [1, 4, 4]
    stile = t_bytes.view(nb, ROWS, kt, BK // 16).permute(0, 2, 1, 3)  # [nb, kt, 64, 8]
    scale_bytes = stile[:, :, srow.expand(-1, 4, -1), sblk.expand(32, -1, -1)].reshape(nb, kt, SCALE_BYTES)

    row_exp = torch.nn.functional.pad(row_exponents(scale), (0, n_pad - n))
    ts = tensor_scale.detach().float().reshape(1).to(dev)
    return Nvfp4Sm90Weight(torch.cat([code_bytes, scale_bytes], dim=-1).contiguous(), row_exp.contiguous(), ts, n, k)


def _int32_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 32-bit words ``[..., W]`` -> little-endian uint8 ``[..., 4W]``."""
    shifts = torch.arange(0, 32, 8, device=words.device)
    return ((words[..., None] >> shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unprepare(w: Nvfp4Sm90Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`prepare` on its codes and scales: (packed ``uint8 [N, K/2]``, FP32 block
    scales ``[N, K/16]``), for round-trip checks."""
    from quantkit.formats.codecs import pack_nibbles

    tiles = w.tiles
    nb, kt, _ = tiles.shape
    dev = tiles.device
    raw = tiles[..., :CODE_BYTES].to(torch.int64).view(nb, kt, CODE_BYTES // 4, 4)
    words = (raw << torch.arange(0, 32, 8, device=dev)).sum(-1)  # [nb, kt, 1024]
    words = words.view(nb, kt, 2, 128, 4).permute(0, 1, 2, 4, 3).reshape(nb, kt, 8, 128)  # [.., b, t]
    src = torch.tensor(SOURCE_BITS, device=dev, dtype=torch.int64)  # [v, bit]
    vals = ((words[..., None, None] >> src) & 1) << torch.arange(4, device=dev)  # [.., b, t, v, bit]
    vals = vals.sum(-1)  # [nb, kt, b, t, v]
    row, kk = _fragment_index(dev)
    codes = torch.zeros(nb, kt, ROWS, BK, dtype=torch.int64, device=dev)
    codes[:, :, row[None].expand(8, -1, -1), kk] = vals
    codes = codes.permute(0, 2, 1, 3).reshape(nb * ROWS, kt * BK)[: w.n].to(torch.uint8)

    q = torch.arange(32, device=dev)
    r = 16 * (q // 8) + q % 8
    e = torch.arange(4, device=dev)
    srow = (r[:, None, None] + 8 * (e // 2)[None, None, :]).expand(-1, 4, -1)
    sblk = (2 * torch.arange(4, device=dev)[None, :, None] + (e % 2)[None, None, :]).expand(32, -1, -1)
    stile = torch.zeros(nb, kt, ROWS, BK // 16, dtype=torch.uint8, device=dev)
    stile[:, :, srow, sblk] = tiles[..., CODE_BYTES:].view(nb, kt, 32, 4, 4)
    t_bytes = stile.permute(0, 2, 1, 3).reshape(nb * ROWS, kt * BK // 16)[: w.n]
    return pack_nibbles(codes), decode_scales(t_bytes)


@functools.lru_cache(maxsize=64)
def w4a8_k_permutation(k: int, device=None) -> torch.Tensor:
    """int64 ``[K]``: the W4A8 kernel reads ``x[:, perm]``. Within each 32-column group, FP8
    fragment slot ``4c + j`` (and ``16 + 4c + j``) holds column ``(2c, 2c+1, 2c+8, 2c+9)[j]``
    (plus 16): the columns the bf16 layout gives thread ``c``."""
    c = torch.arange(4)
    cols = torch.stack([2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9], dim=1).reshape(16)
    group = torch.cat([cols, cols + 16])
    return (torch.arange(0, k, 32)[:, None] + group[None, :]).reshape(k).to(device)


# ---------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Config:
    """Launch shape: ``bn`` tokens per CTA (WGMMA N), ``warpgroups`` consumer warpgroups (64 weight
    rows each), ``stages`` pipeline depth, ``splits`` K-splits across CTAs; ``pdl`` and
    ``batched`` select code variants (see the fields)."""

    bn: int
    warpgroups: int
    stages: int
    splits: int
    # Options compiled and CPU-checked but not yet timed or checked on a GPU (off by default):
    pdl: bool = False  # programmatic dependent launch: weights stream before the previous kernel ends
    batched: bool = False  # per stage: decode every k-block, then issue all WGMMAs
    # Measured on the H200 (pick_config's prefill tiles): one CTA per SM looping over the output
    # tiles; the producer loads the next tile's first stages while the consumers run the epilogue,
    # staged in shared memory of its own (no K-split, no PDL); and the order of those tiles.
    persistent: bool = False
    tokens_fastest: bool = False  # persistent tile order: token tiles fastest (default: weight row blocks)
    # The ``splits`` CTAs of a tile form one thread-block cluster: split 0 adds the others' partials
    # from their shared memory (distributed shared memory) instead of the global split-K turnstile.
    cluster: bool = False

    def check(self, epilogue: Epilogue, w4a8: bool) -> None:
        """Raise ValueError if this config cannot run ``epilogue`` in this mode (W4A8 or W4A16)."""
        if self.bn not in (8, 16, 32, 64, 128, 256) or self.warpgroups not in (1, 2) or self.stages < 3 or self.splits < 1:
            raise ValueError(f"unsupported config {self}")
        if (self.persistent and (self.splits > 1 or self.pdl)) or (self.tokens_fastest and not self.persistent):
            raise ValueError(f"{self}: a persistent config has no K-split and no PDL (tile order: persistent only)")
        if self.cluster and not (2 <= self.splits <= 8 and self.stages >= (2 if w4a8 else 1) * self.warpgroups):
            raise ValueError(f"{self}: a cluster split needs 2..8 splits, and its partial tile must fit the "
                             "activation stages it reuses (W4A8: stages >= 2 x warpgroups)")
        need = self.stages * stage_bytes(self.bn, self.warpgroups, w4a8) + _SMEM_RESERVE + exchange_bytes(self, epilogue)
        if need > _SMEM or staging_tokens(self, epilogue, w4a8) < 8:
            raise ValueError(f"{self} needs {need} bytes of shared memory in {'W4A8' if w4a8 else 'W4A16'} mode"
                             f"{' and room to stage the output' if self.persistent else ''}; an sm90 CTA has "
                             f"{_SMEM}: use fewer stages")
        if epilogue.activation == "swiglu" and self.warpgroups != 2:
            raise ValueError("swiglu needs 2 warpgroups (the gate and up halves of a 128-row group)")
        if epilogue.requant is not None:
            raise ValueError("the NVFP4 sm90 kernels write bf16 only (no requant epilogue)")


_SMEM = 227 * 1024  # per CTA (sm90 opt-in maximum)
STAGE_ROW = ROWS + 4  # floats per token row of the FP32 output staging tile (+4: no bank conflicts)
STAGE_ROW16 = ROWS + 8  # halves per token row of the bf16 staging tile (16-byte rows, no bank conflicts)
_SMEM_RESERVE = 4096  # barriers and alignment padding beside the pipeline stages


def fits(config: Config, epilogue: Epilogue, w4a8: bool) -> bool:
    """Whether ``config`` can run ``epilogue`` in this mode (passes :meth:`Config.check`)."""
    try:
        config.check(epilogue, w4a8)
    except ValueError:
        return False
    return True


def stage_bytes(bn: int, warpgroups: int, w4a8: bool) -> int:
    """Shared memory of one pipeline stage: each warpgroup's weight tile plus the [bn, BK]
    activation tile (FP8 in W4A8, bf16 in W4A16)."""
    return warpgroups * TILE_BYTES + bn * BK * (1 if w4a8 else 2)


def max_stages(bn: int, warpgroups: int, w4a8: bool, ctas_per_sm: int = 1) -> int:
    """The most pipeline stages that leave room for ``ctas_per_sm`` such (non-persistent) CTAs on an SM."""
    return (_SMEM // ctas_per_sm - _SMEM_RESERVE) // stage_bytes(bn, warpgroups, w4a8)


def exchange_bytes(config: Config, epilogue: Epilogue) -> int:
    """Shared memory of its own in which SwiGLU's up half (warpgroup 1) meets its gate half, FP32
    ``[bn/2, 128]``: in a persistent CTA only, whose pipeline already fills for the next tile; the
    others exchange in their drained activation stages (at least ``2 * bn * 128`` bytes)."""
    return 128 * (config.bn // 2) * 4 if epilogue.activation == "swiglu" and config.persistent else 0


def staging_row_bytes(epilogue: Epilogue) -> int:
    """Bytes per token of a warpgroup's ``[tokens, 64]`` output staging tile: bf16 outputs (rows of
    ``STAGE_ROW16`` halves), or FP32 (``STAGE_ROW`` floats) where the residual is added after
    staging, so the output is still rounded once."""
    return STAGE_ROW * 4 if epilogue.residual else STAGE_ROW16 * 2


def staging_tokens(config: Config, epilogue: Epilogue, w4a8: bool) -> int:
    """Tokens per pass of the epilogue's output staging tile (:func:`staging_row_bytes` per token
    and warpgroup): the most (a power of two, at most ``bn``) that fit the drained pipeline's
    shared memory, or in a persistent kernel the memory the stages and the SwiGLU exchange leave
    (the pipeline is then already filling for the next tile)."""
    pipe = config.stages * stage_bytes(config.bn, config.warpgroups, w4a8)
    room = _SMEM - _SMEM_RESERVE - pipe - exchange_bytes(config, epilogue) if config.persistent else pipe
    tokens = config.bn
    while tokens and config.warpgroups * tokens * staging_row_bytes(epilogue) > room:
        tokens //= 2
    return tokens


def pick_config(m: int, n_pad: int, k: int, epilogue: Epilogue, w4a8: bool, num_sms: int = 132) -> Config:
    """Tile, depth and K-split for ``x[m, k] @ w[n_pad, k].T`` (rules fitted to the H200 sweep in
    ``benchmarks/notes/nvfp4.md``).

    * Tokens: the smallest WGMMA N holding ``m``; beyond 64, 128, then 256 where
      :func:`w4a8_tile256` (W4A8; H100 tune, session 46: at 256-512 tokens 1.0-1.17x the per-tile
      cost table fitted to an older H200 sweep) or :func:`w4a16_tile256` (W4A16) says.
    * Warpgroups (64 weight rows each, sharing the activation tile): 2 for SwiGLU, for 16-32
      token tiles, for 64-token tiles of very tall weights (and, W4A16, of one-wave weights with
      >= 48 k-tiles, with 2 K-splits: H100 A/B, session 31, 6-7 % faster), and for 128- and
      256-token tiles where :func:`two_warpgroups_pay` (for W4A8 too: the best tile at 27 of 27
      points of session 46's tune, ties within 2 % aside); else 1.
    * K-splits, decode: double while the grid has fewer than 2 (8 tokens), 1.5 (16-32) or 0.5
      (64) CTAs per SM and each split keeps at least 4 stages. Where a split CTA fills its SM
      (64-token tiles in one wave), the splits meet in a thread-block cluster (H100 A/B, session
      31: 10-22 % faster than the turnstile; with several CTAs per SM 13-44 % slower). W4A16 at
      16-32 tokens: :func:`short_split_layout` reshapes the grid.
    * K-splits, W4A8 one-warpgroup 256-token grids of at most half a wave: 2, as a cluster (H100
      tune, session 46: 4096x14336 at 256 tokens 1.27x faster than 128-token tiles; 4096x4096
      within 2 % of them); GPU-checked in session 47.
    * K-splits, W4A16 128-token grids of at most half a wave (narrow weights, no SwiGLU): double
      while each split keeps >= 8 k-tiles and the grid stays one wave, within 90 % of the SMs for
      clusters of >= 4 (GPC packing); always as clusters of <= 8 (H100 tune, session 44:
      1.25-2.26x faster at 65-256 tokens on 1024-4096-row weights; 4-clusters of 128 CTAs
      1.3-1.5x slower than 2).
    * Stages: 8 for one-warpgroup decode CTAs (4 CTAs per SM), 4 for two; larger tiles fill all
      of the shared memory; 64-token tiles half of it (two CTAs per SM) unless the grid fits one
      wave and, for two warpgroups, each split runs >= 24 k-tiles (H100 session 25: then up to
      19 % faster, at worst 3 % slower; two-warpgroup tiles on shorter splits 3-12 % slower).
    * Persistent: W4A16 two-warpgroup 128- and 256-token grids of more tiles than SMs, W4A8
      256-token grids of any size but split ones (SwiGLU's beyond one wave); see the comment below."""
    rows = n_pad // ROWS
    swiglu = epilogue.activation == "swiglu"
    if m <= 32:
        bn = next(b for b in (8, 16, 32) if m <= b)
    elif m <= 64:
        bn = 64
    elif w4a8:
        bn = 256 if m > 128 and w4a8_tile256(m, rows, num_sms) else 128
    else:
        bn = 256 if w4a16_tile256(m, rows, num_sms) else 128
    m_tiles = -(-m // bn)
    if bn <= 32:
        wgs = 2 if (swiglu or bn >= 16) else 1
    elif bn == 64:
        wgs = 2 if (swiglu or rows >= 4 * num_sms) else 1
    else:  # 128 and 256 tokens
        wgs = 2 if (swiglu or two_warpgroups_pay(rows, m_tiles, num_sms)) else 1
    ctas = (rows // wgs) * m_tiles
    k_tiles = k // BK
    splits = 1
    target = {8: 2 * num_sms, 16: 1.5 * num_sms, 32: 1.5 * num_sms, 64: num_sms // 2}.get(bn, 0)
    while ctas * splits < target and k_tiles // (2 * splits) >= 4:
        splits *= 2
    if bn == 64 and not w4a8 and wgs * splits == 1 and ctas <= num_sms and k_tiles // 2 >= 24:
        wgs, splits, ctas = 2, 2, ctas // 2  # one wave: two warpgroups share each activation tile, K in halves
    if bn == 256 and w4a8 and wgs == 1 and 2 * ctas <= num_sms and k_tiles // 2 >= 8:
        splits = 2  # half-wave one-warpgroup grids: K in halves meeting in a cluster
    if bn == 128 and not (w4a8 or swiglu):  # grids of at most half a wave: K-splits, as clusters, keeping one wave
        while (splits < 8 and k_tiles // (2 * splits) >= 8
               and ctas * 2 * splits <= (num_sms if splits == 1 else 0.9 * num_sms)):
            splits *= 2
    cluster = False
    if bn <= 32:
        stages = 8 if wgs == 1 else 4
        if bn >= 16 and not w4a8:
            wgs, splits, stages, cluster = short_split_layout(bn, rows, m_tiles, k_tiles, splits, epilogue, num_sms)
    else:
        # 64-token tiles: two CTAs per SM unless the grid fits one wave and the ring pays (H100 A/B)
        two_per_sm = bn == 64 and (ctas * splits > num_sms or (wgs == 2 and k_tiles // splits < 24))
        stages = max(3, min(8, max_stages(bn, wgs, w4a8, 2 if two_per_sm else 1)))
        cluster = 1 < splits <= 8 and not two_per_sm  # a cluster holds at most 8 CTAs
    if ((w4a8 and bn == 256 and splits == 1 and (ctas > num_sms or not swiglu))
            or (not w4a8 and wgs == 2 and bn >= 128 and ctas > num_sms)):
        # persistent CTAs (H200 A/Bs, benchmarks/notes/nvfp4.md session 13; W4A8 in any grid but
        # SwiGLU's one-wave ones: H100 tune, session 46, 3-10 % faster in one wave too, 3-7 % for
        # one-warpgroup CTAs): 4 stages (W4A16 beyond 1024 tokens and W4A8 two-warpgroup CTAs but
        # for token tiles fastest: 5; W4A8 one-warpgroup CTAs: 6), fewer where staging
        # room runs out (SwiGLU's exchange; W4A16 256-token tiles: 3, with SwiGLU none: one CTA per
        # tile, exchanging in the drained stages). W4A8 grids of more tiles than
        # SMs visit the token tiles of a weight row block first where the weight outweighs the FP8
        # activations (so those stay in L2), else the row blocks of a token tile first; W4A8
        # one-warpgroup grids always row blocks first (session 47: token tiles first 0.92-1.21x the time,
        # 1.1-1.2x at 384-1152 tokens, where the last token tile is partly padding).
        tokens_fastest = w4a8 and wgs == 2 and ctas > num_sms and 9 * n_pad > 16 * m
        first = (6 if wgs == 1 else (4 if tokens_fastest else 5)) if w4a8 else (4 if m <= 1024 else 5)
        for depth in range(first, 2, -1):
            cfg = Config(bn, wgs, depth, 1, persistent=True, tokens_fastest=tokens_fastest)
            if fits(cfg, epilogue, w4a8):
                return cfg
    return Config(bn, wgs, stages, splits, cluster=cluster)


def tile256_pads_no_more(m: int) -> bool:
    """Whether 256-token tiles over ``m`` tokens pad no more rows than 128-token tiles, or at most
    1/16 more (from 2048 tokens)."""
    return 2 * -(-m // 256) == -(-m // 128) or m >= 2048


def w4a8_tile256(m: int, rows: int, num_sms: int) -> bool:
    """Whether W4A8 ``m`` (> 128) tokens over ``rows`` 64-row weight blocks run 256-token tiles:
    where they pad no more than 128-token tiles; else where they take fewer waves than 128-token
    tiles (each tile with the warpgroups :func:`two_warpgroups_pay` gives it), or as many beyond
    one (where the 256-token grid runs persistent and the 128-token one cannot gain by it). H100
    tunes, session 47, at 384, 640 and 1152 tokens on 9 weights: 128-token tiles 1.03-1.25x
    faster where they take fewer waves or both one, 256-token ones 1.05-1.54x faster where they
    take fewer waves or as many beyond one."""
    if tile256_pads_no_more(m):
        return True

    def waves(bn: int) -> int:
        m_tiles = -(-m // bn)
        wgs = 2 if two_warpgroups_pay(rows, m_tiles, num_sms) else 1
        return -(-(rows // wgs) * m_tiles // num_sms)
    w256, w128 = waves(256), waves(128)
    return w256 < w128 or w256 == w128 > 1


def w4a16_tile256(m: int, rows: int, num_sms: int) -> bool:
    """Whether W4A16 ``m`` tokens over ``rows`` 64-row weight blocks run 256-token tiles, each
    decoded weight fragment serving twice the tokens: beyond 128 tokens, where they pad no more
    rows than 128-token tiles (from 2048 tokens: at most 1/16 more) and take two-warpgroup CTAs
    (:func:`two_warpgroups_pay`). H100, session 45: at 129-256 tokens 1.00-1.27x the best
    128-token layout (20 points, 10240-57344-row weights; on one warpgroup 0.90-1.08x); at
    512-4096 tokens 1.02-1.22x the rule before (tunes, 14 points on 4096-28672-row weights); at
    384 (1.5 tiles) and on half-wave grids slower. SwiGLU (one CTA per tile, 3 stages; session
    46, gate/up of 2048-8192 x 16384-57344): 1.04-1.20x the 128-token rule from 512 tokens, at
    256 tokens 0.95-1.12x."""
    m_tiles = -(-m // 256)
    return m > 128 and tile256_pads_no_more(m) and two_warpgroups_pay(rows, m_tiles, num_sms)


def two_warpgroups_pay(rows: int, m_tiles: int, num_sms: int) -> bool:
    """Whether ``m_tiles`` W4A16 token tiles (128 or 256 tokens) over ``rows`` 64-row weight blocks
    run faster in two-warpgroup CTAs: where those take fewer waves, counting one as 1.5 waves of
    one-warpgroup CTAs (a one-wave two-warpgroup CTA measured 1.40-1.59x the time; H100 tunes,
    session 44: one wave of them against two of 64 rows 1.12-1.42x faster, two against three
    1.05-1.11x slower)."""
    waves_1, waves_2 = (-(-(rows // w) * m_tiles // num_sms) for w in (1, 2))
    return 1.5 * waves_2 < waves_1


def short_split_layout(bn: int, rows: int, m_tiles: int, k_tiles: int, splits: int, epilogue: Epilogue,
                       num_sms: int) -> tuple[int, int, int, bool]:
    """``(warpgroups, splits, stages, cluster)`` of a W4A16 16-32-token (``bn``) grid over ``rows``
    64-row weight blocks and ``m_tiles`` token tiles, in two-warpgroup CTAs that the K-split rule
    gave ``splits`` turnstile splits of ``k_tiles // splits`` k-tiles (H100 A/Bs,
    ``benchmarks/notes/nvfp4.md`` sessions 32 and 34):

    * runs of <= 7 k-tiles: one wave of SM-filling one-warpgroup CTAs (SwiGLU: two), unsplit or as
      2-split clusters of >= 14 k-tiles, where they fill at least half the SMs (3072-6144 x
      3584-4096 weights at 24-32 tokens: 2-39 % faster; 4-split or 56-224-k-tile one-warpgroup
      grids were slower);
    * 32-token runs of 8-16 k-tiles on 2/3 to one wave of CTAs per split: 2 splits as clusters of
      SM-filling CTAs (five weights of 5632-8192 x 5120-8192: -23 % to +1 %; 8192x28672's 56-k-tile
      runs +5 %, left out);
    * 17-32 tokens (the 32-token tile), other runs of <= 16 k-tiles (no SwiGLU): one-warpgroup CTAs
      at half the splits, as many CTAs with runs twice as long, turnstile, 4 stages (session 34, 18
      weights of 1024-18944 x 2048-28672 at 24 and 32 tokens: 4-45 % faster; on 18- and 56-k-tile
      runs 3-8 % slower, left out);
    * otherwise the turnstile's grid, its splits meeting in a cluster where the grid has more CTAs
      than SMs and fewer than 90 % of two per SM, or more than two per SM (10240x8192, 3584x18944,
      14336x4096: 0-17 % faster; at 256 CTAs 21-40 % slower, at <= 128 up to 24 % slower). The
      turnstile's CTAs spread over the SMs; a cluster's are packed into its GPC, up to the 2 per SM
      these kernels' registers allow, and beyond ~94 % of those slots its last clusters wait for a
      second wave (ncu)."""
    ctas = rows // 2 * m_tiles
    runs = k_tiles // splits  # k-tiles per turnstile split
    swiglu = epilogue.activation == "swiglu"
    if runs <= 7:
        wgs = 2 if swiglu else 1
        one_ctas = rows // wgs * m_tiles
        one_splits = 2 if 2 * one_ctas <= num_sms else 1
        if num_sms <= 2 * one_ctas * one_splits <= 2 * num_sms and k_tiles // one_splits >= 14:
            return wgs, one_splits, min(16, max_stages(bn, wgs, False)), one_splits > 1
    elif bn == 32 and runs <= 16 and 2 * num_sms <= 6 * ctas <= 3 * num_sms:
        return 2, 2, min(16, max_stages(bn, 2, False)), True
    if bn == 32 and not swiglu and splits >= 2 and runs <= 16:
        return 1, splits // 2, 4, False
    if runs <= 7:
        return 2, splits, 4, False
    total = ctas * splits
    return 2, splits, 4, 1 < splits <= 8 and num_sms < total and not 0.9 * 2 * num_sms < total <= 2 * num_sms


# ---------------------------------------------------------------------------------------- kernel
@functools.cache
def dsl_ops():
    """CuTeDSL helpers shared by this GEMM and the decode GEMV (:mod:`.nvfp4_gemv`): inline-PTX
    wrappers, the W4A16 register decode and the epilogue activations (imports CuTeDSL)."""
    import types

    import cutlass.cute as cute
    from cutlass import Float32, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    def asm_u32(operands, asm, constraints, loc, ip):
        return Uint32(llvm.inline_asm(T.i32(), operands, asm, constraints, has_side_effects=False, loc=loc, ip=ip))

    @dsl_user_op
    def mul_x2_bcast(a, pair, hi: bool, f16: bool, *, loc=None, ip=None):
        """``a`` (bf16x2 or f16x2) times lane ``hi`` of ``pair`` broadcast to both lanes."""
        lane, ty = ("h" if hi else "l"), ("f16x2" if f16 else "bf16x2")
        asm = ("{.reg .b16 l, h; .reg .b32 bb; mov.b32 {l, h}, $2; "
               f"mov.b32 bb, {{{lane}, {lane}}}; mul.rn.{ty} $0, $1, bb;}}")
        return asm_u32([Uint32(a).ir_value(loc=loc, ip=ip), Uint32(pair).ir_value(loc=loc, ip=ip)], asm, "=r,r,r", loc, ip)

    def rotl(q, r: int):
        return q if r == 0 else (q << r) | (q >> (32 - r))

    def decode_w4a16(q, scale_word, b: int):
        """The 4 bf16x2 A-fragment registers (pairs a0..a3, ``e2m1 · s_b · 2^-7``, exact) of one
        thread's k16 word ``q`` of block ``b``; ``scale_word`` is the thread's scale word ``b // 2``."""
        e = (scale_word >> (8 * (b % 2))) & Uint32(0x00FF00FF)
        sc = e * Uint32(16) + Uint32((W16_EXP_BIAS << 7) * 0x10001)  # bf16x2 (s_b(r), s_b(r+8)) * 2^119
        return [mul_x2_bcast((rotl(q, MAG_ROT[j]) & Uint32(0x01C001C0)) | (rotl(q, SIGN_ROT[j]) & Uint32(0x80008000)),
                             sc, j % 2 == 1, False) for j in range(4)]

    def activate(x, act: str):
        """``act`` (not swiglu) of an FP32 value."""
        if act == "relu":
            return cute.arch.fmax(x, Float32(0.0))
        if act == "silu":
            return x / (1.0 + cute.math.exp(-x))
        if act == "gelu_tanh":
            return x / (1.0 + cute.math.exp(-_GELU_C * (x + 0.044715 * x * x * x)))
        return x

    return types.SimpleNamespace(asm_u32=asm_u32, mul_x2_bcast=mul_x2_bcast, rotl=rotl,
                                 decode_w4a16=decode_w4a16, activate=activate)


@functools.cache  # built on first use: importing cutlass is slow
def _kernel_class():
    """Define the CuTeDSL kernel (imports CuTeDSL; called on first compile)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
    from cutlass.cute.nvgpu import warpgroup

    ops = dsl_ops()
    _asm_u32, mul_x2_bcast, rotl = ops.asm_u32, ops.mul_x2_bcast, ops.rotl

    @dsl_user_op
    def f16x2x2_to_e4m3x4(lo, hi, *, loc=None, ip=None):
        """Four E4M3 bytes (RNE, satfinite) of two f16x2 words, element order kept."""
        asm = ("{.reg .b16 a, b; cvt.rn.satfinite.e4m3x2.f16x2 a, $1; "
               "cvt.rn.satfinite.e4m3x2.f16x2 b, $2; mov.b32 $0, {a, b};}")
        return _asm_u32([Uint32(lo).ir_value(loc=loc, ip=ip), Uint32(hi).ir_value(loc=loc, ip=ip)], asm, "=r,r,r", loc, ip)

    @dsl_user_op
    def bulk_g2s(dst_smem, src_gmem, nbytes: int, mbar_smem, *, loc=None, ip=None):
        """``cp.async.bulk`` of ``nbytes`` global -> shared, completing on the mbarrier."""
        llvm.inline_asm(
            None,
            [Int32(dst_smem).ir_value(loc=loc, ip=ip), Int64(src_gmem).ir_value(loc=loc, ip=ip),
             Int32(mbar_smem).ir_value(loc=loc, ip=ip)],
            f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {nbytes}, [$2];",
            "r,l,r", has_side_effects=True, loc=loc, ip=ip,
        )

    @dsl_user_op
    def st_global_bf16x8(addr, vals, *, loc=None, ip=None):
        """One 16-byte global store at ``addr`` of 8 FP32 values rounded to bf16 (RNE), in order."""
        llvm.inline_asm(
            None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in vals],
            "{ .reg .b32 a, b, c, d; cvt.rn.bf16x2.f32 a, $2, $1; cvt.rn.bf16x2.f32 b, $4, $3; "
            "cvt.rn.bf16x2.f32 c, $6, $5; cvt.rn.bf16x2.f32 d, $8, $7; st.global.v4.b32 [$0], {a, b, c, d}; }",
            "l,f,f,f,f,f,f,f,f", has_side_effects=True, loc=loc, ip=ip)

    @dsl_user_op
    def st_global_b32x4(addr, words, *, loc=None, ip=None):
        """One 16-byte global store at ``addr`` of 4 32-bit words, in order."""
        llvm.inline_asm(
            None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Uint32(w).ir_value(loc=loc, ip=ip) for w in words],
            "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", has_side_effects=True, loc=loc, ip=ip)

    @dsl_user_op
    def pow2(e, *, loc=None, ip=None):
        """FP32 ``2^e`` for an integer ``e`` in [-126, 127] (exact: built from the exponent bits)."""
        bits = (Int32(e) + 127) << 23
        return Float32(llvm.bitcast(T.f32(), bits.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    class Nvfp4GemmSm90:
        """One (mode, config, epilogue, bias dtype) kernel; call through ``cute.compile``."""

        def __init__(self, config: Config, epilogue: Epilogue, w4a8: bool, bias_fp32: bool, num_sms: int):
            config.check(epilogue, w4a8)
            self.cfg, self.epi, self.w4a8, self.num_sms = config, epilogue, w4a8, num_sms
            self.bias_dtype = Float32 if bias_fp32 else cutlass.BFloat16
            self.ab_dtype = cutlass.Float8E4M3FN if w4a8 else cutlass.BFloat16
            self.mma_k = BK // (32 if w4a8 else 16)  # WGMMA k-blocks per stage
            self.wgs = config.warpgroups
            self.swiglu = epilogue.activation == "swiglu"
            self.acc_n = config.bn // 2  # accumulator registers per thread
            # Producer: warp 0 of an extra warpgroup (whole warpgroups keep every SM sub-partition's
            # register share equal). Large tiles move registers from it to the consumers.
            self.producer_warp = 4 * self.wgs
            self.threads = 128 * (self.wgs + 1)
            self.rebalance = self.wgs == 2 and config.bn >= 128
            self.stage_tokens = staging_tokens(config, epilogue, w4a8)

        @cute.jit
        def __call__(self, x_ptr: Int64, tiles_ptr: Int64, exp_ptr: Int64, xs_ptr: Int64, gs_ptr: Int64,
                     out_ptr: Int64, bias_ptr: Int64, res_ptr: Int64, ws_ptr: Int64, cnt_ptr: Int64,
                     m: Int32, x_rows: Int32, n_pad: Int32, n_out: Int32, k: Int32, stream):
            gmem = cute.AddressSpace.gmem
            cfg = self.cfg
            k = cute.assume(k, divby=BK)
            n_rows = n_out * 2 if self.swiglu else n_out
            # x_rows >= m: the activation rows the TMA box may read (launch_gemm pads short token tiles)
            mX = cute.make_tensor(cute.make_ptr(self.ab_dtype, x_ptr, gmem, assumed_align=16),
                                  cute.make_layout((x_rows, k), stride=(k, 1)))
            mOut = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, out_ptr, gmem, assumed_align=16),
                                    cute.make_layout((m, n_out), stride=(n_out, 1)))
            mGs = cute.make_tensor(cute.make_ptr(Float32, gs_ptr, gmem, assumed_align=4), cute.make_layout(1))
            mExp, mXs, mBias, mRes = None, None, None, None
            if cutlass.const_expr(self.w4a8):
                mExp = cute.make_tensor(cute.make_ptr(Int32, exp_ptr, gmem, assumed_align=4), cute.make_layout(n_pad))
                mXs = cute.make_tensor(cute.make_ptr(Float32, xs_ptr, gmem, assumed_align=4), cute.make_layout(m))
            if cutlass.const_expr(self.epi.bias):
                mBias = cute.make_tensor(cute.make_ptr(self.bias_dtype, bias_ptr, gmem, assumed_align=4),
                                         cute.make_layout(n_rows))
            if cutlass.const_expr(self.epi.residual):
                mRes = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, res_ptr, gmem, assumed_align=4),
                                        cute.make_layout((m, n_out), stride=(n_out, 1)))

            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(cutlass.utils.LayoutEnum.ROW_MAJOR, self.ab_dtype, BK), self.ab_dtype)
            x_smem = cute.tile_to_shape(atom, (cfg.bn, BK, cfg.stages), order=(0, 1, 2))
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                Float32, (1, 1, 1), tiler_mn=(ROWS, cfg.bn), a_source=warpgroup.OperandSource.RMEM)
            tma_x, tX = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mX, cute.slice_(x_smem, (None, None, 0)), (cfg.bn, BK))

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[Int64, cfg.stages * 2]
                flag: cute.struct.MemRange[Int32, 4]
                wbuf: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cfg.stages * self.wgs * TILE_BYTES], 128]
                sX: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(x_smem)], 1024]
                xchg: cute.struct.Align[cute.struct.MemRange[Float32, exchange_bytes(cfg, self.epi) // 4 or 4], 16]
                stage: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.wgs * self.stage_tokens * staging_row_bytes(
                    self.epi) if cfg.persistent else 16], 16]

            self.shared_storage = SharedStorage
            n_bx = n_pad // (ROWS * self.wgs)
            grid = (n_bx, (m + cfg.bn - 1) // cfg.bn, cfg.splits)
            n_tiles = grid[0] * grid[1]
            if cutlass.const_expr(cfg.persistent):
                grid = (cutlass.min(n_tiles, self.num_sms), 1, 1)
            cluster = {"cluster": (1, 1, cfg.splits)} if cfg.cluster else {}
            self.kernel(tma_x, tX, tiles_ptr, mExp, mXs, mGs, mOut, mBias, mRes, ws_ptr, cnt_ptr,
                        m, n_out, n_rows, k, n_bx, n_tiles, tiled_mma, x_smem).launch(
                grid=grid, block=[self.threads, 1, 1], stream=stream, use_pdl=cfg.pdl, **cluster,
                # large accumulators: let ptxas use the whole register file for one CTA
                min_blocks_per_mp=1 if cfg.bn >= 128 else 0)

        @cute.kernel
        def kernel(self, tma_x: cute.CopyAtom, mX_tma: cute.Tensor, tiles_ptr: Int64,
                   mExp: cute.Tensor | None, mXs: cute.Tensor | None, mGs: cute.Tensor, mOut: cute.Tensor,
                   mBias: cute.Tensor | None, mRes: cute.Tensor | None, ws_ptr: Int64, cnt_ptr: Int64,
                   m: Int32, n_out: Int32, n_rows: Int32, k: Int32, n_bx: Int32, n_tiles: Int32,
                   tiled_mma: cute.TiledMma, x_smem: cute.ComposedLayout):
            cfg = self.cfg
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            bx, by, bz = cute.arch.block_idx()
            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_launch_dependents()  # dependents launch once all CTAs are resident
            if warp_idx == self.producer_warp:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_x)

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            x_stage_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(x_smem, (None, None, 0)))
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=cfg.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.wgs),
                tx_count=self.wgs * TILE_BYTES + x_stage_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            sX = storage.sX.get_tensor(x_smem.outer, swizzle=x_smem.inner)
            wbuf = storage.wbuf.data_ptr()

            k_tiles = k // BK
            kt_begin = bz * k_tiles // cfg.splits
            kt_end = (bz + 1) * k_tiles // cfg.splits
            pipeline_init_wait(cluster_shape_mn=(1, 1))

            if warp_idx >= self.producer_warp:
                if cutlass.const_expr(self.rebalance):
                    cute.arch.setmaxregister_decrease(40)
                if warp_idx == self.producer_warp:
                    self.producer(pipe, tma_x, mX_tma, sX, wbuf, tiles_ptr, bx, by, n_bx, n_tiles, k_tiles,
                                  kt_begin, kt_end)
            else:
                if cutlass.const_expr(self.rebalance):
                    cute.arch.setmaxregister_increase(232)
                self.consumer(pipe, tiled_mma, sX, wbuf, storage, tidx, warp_idx // 4, bx, by, bz, n_bx, n_tiles,
                              kt_begin, kt_end, mExp, mXs, mGs, mOut, mBias, mRes, ws_ptr, cnt_ptr,
                              m, n_out, n_rows)

        @cute.jit
        def producer(self, pipe, tma_x, mX_tma, sX, wbuf, tiles_ptr, bx, by, n_bx, n_tiles, k_tiles, kt_begin, kt_end):
            """One warp: per stage, the warpgroups' weight tiles (bulk copies) and the activation tile
            (TMA) onto one mbarrier; a persistent CTA does so for tiles ``bx, bx + grid, ...`` in turn."""
            cfg = self.cfg
            gX = cute.local_tile(mX_tma, (cfg.bn, BK), (None, None))
            tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(
                tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
            wbuf_addr = wbuf.toint()
            loads = (pipe, tma_x, tXgX, tXsX, wbuf_addr, tiles_ptr, k_tiles)
            if cutlass.const_expr(cfg.persistent):
                grid_x, _, _ = cute.arch.grid_dim()
                for t in cutlass.range(bx, n_tiles, grid_x, unroll=1):
                    bx_t, by_t = self.tile_coords(t, n_bx, n_tiles)
                    state = self.produce(*loads, state, bx_t, by_t, 0, k_tiles)
                pipe.producer_tail(state)
            else:
                self.produce_tile(*loads, state, bx, by, kt_begin, kt_end)

        @cute.jit
        def tile_coords(self, t, n_bx, n_tiles):
            """(weight row block, token tile) of a persistent CTA's tile ``t``."""
            if cutlass.const_expr(self.cfg.tokens_fastest):
                n_by = n_tiles // n_bx
                return t // n_by, t % n_by
            return t % n_bx, t // n_bx

        @cute.jit
        def produce_tile(self, pipe, tma_x, tXgX, tXsX, wbuf_addr, tiles_ptr, k_tiles, state, bx, by, kt_begin, kt_end):
            """The stages of one output tile (k-tiles ``kt_begin..kt_end``), then the pipeline tail."""
            cfg = self.cfg
            first = kt_begin
            if cutlass.const_expr(cfg.pdl):
                # The weights do not depend on the previous kernel: fill the pipeline with them, then
                # wait for the previous grid (it may produce x) before loading activations.
                first = cutlass.min(kt_end, kt_begin + cfg.stages)
                x_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
                for kt in cutlass.range(kt_begin, first, unroll=1):
                    pipe.producer_acquire(state)
                    self.load_weights(pipe, state, wbuf_addr, tiles_ptr, bx, k_tiles, kt)
                    state.advance()
                cute.arch.griddepcontrol_wait()
                for kt in cutlass.range(kt_begin, first, unroll=1):
                    cute.copy(tma_x, tXgX[(None, by, kt)], tXsX[(None, x_state.index)],
                              tma_bar_ptr=pipe.producer_get_barrier(x_state))
                    x_state.advance()
            state = self.produce(pipe, tma_x, tXgX, tXsX, wbuf_addr, tiles_ptr, k_tiles, state, bx, by, first, kt_end)
            pipe.producer_tail(state)

        @cute.jit
        def produce(self, pipe, tma_x, tXgX, tXsX, wbuf_addr, tiles_ptr, k_tiles, state, bx, by, kt_begin, kt_end):
            """Load k-tiles ``kt_begin..kt_end`` of tile ``(bx, by)``; returns the advanced state."""
            for kt in cutlass.range(kt_begin, kt_end, unroll=1):
                pipe.producer_acquire(state)
                self.load_weights(pipe, state, wbuf_addr, tiles_ptr, bx, k_tiles, kt)
                cute.copy(tma_x, tXgX[(None, by, kt)], tXsX[(None, state.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(state))
                pipe.producer_commit(state)
                state.advance()
            return state

        @cute.jit
        def load_weights(self, pipe, state, wbuf_addr, tiles_ptr, bx, k_tiles, kt):
            """Bulk-copy the warpgroups' weight tiles of k-tile ``kt`` into ``state``'s stage."""
            bar = pipe.producer_get_barrier(state)
            with cute.arch.elect_one():
                for wg in cutlass.range_constexpr(self.wgs):
                    src = tiles_ptr + Int64((bx * self.wgs + wg) * k_tiles + kt) * TILE_BYTES
                    dst = wbuf_addr + (state.index * self.wgs + wg) * TILE_BYTES
                    bulk_g2s(dst, src, TILE_BYTES, bar.toint())

        @cute.jit
        def consumer(self, pipe, tiled_mma, sX, wbuf, storage, tidx, wg, bx, by, bz, n_bx, n_tiles, kt_begin, kt_end,
                     mExp, mXs, mGs, mOut, mBias, mRes, ws_ptr, cnt_ptr, m, n_out, n_rows):
            """One consumer warpgroup: per output tile (a persistent CTA's tiles in turn), the
            mainloop over k-tiles ``kt_begin..kt_end`` and the epilogue."""
            cfg = self.cfg
            ct = tidx % 128
            thr_mma = tiled_mma.get_slice(ct)
            tCrA = tiled_mma.make_fragment_A(tiled_mma.partition_shape_A((ROWS, BK)))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, cfg.bn)), Float32)
            frag = cute.recast_tensor(tCrA, Uint32)
            # this warpgroup's tiles in smem, as 32-bit words: codes (4, 2, 128, stage), scales (4, 32, stage)
            words = cute.recast_ptr(wbuf, dtype=Uint32)
            tile_words = TILE_BYTES // 4
            stage_words = self.wgs * tile_words
            sCode = cute.make_tensor(words + wg * tile_words,
                                     cute.make_layout((4, 2, 128, cfg.stages), stride=(1, 512, 4, stage_words)))
            sScale = cute.make_tensor(words + wg * tile_words + CODE_BYTES // 4,
                                      cute.make_layout((4, 32, cfg.stages), stride=(1, 4, stage_words)))
            rc = cute.make_rmem_tensor((4, 2), Uint32)
            rs = cute.make_rmem_tensor((4,), Uint32)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
            ops = (pipe, tiled_mma, acc, tCrA, tCrB, frag, sCode, sScale, rc, rs, ct, thr_mma, storage, tidx, wg,
                   mExp, mXs, mGs, mOut, mBias, mRes, ws_ptr, cnt_ptr, m, n_out, n_rows)
            if cutlass.const_expr(cfg.persistent):
                grid_x, _, _ = cute.arch.grid_dim()
                for t in cutlass.range(bx, n_tiles, grid_x, unroll=1):
                    bx_t, by_t = self.tile_coords(t, n_bx, n_tiles)
                    state, release = self.tile(*ops, state, release, bx_t, by_t, bz, kt_begin, kt_end)
            else:
                self.tile(*ops, state, release, bx, by, bz, kt_begin, kt_end)

        @cute.jit
        def tile(self, pipe, tiled_mma, acc, tCrA, tCrB, frag, sCode, sScale, rc, rs, ct, thr_mma, storage, tidx, wg,
                 mExp, mXs, mGs, mOut, mBias, mRes, ws_ptr, cnt_ptr, m, n_out, n_rows,
                 state, release, bx, by, bz, kt_begin, kt_end):
            """One output tile: mainloop, then epilogue; returns the advanced pipeline states."""
            rb = bx * self.wgs + wg  # 64-row block of the weight
            krows = Uint32(0)
            if cutlass.const_expr(self.w4a8):
                r0 = rb * ROWS + 16 * (ct // 32) + (ct % 32) // 4
                c0 = Int32(W8_EXP_BIAS) - mExp[r0]
                c1 = Int32(W8_EXP_BIAS) - mExp[r0 + 8]
                krows = (Uint32(c0) << 10) | (Uint32(c1) << 26)
            acc.fill(0.0)

            # No dynamic branch may sit between WGMMAs (ptxas would serialize them), hence the first
            # stage, which has no previous stage to release, is peeled.
            ops = (pipe, tiled_mma, acc, tCrA, tCrB, frag, sCode, sScale, rc, rs, krows, ct)
            if kt_end > kt_begin:
                state, release = self.k_tile(*ops, state, release, False)
                for _kt in cutlass.range(kt_begin + 1, kt_end, unroll=1):
                    state, release = self.k_tile(*ops, state, release, True)
                warpgroup.wait_group(0)
                pipe.consumer_release(release)
                release.advance()

            self.epilogue(acc, thr_mma, storage, tidx, ct, wg, rb, bx, by, bz, mExp, mXs, mGs, mOut, mBias, mRes,
                          ws_ptr, cnt_ptr, m, n_out, n_rows)
            return state, release

        @cute.jit
        def k_tile(self, pipe, tiled_mma, acc, tCrA, tCrB, frag, sCode, sScale, rc, rs, krows, ct, state, release,
                   release_previous: cutlass.Constexpr[bool]):
            """Decode and multiply one pipeline stage (BK of K); returns the advanced states."""
            pipe.consumer_wait(state)
            stage = state.index
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(sCode[None, h, ct, stage], rc[None, h])
            cute.autovec_copy(sScale[None, ct // 4, stage], rs)
            if cutlass.const_expr(self.cfg.batched):
                # decode all k-blocks, then one WGMMA batch; the previous batch must have retired
                warpgroup.wait_group(0)
                if cutlass.const_expr(release_previous):
                    pipe.consumer_release(release)
                    release.advance()
                for b in cutlass.range_constexpr(self.mma_k):
                    self.decode(frag, rc, rs, krows, b)
                warpgroup.fence()
                for b in cutlass.range_constexpr(self.mma_k):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, b], tCrB[None, None, b, stage], acc)
                warpgroup.commit_group()
            else:
                for b in cutlass.range_constexpr(self.mma_k):
                    # the registers of k-block b were last read by the WGMMA mma_k groups back
                    warpgroup.wait_group(self.mma_k - 1)
                    if cutlass.const_expr(release_previous and b == self.mma_k - 1):
                        pipe.consumer_release(release)  # every WGMMA of the previous stage has retired
                        release.advance()
                    self.decode(frag, rc, rs, krows, b)
                    warpgroup.fence()
                    cute.gemm(tiled_mma, acc, tCrA[None, None, b], tCrB[None, None, b, stage], acc)
                    warpgroup.commit_group()
            state.advance()
            return state, release

        @cute.jit
        def decode(self, frag, rc, rs, krows, b: cutlass.Constexpr[int]):
            if cutlass.const_expr(self.w4a8):
                self.decode_w4a8(frag, rc, rs, krows, b)
            else:
                self.decode_w4a16(frag, rc, rs, b)

        @cute.jit
        def decode_w4a16(self, frag, rc, rs, b: cutlass.Constexpr[int]):
            """k16 block ``b``: 8 codes -> 4 bf16x2 registers (e2m1 * s_b * 2^-7, exact)."""
            pairs = ops.decode_w4a16(rc[b % 4, b // 4], rs[b // 2], b)
            for j in cutlass.range_constexpr(4):
                frag[(0, j % 2, j // 2), 0, b] = pairs[j]

        @cute.jit
        def decode_w4a8(self, frag, rc, rs, krows, i: cutlass.Constexpr[int]):
            """k32 block ``i`` (16-K words 2i, 2i+1): 16 codes -> 4 E4M3x4 registers."""
            for half in cutlass.range_constexpr(2):
                b = 2 * i + half
                q = rc[b % 4, b // 4]
                e = (rs[i] >> (8 * half)) & Uint32(0x00FF00FF)
                sc = e * Uint32(128) + krows  # f16x2 (s_b(r), s_b(r+8)) * 2^(14 - c)
                p = []
                for j in cutlass.range_constexpr(4):
                    # f16 wants the magnitude 3 bits higher than bf16: bits 9-11 / 25-27
                    mag = rotl(q, (MAG_ROT[j] + 3) % 32) & Uint32(0x0E000E00)
                    sign = rotl(q, SIGN_ROT[j]) & Uint32(0x80008000)
                    p.append(mul_x2_bcast(mag | sign, sc, j % 2 == 1, True))
                frag[(0, 0, half), 0, i] = f16x2x2_to_e4m3x4(p[0], p[2])  # row r: k, k+1, k+8, k+9
                frag[(0, 1, half), 0, i] = f16x2x2_to_e4m3x4(p[1], p[3])  # row r+8

        @cute.jit
        def epilogue(self, acc, thr_mma, storage, tidx, ct, wg, rb, bx, by, bz, mExp, mXs, mGs, mOut, mBias,
                     mRes, ws_ptr, cnt_ptr, m, n_out, n_rows):
            cfg = self.cfg
            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_wait()  # the previous grid may still use counters / outputs
            epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.wgs)
            flag = storage.flag.get_tensor(cute.make_layout(4))
            tid_c = wg * 128 + ct  # thread index among the CTA's consumers
            is_last = Int32(1)
            if cutlass.const_expr(cfg.cluster):
                is_last = self.cluster_sum(acc, storage, epi_bar, tid_c, bz)
            elif cutlass.const_expr(cfg.splits > 1):
                # Serial split-K (split_k.py): the last CTA of the tile to arrive sums the partials.
                grid_x, grid_y, _ = cute.arch.grid_dim()
                tile = by * grid_x + bx
                row_len = 128 * self.wgs * self.acc_n  # partial floats per tile
                mine = ws_ptr + Int64(tile * row_len + tid_c * self.acc_n) * 4
                part = cute.make_tensor(cute.make_ptr(Float32, mine, cute.AddressSpace.gmem, assumed_align=16),
                                        cute.make_layout((self.acc_n, cfg.splits), stride=(1, grid_x * grid_y * row_len)))
                counter = cute.make_ptr(Int32, cnt_ptr, cute.AddressSpace.gmem, assumed_align=4) + tile
                is_last = split_k.dsl_reduce()(cute.make_tensor(acc.iterator, cute.make_layout(self.acc_n)), part, bz,
                                               cfg.splits, counter, tid_c, flag, epi_bar.arrive_and_wait, 4)
            if is_last != 0:
                self.store(acc, thr_mma, storage, epi_bar, ct, wg, rb, bx, by, mExp, mXs, mGs, mOut, mBias, mRes,
                           m, n_out, n_rows)
            if cutlass.const_expr(cfg.cluster):
                cute.arch.cluster_wait()  # split 0 has read every peer's partial: their shared memory may go

        @cute.jit
        def cluster_sum(self, acc, storage, epi_bar, tid_c, bz):
            """Cluster split-K: splits 1.. put their partial tile in their drained activation stages,
            split 0 adds them to its own in split order (the turnstile's sums, bit for bit) and
            returns 1 (the others 0). Every consumer thread arrives once more on the cluster
            barrier, after the reads; :meth:`epilogue` waits on it before the CTA exits."""
            # with two warpgroups, both warpgroups' last WGMMAs must have read the activation stages
            barrier = epi_bar.arrive_and_wait if self.wgs == 2 else (lambda: None)
            return split_k.dsl_cluster().cluster_sum(cute.make_tensor(acc.iterator, cute.make_layout(self.acc_n)),
                                                     cute.recast_ptr(storage.sX.data_ptr(), dtype=Float32), bz,
                                                     self.cfg.splits, tid_c, 128 * self.wgs, barrier)

        @cute.jit
        def store(self, acc, thr_mma, storage, epi_bar, ct, wg, rb, bx, by, mExp, mXs, mGs, mOut, mBias, mRes,
                  m, n_out, n_rows):
            """alpha, bias, activation (incl. SwiGLU) on the FP32 tile in registers; then, through
            shared memory, transposed to the output's row order: each thread adds the residual to
            8 consecutive outputs of a token and writes them with one 16-byte store (element stores
            where ``N`` or the output address is not 16-byte aligned)."""
            cfg = self.cfg
            coord = thr_mma.partition_C(cute.make_identity_tensor((ROWS, cfg.bn)))
            row0 = rb * ROWS
            tok0 = by * cfg.bn
            # Fragment element i = (column pair d, row half h, column group j) = (i % 2, i // 2 % 2, i // 4):
            # a thread's values span 2 weight rows and bn / 4 tokens; load each row's and token's factors once.
            alpha_row = cute.make_rmem_tensor((2,), Float32)
            bias_row = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                rr = coord[2 * h][0]
                alpha_row[h] = mGs[0] * 128.0  # W4A16: the decode's 2^-7
                if cutlass.const_expr(self.w4a8):
                    alpha_row[h] = mGs[0] * pow2(mExp[row0 + rr])
                bias_row[h] = Float32(0.0)
                if cutlass.const_expr(self.epi.bias):
                    if row0 + rr < n_rows:
                        bias_row[h] = mBias[row0 + rr].to(Float32)
            xs_tok = cute.make_rmem_tensor((self.acc_n // 2,), Float32)
            if cutlass.const_expr(self.w4a8):
                for t in cutlass.range_constexpr(self.acc_n // 2):
                    tok = tok0 + coord[t % 2 + 4 * (t // 2)][1]
                    xs_tok[t] = Float32(0.0)
                    if tok < m:
                        xs_tok[t] = mXs[tok]
            for i in cutlass.range_constexpr(cute.size(acc)):
                v = acc[i] * alpha_row[i // 2 % 2]
                if cutlass.const_expr(self.w4a8):
                    v = v * xs_tok[i % 2 + 2 * (i // 4)]
                if cutlass.const_expr(self.epi.bias):
                    v = v + bias_row[i // 2 % 2]
                acc[i] = ops.activate(v, self.epi.activation)
            n_base = row0
            active = True
            if cutlass.const_expr(self.swiglu):
                xchg_layout = cute.make_layout((self.acc_n, 128), stride=(1, self.acc_n))
                if cutlass.const_expr(cfg.persistent):
                    xchg = storage.xchg.get_tensor(xchg_layout)
                else:  # in the activation stages, once both warpgroups' last WGMMAs have read them
                    epi_bar.arrive_and_wait()
                    xchg = cute.make_tensor(cute.recast_ptr(storage.sX.data_ptr(), dtype=Float32), xchg_layout)
                if wg == 1:
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        xchg[i, ct] = acc[i]
                epi_bar.arrive_and_wait()
                if wg == 0:
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        g = acc[i]
                        acc[i] = g / (1.0 + cute.math.exp(-g)) * xchg[i, ct]
                n_base = bx * SWIGLU_GROUP
                active = wg == 0

            tokens = self.stage_tokens  # per pass (staging_tokens)
            passes = cfg.bn // tokens
            base = storage.stage.data_ptr() if cutlass.const_expr(cfg.persistent) else storage.wbuf.data_ptr()
            # FP32 where the residual is added after staging, else the bf16 outputs themselves
            stage_dtype, row = (Float32, STAGE_ROW) if self.epi.residual else (cutlass.BFloat16, STAGE_ROW16)
            stage = cute.make_tensor(cute.recast_ptr(base, dtype=stage_dtype), cute.make_layout(
                ((8, 8), tokens, self.wgs), stride=((1, 8), row, tokens * row)))  # ((row, row / 8), token, wg)
            out_addr = mOut.iterator.toint()
            aligned = n_out % 8 == 0 and out_addr % 16 == 0
            per_pass = cute.size(acc) // passes
            # every warpgroup's mainloop is done (the pipeline memory is free), and in a persistent CTA
            # every thread has stored the previous tile from the staging memory
            epi_bar.arrive_and_wait()
            for p in cutlass.range_constexpr(passes):
                if active:
                    for i in cutlass.range_constexpr(p * per_pass, (p + 1) * per_pass):
                        rr, cc = coord[i]
                        stage[(rr % 8, rr // 8), cc - p * tokens, wg] = acc[i].to(stage_dtype)
                epi_bar.arrive_and_wait()
                if active:
                    for c in cutlass.range_constexpr(-(-tokens * 8 // 128)):
                        chunk = ct + 128 * c
                        tok_s = chunk // 8
                        mm = tok0 + p * tokens + tok_s
                        nn = n_base + 8 * (chunk % 8)
                        if chunk < tokens * 8 and mm < m and nn < n_out:
                            row8 = cute.make_rmem_tensor((8,), stage_dtype)
                            cute.autovec_copy(stage[(None, chunk % 8), tok_s, wg], row8)
                            full = nn + 8 <= n_out
                            addr = out_addr + (Int64(mm) * n_out + nn) * 2
                            if cutlass.const_expr(self.epi.residual):
                                for e in cutlass.range_constexpr(8):
                                    if full or nn + e < n_out:
                                        row8[e] = row8[e] + mRes[mm, nn + e].to(Float32)
                            if aligned and full:
                                if cutlass.const_expr(self.epi.residual):
                                    st_global_bf16x8(addr, [row8[e] for e in range(8)])
                                else:
                                    words = cute.recast_tensor(row8, Uint32)
                                    st_global_b32x4(addr, [words[e] for e in range(4)])
                            else:
                                for e in cutlass.range_constexpr(8):
                                    if nn + e < n_out:
                                        mOut[mm, nn + e] = row8[e].to(cutlass.BFloat16)
                if cutlass.const_expr(p + 1 < passes):
                    epi_bar.arrive_and_wait()  # the pass is stored before the next one overwrites it

    return Nvfp4GemmSm90


def compile_gemm(config: Config, epilogue: Epilogue, w4a8: bool, *, bias_fp32: bool = False, tvm_ffi: bool = False,
                 num_sms: int = 132, arch: str | None = None, options: str = ""):
    """The compiled kernel for one (config, epilogue, mode, bias dtype), through :mod:`..cache`.

    The executor takes data pointers ``(x, tiles, row_exp, x_scale, tensor_scale, out, bias,
    residual, workspace, counters)`` (0 when unused), then ``M, N_pad, N_out, K`` and a
    ``cuda.CUstream`` (with ``tvm_ffi``, CuTeDSL's apache-tvm-ffi calling convention, the stream
    handle as an int); ``M`` (and N, K) are runtime values; a persistent config launches at most ``num_sms`` CTAs."""
    from quantkit.kernels.cache import compile_kernel, pin_arch

    arch = pin_arch(arch)
    from cutlass.cute.runtime import make_fake_stream

    kernel = _kernel_class()(config, epilogue, w4a8, bias_fp32, num_sms)
    key = ("sm90.nvfp4_gemm", "w4a8" if w4a8 else "w4a16", config, epilogue, bias_fp32, num_sms if config.persistent else 0)
    return compile_kernel(key, kernel, *([0] * 10), 1, 1, ROW_PAD, ROW_PAD // (2 if epilogue.activation == "swiglu" else 1),
                          BK, make_fake_stream(), arch=arch, options=options, tvm_ffi=tvm_ffi)


# ---------------------------------------------------------------------------------------- host
@functools.lru_cache(maxsize=4096)
def _plan(m: int, n_pad: int, k: int, epilogue: Epilogue, w4a8: bool, bias_fp32: bool, device: torch.device,
          config: Config | None, tvm_ffi: bool):
    """(config, executor) of one WGMMA launch shape, cached: the per-call host path is a dict lookup."""
    sms = num_sms(device)
    config = config or pick_config(m, n_pad, k, epilogue, w4a8, sms)
    return config, compile_gemm(config, epilogue, w4a8, bias_fp32=bias_fp32, tvm_ffi=tvm_ffi, num_sms=sms)


def tma_rows(m: int, config: Config, w4a8: bool) -> int:
    """Activation rows the kernel's TMA box reads for ``m`` tokens: ``m`` rounded up to whole
    token tiles (the caller pads a copy of x) where W4A16 runs unsplit 64-token or any 128- or
    256-token tiles, the last over a quarter empty (one-warpgroup 128-token tiles: over a fifth;
    256 tokens: any part empty), and the grid holds one tile, or up to 4 tiles on one warpgroup or
    ending in a tile over three quarters empty; else ``m``. Such mostly-out-of-bounds loads run
    slowly; the padded copy costs 1-2 µs (H100, session 25: 28672x4096 at M = 33 52 µs, through
    the copy 41 µs; 16/32-token tiles and 64-token K-split
    grids lose the copy's time. H200, session 26: one tile 0.61-0.89x the time from 33-65 tokens;
    M = 129 0.55-0.97x; M = 200 and 300 one warpgroup 0.79-0.87x, two warpgroups 0.93-1.08x. H100,
    session 44, 128-token cluster K-splits: 0.69-0.87x on 8 of 11 grids, 1.01-1.13x on 1024x4096
    at M = 65 and 200 and 2048x8192 at M = 65. H100, session 45, one-warpgroup 256-token tiles at
    M = 192, unpadded: 1.27-1.73x the time at M = 129, padded. H200, session 49, one-warpgroup
    128-token tiles on 4096-8192-row weights: padded 0.84-0.98x the time at M = 96 and 100,
    1.01-1.14x at 104 and 112)."""
    rows = -(-m // config.bn) * config.bn
    empty = rows - m
    fraction = 5 if config.bn == 128 and config.warpgroups == 1 else 4  # pad beyond 1 / fraction empty
    if w4a8 or config.bn < 64 or (config.splits > 1 and config.bn < 128) or fraction * empty <= config.bn < 256:
        return m
    if rows == config.bn or (rows <= 4 * config.bn and (config.warpgroups == 1 or 4 * empty > 3 * config.bn)):
        return rows
    return m


def launch_gemm(x_arg: torch.Tensor, w: Nvfp4Sm90Weight, epilogue: Epilogue, w4a8: bool, x_scale, bias, residual,
                config, out: torch.Tensor | None) -> torch.Tensor:
    """Run the kernel on ``x_arg [M, K]`` (bf16, or for W4A8 the K-permuted E4M3 activations with
    FP32 per-token ``x_scale [M]``); checks shapes, picks the kernel (W4A16: the decode GEMV for
    :func:`.nvfp4_gemv.use_gemv` token counts or a ``GemvConfig``) and its config, pads a short token tile's
    activations, allocates split-K scratch."""
    m, k = x_arg.shape
    n_pad = w.row_exp.shape[0]
    n_out = w.n // 2 if epilogue.activation == "swiglu" else w.n
    if epilogue.activation == "swiglu" and w.n % (2 * SWIGLU_GROUP):
        raise ValueError(f"swiglu needs N' divisible by {2 * SWIGLU_GROUP}, got {w.n}")
    if out is None:
        out = torch.empty(m, n_out, dtype=torch.bfloat16, device=x_arg.device)
    elif out.shape != (m, n_out) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n_out}] tensor")
    if m == 0:
        return out
    if x_arg.data_ptr() % 16 or not x_arg.is_contiguous():
        raise ValueError("x must be contiguous and 16-byte aligned (TMA)")
    bias, residual, bias_fp32 = epilogue_operands(epilogue, m, w.n, n_out, bias, residual)
    from quantkit.kernels.sm90 import nvfp4_gemv

    if not w4a8 and (isinstance(config, nvfp4_gemv.GemvConfig)
                     or (config is None and nvfp4_gemv.use_gemv(m, n_pad, k, epilogue, num_sms(x_arg.device)))):
        return nvfp4_gemv.launch_gemv(x_arg, w, epilogue, bias, residual, config, out)
    tvm_ffi = use_tvm_ffi()
    config, fn = _plan(m, n_pad, k, epilogue, w4a8, bias_fp32, x_arg.device, config, tvm_ffi)
    x_rows = tma_rows(m, config, w4a8)
    if x_rows > m:  # its rows past M only feed output columns that are never stored
        x_pad = x_arg.new_empty(x_rows, k)
        x_pad[:m] = x_arg
        x_arg = x_pad
    ws = counters = None
    if config.splits > 1 and not config.cluster:
        tiles = (n_pad // (ROWS * config.warpgroups)) * (-(-m // config.bn))
        split_k.check_tiles(tiles)
        ws = torch.empty(config.splits * tiles * 128 * config.warpgroups * config.bn // 2, dtype=torch.float32,
                         device=x_arg.device)
        counters = split_k.counter_buffer(x_arg.device)
    stream = launch_stream(x_arg.device, tvm_ffi)
    fn(*map(data_ptr, (x_arg, w.tiles, w.row_exp, x_scale, w.tensor_scale, out, bias, residual, ws, counters)), m, x_rows,
       n_pad, n_out, k, stream)
    return out


def nvfp4_w4a16(x: torch.Tensor, w: Nvfp4Sm90Weight, epilogue: Epilogue = Epilogue(), bias=None, residual=None,
                config=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``epilogue(x @ dequant(w).T)``: bf16 ``x [M, K]``, a :func:`prepare`-d NVFP4 weight
    ``[N', K]``, optional ``bias [N']`` (bf16/FP32) and bf16 ``residual [M, N]``; returns bf16
    ``[M, N]`` (``N = N'/2`` for swiglu). ``config``: a :class:`Config` (WGMMA kernel) or a
    ``nvfp4_gemv.GemvConfig`` (decode GEMV) overrides the choice of kernel and config."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"expected bf16 x[M, {w.k}], got {x.dtype} {tuple(x.shape)}")
    return launch_gemm(x.contiguous(), w, epilogue, False, None, bias, residual, config, out)


# ---------------------------------------------------------------------------------------- ops
def weight_from_tensors(tiles, row_exp, tensor_scale, n: int) -> Nvfp4Sm90Weight:
    """The :class:`Nvfp4Sm90Weight` of a prepared weight's tensors (what the custom ops take)."""
    return Nvfp4Sm90Weight(tiles, row_exp, tensor_scale, n, tiles.shape[1] * BK)


def output_shape(x: torch.Tensor, n: int, activation: str) -> tuple[int, int]:
    """``(M, N)`` of the output for ``x [M, K]`` and ``N'`` weight rows (``N = N'/2`` for swiglu)."""
    return x.shape[0], n // 2 if activation == "swiglu" else n


@kernel_op("quantkit::nvfp4_w4a16")
def nvfp4_w4a16_op(x: torch.Tensor, tiles: torch.Tensor, row_exp: torch.Tensor, tensor_scale: torch.Tensor,
                   n: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   activation: str = "identity") -> torch.Tensor:
    """``torch.library`` op around :func:`nvfp4_w4a16` on a prepared weight's tensors (``n``: N')."""
    epi = Epilogue(bias=bias is not None, activation=activation, residual=residual is not None)
    return nvfp4_w4a16(x, weight_from_tensors(tiles, row_exp, tensor_scale, n), epi, bias, residual)


@nvfp4_w4a16_op.register_fake
def _(x, tiles, row_exp, tensor_scale, n, bias=None, residual=None, activation="identity"):
    return x.new_empty(output_shape(x, n, activation), dtype=torch.bfloat16)
