"""sm90 NVFP4 W4A16 / W4A8 GEMMs and the W4A16 decode GEMV: layout, decode and numerics on CPU;
compile-only PTX checks; numerics against float64 on GPU (``-m gpu``).

The CPU decode tests replay, bit for bit, the integer and bf16/f16 operations the kernels apply
to each thread's registers (rotations, masks, scale-byte arithmetic, the lane-broadcast multiply)
on the prepared bytes, and place every result at the (row, k) that the PTX ISA's WGMMA register
fragment layout assigns to that thread and register; that must reproduce ``e2m1 · s_b · 2^-7``
(W4A16) and :func:`quantkit.formats.w4a8.weight_to_fp8` (W4A8) exactly.
"""
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from f64_reference import e4m3_round_f64

from quantkit.formats import get_format
from quantkit.formats.codecs import e2m1_decode, unpack_nibbles
from quantkit.formats import w4a8
from quantkit.kernels.epilogue import Epilogue, apply_activation, interleave_gate_up
from quantkit.kernels.sm90 import nvfp4_gemm as ng
from quantkit.kernels.sm90 import nvfp4_gemv as gv
from quantkit.kernels.sm90 import nvfp4_w4a8 as nw8

def random_nvfp4(n: int, k: int, seed: int = 0, special: bool = True):
    """Packed codes (every code value), E4M3 block scales (incl. subnormal; zero blocks when
    ``special``) and an FP32 tensor scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale_bits = torch.randint(1, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)  # finite, > 0
    if special:
        scale_bits[0, :3] = torch.tensor([0, 1, 7], dtype=torch.uint8)  # zero and two subnormals
    tensor_scale = torch.tensor(0.37, dtype=torch.float32)
    return packed, scale_bits.view(torch.float8_e4m3fn), tensor_scale


def dequant_f64(packed, scale):
    """``e2m1 · s_b`` in float64, ``[N, K]``."""
    n = packed.shape[0]
    vals = e2m1_decode(unpack_nibbles(packed)).double().reshape(n, -1, 16)
    return (vals * scale.double()[..., None]).reshape(n, -1)


# ----------------------------------------------------------------------------- layout
def test_prepare_round_trips_codes_and_scales():
    packed, scale, ts = random_nvfp4(200, 384, special=False)
    w = ng.prepare(packed, scale, ts)
    assert w.tiles.shape == (256 // 64, 384 // 128, ng.TILE_BYTES) and w.row_exp.shape == (256,)
    back_packed, back_scale = ng.unprepare(w)
    assert torch.equal(back_packed, packed)
    assert torch.equal(back_scale, scale.float())


def test_prepare_zeroes_codes_of_zero_scale_blocks():
    packed, scale, ts = random_nvfp4(64, 128)
    back_packed, back_scale = ng.unprepare(ng.prepare(packed, scale, ts))
    assert torch.equal(dequant_f64(back_packed, back_scale), dequant_f64(packed, scale))
    assert (unpack_nibbles(back_packed)[0, :16] == 0).all() and (unpack_nibbles(packed)[0, :16] != 0).any()


def test_decode_bit_layout_is_a_bijection():
    assert sorted(b for v in ng.SOURCE_BITS for b in v) == list(range(32))


def test_scale_bytes_encode_every_e4m3_scale_exactly():
    allv = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 0 .. 448
    t = ng.encode_scales(allv).to(torch.int64)
    assert torch.equal(ng.decode_scales(t), allv.float())
    assert int(t.max()) <= 151  # (t << 4) + (236 << 7) stays a finite bf16, (t << 7) + ... an f16
    s = allv.double()
    nz = s > 0
    bf16 = (((t << 4) + (ng.W16_EXP_BIAS << 7)) << 16).to(torch.int32).view(torch.float32).double()
    assert torch.equal(bf16[nz], s[nz] * 2.0 ** 119)
    for c in (-9, 0, 3, 8):
        f16 = ((t << 7) + ((ng.W8_EXP_BIAS - c) << 10)).to(torch.int16).view(torch.float16).double()
        keep = nz & (s < 2.0 ** (c + 1))  # scales a row with exponent c can hold
        assert torch.equal(f16[keep], s[keep] * 2.0 ** (14 - c))


# ----------------------------------------------------------------------------- register replay
def _rotl(q: torch.Tensor, r: int) -> torch.Tensor:
    return ((q << r) | (q >> (32 - r))) & 0xFFFFFFFF if r else q


def _lanes(word: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) 16-bit halves of 32-bit words as float64 values of ``dtype`` (bf16 / f16)."""
    def half(bits):
        if dtype is torch.bfloat16:
            return (bits << 16).to(torch.int32).view(torch.float32).double()
        return bits.to(torch.int16).view(torch.float16).double()
    return half(word & 0xFFFF), half(word >> 16)


def _registers(w):
    """Per tile: code words ``[nb, kt, b(8), t(128)]`` and scale words ``[nb, kt, quad(32), 4]``."""
    nb, kt, _ = w.tiles.shape
    raw = w.tiles.to(torch.int64)
    shifts = torch.arange(0, 32, 8)
    code = (raw[..., :ng.CODE_BYTES].view(nb, kt, -1, 4) << shifts).sum(-1)
    code = code.view(nb, kt, 2, 128, 4).permute(0, 1, 2, 4, 3).reshape(nb, kt, 8, 128)
    scale = (raw[..., ng.CODE_BYTES:].view(nb, kt, 32, 4, 4) << shifts).sum(-1)
    return code, scale


def _fragment_position(t: torch.Tensor, b: int, j: int, hi: int):
    """(row, k) in a 64x128 tile of lane ``hi`` of bf16x2 register ``j`` (a0..a3) of thread ``t``
    in k16 block ``b`` (PTX ISA, wgmma .m64nNk16 register fragment A)."""
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * (j % 2)
    k = 16 * b + 2 * (t % 4) + 8 * (j // 2) + hi
    return row, k


def replay_w4a16(w) -> torch.Tensor:
    """float64 ``[N_pad, K]``: what the W4A16 decode puts in each fragment register lane."""
    code, scale = _registers(w)
    nb, kt = code.shape[:2]
    out = torch.full((nb, kt, 64, 128), float("nan"), dtype=torch.float64)
    t = torch.arange(128)
    for b in range(8):
        q = code[:, :, b]  # [nb, kt, 128]
        e = (scale[:, :, t // 4, b // 2] >> (8 * (b % 2))) & 0x00FF00FF
        sc_lo, sc_hi = _lanes((e * 16 + (ng.W16_EXP_BIAS << 7) * 0x10001) & 0xFFFFFFFF, torch.bfloat16)
        for j in range(4):
            x = (_rotl(q, ng.MAG_ROT[j]) & 0x01C001C0) | (_rotl(q, ng.SIGN_ROT[j]) & 0x80008000)
            s = sc_hi if j % 2 else sc_lo
            for hi, v in enumerate(_lanes(x, torch.bfloat16)):
                row, k = _fragment_position(t, b, j, hi)
                out[:, :, row, k] = v * s  # exact: <= 6 significant bits
    return out.permute(0, 2, 1, 3).reshape(nb * 64, kt * 128)


def replay_w4a8(w) -> torch.Tensor:
    """float64 ``[N_pad, K]``: the E4M3 value the W4A8 decode produces for each weight, at its
    column in the original K order."""
    code, scale = _registers(w)
    nb, kt = code.shape[:2]
    out = torch.full((nb, kt, 64, 128), float("nan"), dtype=torch.float64)
    t = torch.arange(128)
    rows = torch.arange(nb)[:, None] * 64 + 16 * (t // 32) + (t % 32) // 4  # [nb, 128]
    c0, c1 = w.row_exp[rows].to(torch.int64), w.row_exp[rows + 8].to(torch.int64)
    krows = (((ng.W8_EXP_BIAS - c0) << 10) | ((ng.W8_EXP_BIAS - c1) << 26))[:, None, :]
    for b in range(8):
        q = code[:, :, b]
        e = (scale[:, :, t // 4, b // 2] >> (8 * (b % 2))) & 0x00FF00FF
        sc_lo, sc_hi = _lanes((e * 128 + krows) & 0xFFFFFFFF, torch.float16)
        for j in range(4):
            x = (_rotl(q, (ng.MAG_ROT[j] + 3) % 32) & 0x0E000E00) | (_rotl(q, ng.SIGN_ROT[j]) & 0x80008000)
            s = sc_hi if j % 2 else sc_lo
            for hi, v in enumerate(_lanes(x, torch.float16)):
                p = v * s
                assert torch.equal(p.half().double(), p)  # the f16 multiply is exact
                row, k = _fragment_position(t, b, j, hi)
                out[:, :, row, k] = e4m3_round_f64(p)
    return out.permute(0, 2, 1, 3).reshape(nb * 64, kt * 128)


@pytest.mark.parametrize("seed", [0, 1])
def test_w4a16_register_decode_is_exact(seed):
    packed, scale, ts = random_nvfp4(128, 256, seed)
    w = ng.prepare(packed, scale, ts)
    expect = dequant_f64(packed, scale) * 2.0 ** -7
    expect[scale.double().repeat_interleave(16, 1) == 0] = 0.0
    assert torch.equal(replay_w4a16(w)[:128], expect)


def test_w4a8_register_decode_equals_reference_rounding():
    packed, scale, ts = random_nvfp4(128, 256, seed=2)
    w = ng.prepare(packed, scale, ts)
    expect = w4a8.weight_to_fp8(packed, scale).double()
    expect[scale.double().repeat_interleave(16, 1) == 0] = 0.0
    assert torch.equal(replay_w4a8(w)[:128], expect)


def test_w4a8_k_permutation_matches_fp8_fragment_slots():
    perm = ng.w4a8_k_permutation(256)
    assert torch.equal(perm.sort().values, torch.arange(256))
    # FP8 register (row r, half h) of thread c holds bytes 4c..4c+3 (+16h) of a 32-column group;
    # the decode fills them with bf16-layout columns 2c, 2c+1, 2c+8, 2c+9 (+16h).
    for grp in range(8):
        for h in range(2):
            for c in range(4):
                for jj in range(2):
                    for lohi in range(2):
                        slot = 32 * grp + 16 * h + 4 * c + 2 * jj + lohi
                        assert perm[slot] == 32 * grp + 16 * h + 2 * c + 8 * jj + lohi


# ----------------------------------------------------------------------------- W4A8 numerics
def test_w4a8_weight_conversion_equals_float64_rounding():
    packed, scale, _ = random_nvfp4(96, 256, seed=3)
    c = w4a8.row_exponents(scale)
    smax = scale.double().amax(1)
    assert torch.equal(c.double(), torch.where(smax > 0, torch.floor(torch.log2(smax)), 0.0))
    expect = e4m3_round_f64(dequant_f64(packed, scale) * 2.0 ** -c.double()[:, None])
    assert torch.equal(w4a8.weight_to_fp8(packed, scale).double(), expect)


def test_w4a8_weight_conversion_error_bound():
    torch.manual_seed(4)
    w = torch.randn(128, 512) * torch.logspace(-2, 1, 128)[:, None]
    qw = get_format("nvfp4-w4a16").quantize_weight(w)
    exact = dequant_f64(qw.data, qw.scale)  # e2m1 · s_b (tensor scale aside)
    c = w4a8.row_exponents(qw.scale).double()[:, None]
    approx = w4a8.weight_to_fp8(qw.data, qw.scale).double() * 2.0 ** c
    bound = torch.maximum(2.0 ** -4 * exact.abs(), 2.0 ** -10 * 2.0 ** c)
    assert ((approx - exact).abs() <= bound).all()
    assert (approx - exact).abs().max() > 0  # the conversion does round


def test_w4a8_accumulate_equals_float64_math():
    torch.manual_seed(5)
    packed, scale, ts = random_nvfp4(64, 256, seed=5, special=False)
    x = (torch.randn(9, 256) * 3).to(torch.bfloat16)
    x[4] = 0
    xd = x.double()
    amax = xd.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, (amax / 448).float().double(), torch.ones_like(amax))
    xq = e4m3_round_f64((xd / sx).float().double())
    c = w4a8.row_exponents(scale).double()
    w8 = e4m3_round_f64(dequant_f64(packed, scale) * 2.0 ** -c[:, None])
    expect = (xq @ w8.T) * sx * 2.0 ** c[None, :] * ts.double()
    got = w4a8.accumulate(x, packed, scale, ts)
    assert torch.allclose(got.double(), expect, rtol=2 ** -23, atol=0)


def test_pick_config_fills_the_gpu_and_respects_swiglu():
    cfg = ng.pick_config(1, 4096, 4096, Epilogue(), w4a8=False)
    assert cfg.bn == 8 and (4096 // (64 * cfg.warpgroups)) * cfg.splits >= 2 * 132
    assert ng.pick_config(1, 57344, 8192, Epilogue(), w4a8=False).splits == 1  # tall weights fill it unsplit
    assert ng.pick_config(256, 4096, 4096, Epilogue(), w4a8=False).splits == 1  # no split-K beyond decode
    assert ng.pick_config(1, 4096, 4096, Epilogue(activation="swiglu"), w4a8=False).warpgroups == 2
    # SwiGLU 256-token tiles: one CTA per tile, the exchange in the drained stages (no room beside them)
    assert ng.pick_config(4096, 4096, 4096, Epilogue(activation="swiglu"), w4a8=False) == ng.Config(256, 2, 3, 1)
    # W4A8: 256-token tiles, persistent; token tiles fastest at 4 stages where the weight outweighs
    # the FP8 activations and the grid has more tiles than SMs, else row blocks fastest at 5
    assert ng.pick_config(4096, 4096, 4096, Epilogue(), w4a8=True) == ng.Config(256, 2, 5, 1, persistent=True)
    assert ng.pick_config(4096, 28672, 4096, Epilogue(), w4a8=True) == ng.Config(
        256, 2, 4, 1, persistent=True, tokens_fastest=True)
    assert ng.pick_config(4096, 4096, 4096, Epilogue(), w4a8=False) == ng.Config(256, 2, 3, 1, persistent=True)
    assert ng.pick_config(1024, 6144, 4096, Epilogue(), w4a8=False) == ng.Config(128, 2, 4, 1, persistent=True)
    assert ng.pick_config(384, 6144, 4096, Epilogue(activation="swiglu"), w4a8=False) == ng.Config(
        128, 2, 4, 1, persistent=True)  # 128-token tiles: the exchange beside the staging
    # 128-token tiles: two warpgroups where their CTAs take fewer waves, one counting 1.5 (CTAs of 1 -> 2)
    assert ng.pick_config(256, 4096, 4096, Epilogue(), w4a8=False).warpgroups == 1  # 128 -> 64: 1 wave -> 1
    assert ng.pick_config(300, 4096, 4096, Epilogue(), w4a8=False) == ng.Config(128, 2, 5, 1)  # 192 -> 96: 2 -> 1
    assert ng.pick_config(100, 14336, 4096, Epilogue(), w4a8=False) == ng.Config(128, 2, 5, 1)  # 224 -> 112
    assert ng.pick_config(128, 10240, 8192, Epilogue(), w4a8=False) == ng.Config(128, 2, 5, 1)  # 160 -> 80
    # 256-token tiles where their CTAs take two warpgroups by the same rule and pad no more rows
    # than 128-token tiles (from 2048 tokens: at most 1/16 more)
    assert ng.pick_config(256, 10240, 8192, Epilogue(), w4a8=False) == ng.Config(256, 2, 3, 1)  # 160 -> 80
    assert ng.pick_config(200, 28672, 4096, Epilogue(), w4a8=False) == ng.Config(256, 2, 3, 1, persistent=True)
    assert ng.pick_config(129, 6144, 4096, Epilogue(), w4a8=False) == ng.Config(128, 2, 5, 1)  # 96 CTAs: one wave
    assert ng.pick_config(256, 8192, 28672, Epilogue(), w4a8=False).bn == 128  # 128 CTAs: one wave
    assert ng.pick_config(512, 6144, 4096, Epilogue(), w4a8=False) == ng.Config(256, 2, 3, 1)  # 192 -> 96: 2 -> 1
    assert [ng.pick_config(m, 28672, 4096, Epilogue(), w4a8=False).bn for m in (384, 640, 1000, 1900, 2100)] == [
        128, 128, 256, 128, 256]
    assert ng.pick_config(256, 28672, 4096, Epilogue(activation="swiglu"), w4a8=False) == ng.Config(256, 2, 3, 1)
    assert ng.pick_config(320, 10240, 8192, Epilogue(), w4a8=False).warpgroups == 2  # 480 -> 240: 4 -> 2
    # half-wave 128-token grids split K as clusters: 64 CTAs x 2; 16 x 4 (x 8 would leave 4 k-tiles)
    assert ng.pick_config(128, 4096, 14336, Epilogue(), w4a8=False) == ng.Config(128, 1, 6, 2, cluster=True)
    assert ng.pick_config(100, 1024, 4096, Epilogue(), w4a8=False) == ng.Config(128, 1, 6, 4, cluster=True)
    assert ng.pick_config(256, 2048, 8192, Epilogue(), w4a8=False).splits == 2  # x 4: 128 CTAs in 4-clusters
    assert ng.pick_config(256, 4096, 14336, Epilogue(), w4a8=False).splits == 1  # 128 CTAs: one wave already
    # W4A8 warpgroups by the same wave rule, persistent in one wave too (CTAs of 1 -> 2 warpgroups)
    assert ng.pick_config(1024, 4096, 4096, Epilogue(), w4a8=True) == ng.Config(256, 2, 5, 1, persistent=True)  # 256 -> 128
    assert ng.pick_config(256, 6144, 4096, Epilogue(), w4a8=True) == ng.Config(256, 1, 6, 1, persistent=True)  # 96 -> 48
    assert ng.pick_config(100, 28672, 4096, Epilogue(), w4a8=True) == ng.Config(128, 2, 8, 1)  # up to 128 tokens: 128
    # one-warpgroup 256-token CTAs filling at most half the SMs (64 of 132): K in halves, a cluster
    assert ng.pick_config(256, 4096, 4096, Epilogue(), w4a8=True) == ng.Config(256, 1, 6, 2, cluster=True)
    # 384 tokens, 1.5 tiles of 256: 128-token tiles where they take fewer waves, or both one (10240x8192:
    # 240 two-warpgroup CTAs, two waves, against 320 one-warpgroup 256-token ones, three)
    assert ng.pick_config(384, 10240, 8192, Epilogue(), w4a8=True) == ng.Config(128, 2, 8, 1)
    assert ng.pick_config(384, 6144, 4096, Epilogue(), w4a8=True).bn == 256  # 288 CTAs of 128 tokens against 96
    # SwiGLU: persistent beyond one wave, its exchange beside 3 stages; within one wave one CTA per tile
    assert ng.pick_config(4096, 4096, 4096, Epilogue(activation="swiglu"), w4a8=True) == ng.Config(
        256, 2, 3, 1, persistent=True)
    assert ng.pick_config(512, 4096, 4096, Epilogue(activation="swiglu"), w4a8=True) == ng.Config(256, 2, 5, 1)
    with pytest.raises(ValueError, match="swiglu needs 2 warpgroups"):
        ng.Config(8, 1, 4, 1).check(Epilogue(activation="swiglu"), w4a8=False)


def compact_config(c: ng.Config) -> str:
    """A config as the results files name it (``bn256 2wg 5st s1 persistent``)."""
    return (f"bn{c.bn} {c.warpgroups}wg {c.stages}st s{c.splits}" + " persistent" * c.persistent
            + " tokens_fastest" * c.tokens_fastest + " cluster" * c.cluster)


def test_w4a8_rule_holds_to_the_h100_tunes():
    """The W4A8 prefill rule picks, at every point of the H100 tunes (every tile, split, tile order
    and depth timed), a config that was timed and ran within 3 % of the fastest on average: session
    46's (six 8B/70B weights, M = 256-4096; 8 % at worst, session 46's rule 4 % and 27 %) and
    session 47's two held-out ones (five weights at M = 384 and 768, session 46's rule 7 % and 33 %;
    five at 640, 1152 and 2304 tokens, session 47's first amendment 3 % and 22 %), and session
    48's, held out from the rule as it stands (four new weights at 896, 1664 and 3200 tokens: 2 %,
    7 % at worst). At most 16 % off, on 4096x14336 at 384 tokens, whose fastest layout (a
    two-warpgroup 2-split cluster) is no rule's."""
    results = Path(__file__).parents[1] / "benchmarks/results"
    s47 = "nvfp4_w4a8_rule_h100_2026-12-07_s47.json"
    for file, section, count, worst in (("nvfp4_w4a8_rule_swiglu256_h100_2026-12-07_s46.json", "1_tune_w4a8_256_4096", 27, 1.08),
                                        (s47, "1_tune_w4a8_384_768", 10, 1.16), (s47, "2_tune_w4a8_640_2304", 15, 1.09),
                                        ("nvfp4_w4a8_h100_2026-12-07_s48.json", "1_tune_w4a8_896_3200", 12, 1.07)):
        rows = json.loads((results / file).read_text())[section]["rows"]
        assert len(rows) == count
        ratios = []
        for row in rows:
            n, k = (int(v) for v in row["shape"].split("x"))
            us = row["us"]
            ratios.append(us[compact_config(ng.pick_config(row["m"], n, k, Epilogue(), True))] / min(us.values()))
        assert max(ratios) <= worst and sum(ratios) / len(ratios) <= 1.03, (section, sorted(ratios))


def test_picked_configs_are_valid():
    """Every config the rules pick, over token counts 1-16384, weights of 128-106496 x 128-53248,
    both modes, plain and SwiGLU epilogues and 132 or 114 SMs, passes ``Config.check``: it fits
    the 227 KiB CTA limit (SwiGLU's exchange included) and a cluster holds 2-8 splits; so does
    every GEMV config at 1-16 tokens."""
    ms = (1, 5, 9, 16, 17, 24, 32, 33, 48, 64, 65, 100, 257, 1000, 4096, 16384)
    ns = (128, 512, 1024, 2048, 3072, 4096, 5632, 6144, 8192, 10240, 14336, 28672, 57344, 106496)
    ks = (128, 1024, 3584, 4096, 6144, 8192, 14336, 28672, 53248)
    for m, n, k, num_sms in itertools.product(ms, ns, ks, (132, 114)):
        for epi in (Epilogue(), Epilogue(activation="swiglu", bias=True)):
            for fp8_acts in (False, True):
                ng.pick_config(m, n, k, epi, fp8_acts, num_sms).check(epi, fp8_acts)
            if m <= 16:
                gv.pick_gemv_config(m, n, k, epi, num_sms).check(epi)
    # narrow deep weights at 33-64 tokens split K 16-64 ways: the turnstile, not a cluster
    narrow = ng.pick_config(48, 128, 8192, Epilogue(), False)
    assert (narrow.splits, narrow.cluster) == (16, False)
    ng.Config(256, 2, 5, 1).check(Epilogue(), w4a8=True)
    with pytest.raises(ValueError, match="needs 377856 bytes of shared memory in W4A16 mode"):
        ng.Config(256, 2, 5, 1).check(Epilogue(), w4a8=False)
    # a persistent CTA's SwiGLU exchange buffer (FP32 [128, bn/2]: 64 KiB at bn = 256) counts too; the
    # others exchange in their drained activation stages
    with pytest.raises(ValueError, match="needs 279552 bytes"):
        ng.Config(256, 2, 5, 1, persistent=True).check(Epilogue(activation="swiglu"), w4a8=True)
    ng.Config(256, 2, 5, 1).check(Epilogue(activation="swiglu"), w4a8=True)


def test_act_quant_holds_each_row_in_the_fewest_groups_per_thread():
    """256 threads x 16 columns per group: rows up to 4096 columns in 1 group per thread (31
    registers, 8 CTAs per SM), then 2 / 4 / 8; longer rows use the 8-group kernel, read twice."""
    assert [nw8.held_groups(k) for k in (1056, 4096, 4112, 8192, 14336, 16384, 16400, 28672, 32768, 40960)] == \
        [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]


def test_persistent_configs_stage_the_output_beside_the_pipeline():
    """A persistent CTA stages its epilogue in the memory the stages leave (the pipeline is
    already loading the next tile): fewer tokens per pass than the drained pipeline holds."""
    epi, res = Epilogue(), Epilogue(residual=True)  # bf16 staging; FP32 (the residual is added after it)
    assert ng.staging_tokens(ng.Config(256, 2, 5, 1), res, True) == 256  # the drained pipeline: one pass
    # 227 KiB - 4 KiB reserve - 4 stages x 41984 B = 60416 B; per token 2 warpgroups x 72 halves x 2 B
    # (bf16) or x 68 floats x 4 B (FP32)
    assert ng.staging_tokens(ng.Config(256, 2, 4, 1, persistent=True), epi, True) == 128
    assert ng.staging_tokens(ng.Config(256, 2, 4, 1, persistent=True), res, True) == 64
    assert ng.staging_tokens(ng.Config(256, 2, 5, 1, persistent=True), epi, True) == 64
    assert ng.staging_tokens(ng.Config(256, 2, 5, 1, persistent=True), res, True) == 32
    with pytest.raises(ValueError, match="room to stage the output"):
        ng.Config(256, 2, 5, 1, persistent=True).check(Epilogue(activation="swiglu"), w4a8=True)
    with pytest.raises(ValueError, match="no K-split and no PDL"):
        ng.Config(64, 1, 4, 2, persistent=True).check(epi, w4a8=False)
    with pytest.raises(ValueError, match="tile order: persistent only"):
        ng.Config(128, 2, 5, 1, tokens_fastest=True).check(epi, w4a8=False)


def test_cluster_split_configs():
    """A cluster split has 2..8 splits, and split 1..'s partial tile (FP32, bn/2 per thread) must
    fit the activation stages it reuses: always in W4A16 (bf16 stages), in W4A8 from 2 stages per
    warpgroup. The rule takes it where one split CTA fills an SM."""
    epi = Epilogue()
    with pytest.raises(ValueError, match="cluster split needs 2..8 splits"):
        ng.Config(64, 1, 8, 1, cluster=True).check(epi, w4a8=False)
    with pytest.raises(ValueError, match="cluster split needs"):
        ng.Config(64, 2, 3, 2, cluster=True).check(epi, w4a8=True)
    ng.Config(64, 2, 4, 2, cluster=True).check(epi, w4a8=True)
    ng.Config(64, 2, 3, 8, cluster=True).check(epi, w4a8=False)
    # the rule: clusters where a split CTA fills its SM (64-token tiles in one wave), the turnstile
    # where several split CTAs share one
    rule = {(m, n, k): ng.pick_config(m, n, k, epi, False) for m, n, k in
            ((64, 4096, 14336), (64, 4096, 4096), (64, 8192, 28672), (16, 8192, 8192), (16, 4096, 14336))}
    assert [(c.warpgroups, c.splits, c.cluster) for c in rule.values()] == [
        (1, 2, True), (1, 2, True), (2, 2, True), (2, 4, False), (2, 8, False)]
    # one-wave 64-token grids of one-warpgroup CTAs: two warpgroups with K in halves where each
    # half keeps >= 24 k-tiles (not 6144x4096: 16), W4A16 only
    assert ng.pick_config(64, 6144, 4096, epi, False) == ng.Config(64, 1, 8, 1)
    assert ng.pick_config(64, 8192, 8192, epi, True) == ng.Config(64, 1, 8, 1)
    # 16-32 tokens where the turnstile would run <= 7-k-tile splits: one wave of SM-filling
    # one-warpgroup CTAs (SwiGLU: two), unsplit or 2 cluster splits of >= 14 k-tiles, if they fill
    # half the SMs or more; else the turnstile (2048x4096: 64 CTAs; 8192x1024: 8-k-tile CTAs)
    swiglu = Epilogue(activation="swiglu")
    for m in (16, 24, 32):
        short = {(n, k, e.activation): ng.pick_config(m, n, k, e, False) for n, k in
                 ((6144, 4096), (5120, 4096), (4096, 4096), (3072, 4096), (4608, 3584), (3584, 3584), (2048, 4096),
                  (8192, 1024), (4096, 14336)) for e in (epi, swiglu)}
        # 17-32 tokens (one 32-token tile): one warpgroup at half the turnstile's splits
        halved = [(1, 4, False), (1, 1, False), (1, 4, False)] if m > 16 else [(2, 8, False), (2, 2, False), (2, 8, False)]
        assert [(c.warpgroups, c.splits, c.cluster) for (*_, act), c in short.items() if act == "identity"] == [
            (1, 1, False), (1, 1, False), (1, 2, True), (1, 2, True), (1, 1, False), (1, 2, True), *halved]
        assert [(c.splits, c.cluster) for (*_, act), c in short.items() if act == "swiglu"][:3] == [
            (2, True), (2, True), (8, False)]  # two warpgroups: 4096x4096's 64 CTAs fill under half the SMs
        for (n, k, act), c in short.items():
            c.check(swiglu if act == "swiglu" else epi, False)
            if c.stages > 8:  # one CTA per SM
                assert c.stages * ng.stage_bytes(c.bn, c.warpgroups, False) > ng._SMEM // 2
        assert not ng.pick_config(m, 4096, 4096, epi, True).cluster  # W4A8 keeps the turnstile
    # 17-32 tokens where the turnstile would run 8-16-k-tile splits on 2/3 to one wave of
    # two-warpgroup CTAs per split: 2 splits of SM-filling clusters; not 56-k-tile splits (8192x28672)
    # nor 4096x14336's 32 CTAs per split
    for n, k in ((8192, 8192), (5632, 8192), (7168, 5120), (8192, 28672), (4096, 14336)):
        for e in (epi, swiglu):
            c = ng.pick_config(32, n, k, e, False)
            c.check(e, False)
            turnstile = (1, 4, False) if (n, e.activation) == (4096, "identity") else (2, c.splits, False)
            assert (c.warpgroups, c.splits, c.cluster) == ((2, 2, True) if k <= 8192 else turnstile)
            assert ng.pick_config(16, n, k, e, False).stages == 4  # not at 16 tokens
    # other two-warpgroup 16-32-token turnstile grids: a cluster where its packing (2 CTAs per SM in
    # a GPC) and its one-wave limit (~94 % of those slots) cost nothing: more CTAs than SMs and
    # under 90 % of 2 per SM (224), or over 2 per SM (320); not at 256 or at <= 132 CTAs. At 17-32
    # tokens, runs of <= 16 k-tiles take one-warpgroup CTAs at half the splits (as many CTAs), turnstile
    for m in (16, 24, 32):
        for (n, k), total in {(3584, 18944): 224, (14336, 4096): 224, (10240, 8192): 320, (8192, 28672): 256,
                              (4096, 14336): 256, (2048, 4096): 128, (1024, 4096): 64}.items():
            c = ng.pick_config(m, n, k, epi, False)
            if m > 16 and k // ng.BK * (n // 128) // total <= 16:
                assert (c.warpgroups, c.stages, n // 64 * c.splits, c.cluster) == (1, 4, total, False), (n, k, m)
                continue
            assert (c.warpgroups, c.stages, n // 128 * c.splits) == (2, 4, total)
            assert c.cluster == (total in (224, 320)), (n, k, m)
    assert all(c.stages * ng.stage_bytes(c.bn, c.warpgroups, False) > ng._SMEM // 2 for c in rule.values() if c.cluster)


# ----------------------------------------------------------------------------- compile-only
COMPILE_CASES = [  # (mode, bn, warpgroups, splits, epilogue[, variant]): every token tile and warpgroup count, both modes
    ("w4a16", 8, 1, 8, Epilogue()),
    ("w4a16", 8, 2, 2, Epilogue(activation="swiglu", residual=True)),
    ("w4a16", 16, 1, 4, Epilogue(bias=True, activation="silu", residual=True)),
    ("w4a16", 32, 2, 2, Epilogue(activation="gelu_tanh")),
    ("w4a16", 64, 2, 1, Epilogue(activation="swiglu")),
    ("w4a16", 128, 2, 1, Epilogue(activation="relu", residual=True)),
    ("w4a8", 8, 2, 4, Epilogue(bias=True, activation="swiglu")),
    ("w4a8", 64, 1, 2, Epilogue(residual=True)),
    ("w4a8", 128, 2, 1, Epilogue()),
    ("w4a8", 256, 2, 1, Epilogue(bias=True)),
    ("w4a8", 256, 2, 1, Epilogue(residual=True), "persistent"),
    ("w4a16", 128, 2, 1, Epilogue(activation="swiglu"), "persistent"),
    ("w4a16", 64, 1, 2, Epilogue(), "cluster"),
    ("w4a16", 16, 2, 4, Epilogue(bias=True, activation="swiglu", residual=True), "cluster"),
    ("w4a8", 32, 1, 8, Epilogue(bias=True), "cluster"),
    ("w4a16", 32, 1, 4, Epilogue(bias=True, residual=True)),  # the 17-32-token half-split rule's layout
    ("w4a16", 256, 1, 1, Epilogue(bias=True, activation="silu", residual=True)),  # 256-token W4A16 tiles (the
    ("w4a16", 256, 2, 1, Epilogue(activation="gelu_tanh")),  # rule's take two warpgroups; the tune tries one)
    ("w4a16", 256, 2, 1, Epilogue(bias=True, activation="swiglu")),  # SwiGLU's exchange in the drained stages
    ("w4a8", 256, 1, 1, Epilogue(bias=True), "persistent"),  # W4A8 one-warpgroup grids: persistent,
    ("w4a8", 256, 1, 2, Epilogue(activation="gelu_tanh"), "cluster"),  # or within half a wave K-split
]


def test_every_config_compiles_for_sm90a_with_wgmma(tmp_path):
    pytest.importorskip("cutlass")
    cases = [(*c[:4], c[4].bias, c[4].activation, c[4].residual, c[5] if len(c) > 5 else "") for c in COMPILE_CASES]
    script = textwrap.dedent(f"""
        import json, os, sys
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        from quantkit.kernels.epilogue import Epilogue
        from quantkit.kernels.sm90 import nvfp4_gemm as ng, nvfp4_w4a8 as nw8
        for i, (mode, bn, wg, sp, bias, act, res, variant) in enumerate(json.loads(sys.argv[1])):
            d = os.path.join({str(tmp_path)!r}, str(i))
            os.makedirs(d)
            persistent = variant == "persistent"
            cfg = ng.Config(bn, wg, 3, sp, pdl=i % 2 == 0 and not persistent, batched=bn <= 16, persistent=persistent,
                            cluster=variant == "cluster")
            ng.compile_gemm(cfg, Epilogue(bias=bias, activation=act, residual=res), mode == "w4a8",
                            arch="sm_90a", options=f"--keep-ptx --dump-dir {{d}}")
        for held in nw8.HELD:
            d = os.path.join({str(tmp_path)!r}, f"act_quant{{held}}")
            os.makedirs(d)
            nw8.compile_act_quant(held, arch="sm_90a", options=f"--keep-ptx --dump-dir {{d}}")
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    def ptx(d):
        return "".join(open(os.path.join(tmp_path, d, f)).read() for f in os.listdir(tmp_path / d) if f.endswith(".ptx"))

    for i, (mode, bn, wg, splits, epi, *variant) in enumerate(COMPILE_CASES):
        text = ptx(str(i))
        persistent, cluster = variant == ["persistent"], variant == ["cluster"]
        assert ".target sm_90a" in text
        kind = "e4m3.e4m3" if mode == "w4a8" else "bf16.bf16"
        assert f"wgmma.mma_async.sync.aligned.m64n{bn}k{32 if mode == 'w4a8' else 16}.f32.{kind}" in text
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in text
        assert ("atom.global.acq_rel.add" in text) == (splits > 1 and not cluster)  # split-K turnstile only when split
        # a cluster's split 0 adds each peer's partial from distributed shared memory: per thread,
        # one 16-byte load per peer and 4 accumulator registers (bn / 2 of them), one mapa per peer
        assert text.count("ld.shared::cluster.v4.b32") == ((splits - 1) * bn // 8 if cluster else 0)
        assert text.count("mapa.shared::cluster") == (splits - 1 if cluster else 0)
        assert ("barrier.cluster.arrive" in text) == cluster
        assert ("griddepcontrol.wait" in text) == (i % 2 == 0 and not persistent)  # PDL variant
        # output through shared memory: 8 bf16 per 16-byte global store, nothing in local memory; staged
        # as FP32 (rounded after the residual add) or, without a residual, as the bf16 outputs
        assert "st.global.v4.b32" in text and "ld.local" not in text
        assert ("cvt.rn.bf16x2.f32" in text) == epi.residual
        assert ("st.shared.b16" in text) == (not epi.residual)
    for held in nw8.HELD:
        quant = ptx(f"act_quant{held}")
        # one IEEE division (the scale), then per element a correctly rounded reciprocal-and-FMA quotient
        assert quant.count("div.rn.f32") == 1 and "rcp.rn.f32" in quant and "copysign.f32" in quant
        assert "cvt.rn.satfinite.e4m3x2.f32" in quant
        # the held row: `held` groups of two 16-byte loads in the first pass, then the long-row loop's two
        assert quant.count("ld.global.v4") == 2 * held + 4 and "ld.local" not in quant, held


def test_rule_cluster_configs_compile_for_sm90a(tmp_path):
    """Every cluster or one-wave short-split config the rule picks for the Llama-3 8B/70B shapes
    (and Qwen2.5-7B's down_proj, Llama-3.1-8B's k/v_proj) at 16-128 tokens (4-16 stages; SwiGLU's
    exchanging in its drained stages; 128-token half-wave grids in 2- and 4-clusters) compiles for sm_90a to
    WGMMA, with cluster barriers and no turnstile where it is a cluster."""
    pytest.importorskip("cutlass")
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (10240, 8192), (8192, 8192),
              (57344, 8192), (8192, 28672), (3584, 18944), (1024, 4096)]
    cases = sorted({(c, e.activation) for n, k in shapes for m in (16, 24, 32, 48, 64, 80, 128)
                    for e in (Epilogue(), Epilogue(activation="swiglu"))
                    for c in [ng.pick_config(m, n, k, e, False)] if c.cluster or c.stages > 8}, key=str)
    assert {(c.bn, c.warpgroups, c.stages, act) for c, act in cases} == {
        (16, 1, 16, "identity"), (32, 1, 16, "identity"), (16, 2, 16, "swiglu"), (32, 2, 13, "swiglu"),
        (32, 2, 13, "identity"), (64, 1, 8, "identity"), (64, 2, 8, "identity"), (64, 2, 8, "swiglu"),
        (16, 2, 4, "identity"), (32, 2, 4, "identity"), (16, 2, 4, "swiglu"), (32, 2, 4, "swiglu"),
        (128, 1, 6, "identity")}
    assert {c.splits for c, _ in cases if c.bn == 128} == {2, 4}
    configs = [c for c, _ in cases]
    script = textwrap.dedent(f"""
        import json, os, sys
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        from quantkit.kernels.epilogue import Epilogue
        from quantkit.kernels.sm90 import nvfp4_gemm as ng
        for i, (fields, act) in enumerate(json.loads(sys.argv[1])):
            d = os.path.join({str(tmp_path)!r}, str(i))
            os.makedirs(d)
            ng.compile_gemm(ng.Config(**fields), Epilogue(activation=act), False, arch="sm_90a",
                            options=f"--keep-ptx --dump-dir {{d}}")
    """)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps([(dataclasses.asdict(c), a) for c, a in cases])],
                          capture_output=True, text=True, env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"), check=False,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i, c in enumerate(configs):
        text = "".join(p.read_text() for p in (tmp_path / str(i)).glob("*.ptx"))
        assert f"wgmma.mma_async.sync.aligned.m64n{c.bn}k16.f32.bf16.bf16" in text
        assert ("barrier.cluster.arrive" in text) == c.cluster and "ld.local" not in text
        assert "atom.global.acq_rel.add" not in text


GEMV_COMPILE_CASES = [  # (warps, tiles, stages, splits, tokens, pdl, cluster, epilogue)
    (4, 1, 4, 1, 8, False, False, Epilogue()),
    (8, 1, 2, 3, 1, True, False, Epilogue(bias=True, activation="gelu_tanh", residual=True)),
    (4, 2, 4, 2, 4, False, False, Epilogue(bias=True, activation="swiglu", residual=True)),
    (8, 1, 3, 2, 1, True, True, Epilogue()),
    (8, 2, 2, 4, 2, False, True, Epilogue(bias=True, activation="swiglu", residual=True)),
    (8, 1, 3, 1, 16, True, False, Epilogue(bias=True, residual=True)),
    (8, 2, 2, 2, 16, False, True, Epilogue(bias=True, activation="swiglu")),
]


def test_gemv_compiles_for_sm90a_to_mma_sync_and_cp_async(tmp_path):
    """The decode GEMV: warp-level bf16 MMAs (no WGMMA), 16-byte cp.async copies, 16-byte
    shared-memory fragment loads, nothing in local memory, the split-K turnstile only when split
    across separate CTAs, distributed-shared-memory loads and cluster barriers only in clusters;
    9-16 token slots: a second MMA per decoded weight fragment."""
    pytest.importorskip("cutlass")
    script = textwrap.dedent(f"""
        import json, os, sys
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        from quantkit.kernels.epilogue import Epilogue
        from quantkit.kernels.sm90 import nvfp4_gemv as gv
        for i, (w, t, st, sp, tok, pdl, cl, bias, act, res) in enumerate(json.loads(sys.argv[1])):
            d = os.path.join({str(tmp_path)!r}, str(i))
            os.makedirs(d)
            gv.compile_gemv(gv.GemvConfig(w, t, st, sp, tok, pdl, cl), Epilogue(bias=bias, activation=act, residual=res),
                            arch="sm_90a", options=f"--keep-ptx --dump-dir {{d}}")
    """)
    cases = [(w, t, st, sp, tok, pdl, cl, e.bias, e.activation, e.residual)
             for w, t, st, sp, tok, pdl, cl, e in GEMV_COMPILE_CASES]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i, (warps, tiles, stages, splits, tokens, pdl, cluster, _e) in enumerate(GEMV_COMPILE_CASES):
        d = tmp_path / str(i)
        text = "".join(open(d / f).read() for f in os.listdir(d) if f.endswith(".ptx"))
        assert ".target sm_90a" in text and "wgmma" not in text
        frags = 2 if tokens > 8 else 1  # 8-token MMA fragments
        assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 32 * frags  # 4 strips x 8 k16
        # 9 weight + tokens/2 (at least 1) activation copies per k-tile: stages - 1 in the prologue,
        # 1 in the loop
        assert text.count("cp.async.cg.shared.global.L2::128B") == (9 + max(1, tokens // 2)) * stages
        assert text.count("ld.shared.v4.b32") == 12  # 2 code + 1 scale words per strip
        assert "ld.local" not in text and "st.local" not in text
        assert ("atom.global.acq_rel.add" in text) == (splits > 1 and not cluster)
        # a cluster's splits meet in distributed shared memory: per thread, one load per split and
        # value of the [64 * tiles, 8 * frags] tile it may own
        assert text.count("ld.shared::cluster.f32") == (splits * 64 * tiles * 8 * frags // (32 * warps) if cluster else 0)
        assert ("barrier.cluster.arrive" in text) == cluster
        assert ("griddepcontrol.wait" in text) == pdl


def test_gemv_config_rule():
    """The fitted rule: 8 warps with PDL; 3 stages (1 CTA/SM) when the grid takes an odd number of
    rounds at one CTA per SM, else 2 (2 CTAs/SM); a 2-way K-split only for narrow, deep weights or
    very narrow ones (a quarter of the SMs); slots for the next power of 2 of M; 9-16 tokens (one
    CTA per SM at any depth) 3 stages where they fit."""

    for n_pad, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (10240, 8192), (57344, 8192),
                     (8192, 28672), (1024, 4096), (1024, 8192), (18432, 16384), (106496, 16384)):
        for epi in (Epilogue(), Epilogue(activation="swiglu", bias=True)):
            for m in (1, 3, 8):
                cfg = gv.pick_gemv_config(m, n_pad, k, epi)
                cfg.check(epi)
                ctas = n_pad // (64 * cfg.tiles) * cfg.splits
                assert cfg.pdl and cfg.warps == 8 and cfg.tokens == {1: 1, 3: 4, 8: 8}[m]
                assert cfg.ctas_per_sm() == {3: 1, 2: 2}[cfg.stages]
                assert cfg.stages == (3 if math.ceil(ctas / 132) % 2 else 2)  # odd rounds: one CTA per SM
            for m in (9, 16):
                cfg = gv.pick_gemv_config(m, n_pad, k, epi)
                cfg.check(epi)
                assert cfg.tokens == 16 and cfg.tile_tokens == 16 and cfg.ctas_per_sm() == 1
                deeper = dataclasses.replace(cfg, stages=3)
                assert cfg.stages == (3 if deeper.smem_bytes() <= 227 * 1024 else 2)
    rule = {(n, k): (c.stages, c.splits, c.cluster) for n, k in ((4096, 4096), (4096, 14336), (8192, 8192),
                                                                 (57344, 8192), (1024, 4096), (1024, 1024),
                                                                 (28672, 4096), (10240, 8192), (18432, 16384))
            for c in [gv.pick_gemv_config(1, n, k, Epilogue())]}
    assert rule == {(4096, 4096): (3, 1, False), (4096, 14336): (3, 2, True), (8192, 8192): (3, 1, False),
                    (57344, 8192): (3, 1, False), (1024, 4096): (3, 2, True), (1024, 1024): (3, 1, False),
                    (28672, 4096): (2, 1, False), (10240, 8192): (2, 1, False), (18432, 16384): (3, 1, False)}
    assert gv.GemvConfig(4, 1, 4).ctas_per_sm() == 2
    swiglu_split = gv.pick_gemv_config(16, 1024, 4096, Epilogue(activation="swiglu"))
    assert swiglu_split.cluster and swiglu_split.stages == 2  # 3 would exceed shared memory by 64 bytes
    with pytest.raises(ValueError):
        gv.GemvConfig(4, 1, 4).check(Epilogue(activation="swiglu"))
    with pytest.raises(ValueError):
        gv.GemvConfig(8, 1, 5).check(Epilogue())  # 8 warps x 5 slots exceed shared memory


def test_64_token_tile_stages_and_padded_tma_rows():
    """64-token tiles: all the shared memory (8 stages) within one wave, two CTAs per SM (5) past it,
    and for two-warpgroup (SwiGLU) tiles only with >= 24 k-tiles per split. W4A16 reads a tile-high
    copy of x where unsplit 64-token or any 128-token tiles end in a mostly empty one, 256-token tiles
    in a partly empty one (:func:`ng.tma_rows`)."""
    swiglu = Epilogue(activation="swiglu")
    stages = {(n, k, epi.activation): ng.pick_config(64, n, k, epi, False).stages
              for n, k in ((4096, 4096), (4096, 14336), (28672, 4096), (10240, 8192)) for epi in (Epilogue(), swiglu)}
    assert stages == {(4096, 4096, "identity"): 8, (4096, 4096, "swiglu"): 4, (4096, 14336, "identity"): 8,
                      (4096, 14336, "swiglu"): 8, (28672, 4096, "identity"): 5, (28672, 4096, "swiglu"): 4,
                      (10240, 8192, "identity"): 5, (10240, 8192, "swiglu"): 8}
    rows = {m: ng.tma_rows(m, ng.pick_config(m, 28672, 4096, Epilogue(), False), False)
            for m in (20, 33, 47, 48, 64, 65, 95, 96, 129, 200, 224, 300, 600)}
    # 129-256 tokens: one 256-token tile, any part of it empty; beyond one tile on two warpgroups
    # only a last tile over three quarters empty
    assert rows == {20: 20, 33: 64, 47: 64, 48: 48, 64: 64, 65: 128, 95: 128, 96: 96, 129: 256, 200: 256, 224: 256,
                    300: 300, 600: 600}
    one_wg = {m: ng.tma_rows(m, ng.pick_config(m, 2560, 4096, Epilogue(), False), False) for m in (129, 200, 300, 600)}
    assert one_wg == {129: 256, 200: 256, 300: 384, 600: 600}
    assert ng.tma_rows(33, ng.pick_config(33, 4096, 4096, Epilogue(), False), False) == 33  # K-split grid
    assert ng.tma_rows(80, ng.pick_config(80, 4096, 14336, Epilogue(), False), False) == 128  # 128-token K-splits pad
    # one-warpgroup 128-token tiles: padded beyond a fifth empty (102 tokens), not only beyond a quarter
    one_tile = {m: ng.tma_rows(m, ng.pick_config(m, 6144, 4096, Epilogue(), False), False) for m in (96, 102, 103, 112)}
    assert ng.pick_config(96, 6144, 4096, Epilogue(), False).warpgroups == 1
    assert one_tile == {96: 128, 102: 128, 103: 103, 112: 112}
    assert ng.tma_rows(33, ng.pick_config(33, 28672, 4096, Epilogue(), True), True) == 33  # W4A8


def test_w4a16_routes_decode_to_the_gemv():
    """Up to 8 tokens the GEMV on any weight; 9-16 tokens only on one-wave weights (<= 132 CTAs of
    64 rows, 128 with SwiGLU) with K <= 8192; beyond 16 the WGMMA kernel."""

    plain, swiglu = Epilogue(), Epilogue(activation="swiglu")
    assert all(gv.use_gemv(m, n, k, plain, 132) for m in (1, 8) for n, k in ((57344, 8192), (8192, 28672)))
    assert gv.use_gemv(16, 6144, 4096, plain, 132) and gv.use_gemv(9, 8448, 8192, plain, 132)
    assert not gv.use_gemv(16, 8512, 4096, plain, 132)  # 133 CTAs: two waves
    assert not gv.use_gemv(12, 8192, 14336, plain, 132)  # long K: the WGMMA kernel streams as well
    assert gv.use_gemv(16, 16896, 4096, swiglu, 132) and not gv.use_gemv(16, 16896, 4096, plain, 132)
    assert not gv.use_gemv(17, 4096, 4096, plain, 132)


# ----------------------------------------------------------------------------- GPU
def _epilogue_f64(acc, epi: Epilogue, bias, residual):
    y = acc
    if epi.bias:
        y = y + bias.double()
    y = apply_activation(y, epi.activation)
    if epi.residual:
        y = y + residual.double()
    return y


def _gpu_case(m, n, k, epi, seed, mode, config=None, out_offset=0):
    torch.manual_seed(seed)
    dev = "cuda"
    w = torch.randn(n, k, device=dev) * 0.05
    if epi.activation == "swiglu":
        w = interleave_gate_up(w[: n // 2], w[n // 2:])
    qw = get_format("nvfp4-w4a16").quantize_weight(w)
    prep = ng.prepare(qw.data, qw.scale, qw.tensor_scale)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    n_out = n // 2 if epi.activation == "swiglu" else n
    bias = torch.randn(n, device=dev).to(torch.bfloat16) if epi.bias else None
    res = torch.randn(m, n_out, device=dev).to(torch.bfloat16) if epi.residual else None
    # out_offset elements in: an output buffer that is contiguous but not 16-byte aligned
    out = torch.full((m * n_out + out_offset,), float("nan"), dtype=torch.bfloat16, device=dev)[out_offset:].view(m, n_out)
    fn = nw8.nvfp4_w4a8 if mode == "w4a8" else ng.nvfp4_w4a16
    fn(x, prep, epi, bias, res, config=config, out=out)
    if mode == "w4a8":
        acc = w4a8.accumulate(x.cpu(), qw.data.cpu(), qw.scale.cpu(), qw.tensor_scale.cpu()).double().to(dev)
    else:
        acc = x.double() @ (dequant_f64(qw.data.cpu(), qw.scale.cpu()).to(dev) * qw.tensor_scale.double()).T
    ref = _epilogue_f64(acc, epi, bias, res)
    return out, ref


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a8"])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 80, 100, 257, 4096])  # 80, 100, 257: W4A16 reads a padded copy of x
def test_gpu_matches_float64_reference(mode, m):
    out, ref = _gpu_case(m, 1000, 2048, Epilogue(), seed=m, mode=mode)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 4e-3, err


PREFILL_RULE_CASES = [  # (m, n, k, epilogue, the rule's config): W4A16 layouts from 65 tokens
    # one wave of two-warpgroup CTAs where 64-row CTAs would need a second (300: last tile partly empty, unpadded)
    (300, 4096, 4096, Epilogue(bias=True), ng.Config(128, 2, 5, 1)),
    (100, 14336, 4096, Epilogue(activation="silu", residual=True), ng.Config(128, 2, 5, 1)),
    (128, 10240, 8192, Epilogue(), ng.Config(128, 2, 5, 1)),
    # grids of at most half a wave: K-splits as clusters (64 CTAs x 2, 16 x 4, 24 x 2 with the last tile partial)
    (128, 4096, 14336, Epilogue(bias=True), ng.Config(128, 1, 6, 2, cluster=True)),
    (80, 1024, 4096, Epilogue(activation="silu", residual=True), ng.Config(128, 1, 6, 4, cluster=True)),
    (300, 1024, 8192, Epilogue(activation="gelu_tanh"), ng.Config(128, 1, 6, 2, cluster=True)),
    # 256-token tiles in two-warpgroup CTAs: one, x padded to it; persistent; the last partly empty, unpadded
    (129, 14336, 4096, Epilogue(bias=True), ng.Config(256, 2, 3, 1)),
    (200, 10240, 8192, Epilogue(activation="silu", residual=True), ng.Config(256, 2, 3, 1)),
    (256, 28672, 4096, Epilogue(activation="gelu_tanh"), ng.Config(256, 2, 3, 1, persistent=True)),
    (512, 14336, 4096, Epilogue(bias=True, activation="silu"), ng.Config(256, 2, 3, 1, persistent=True)),
    (512, 14336, 4096, Epilogue(residual=True), ng.Config(256, 2, 3, 1)),  # FP32 staging: no room to persist
    (1000, 4096, 4096, Epilogue(activation="gelu_tanh"), ng.Config(256, 2, 3, 1)),
    (2100, 1024, 4096, Epilogue(bias=True, residual=True), ng.Config(256, 2, 3, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,epi,config", PREFILL_RULE_CASES)
def test_gpu_prefill_rule_layouts_match_float64(m, n, k, epi, config):
    """The rule's W4A16 prefill layouts (two-warpgroup one-wave grids, cluster K-splits of
    half-wave grids, 256-token tiles) match float64 through the default route."""
    assert ng.pick_config(m, n, k, epi, False) == config
    out, ref = _gpu_case(m, n, k, epi, seed=m, mode="w4a16")
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


W4A8_RULE_CASES = [  # (m, n, k, epilogue, the rule's config): W4A8 layouts from 256 tokens
    (256, 6144, 4096, Epilogue(bias=True), ng.Config(256, 1, 6, 1, persistent=True)),  # one wave, one warpgroup
    (256, 4096, 4096, Epilogue(activation="gelu_tanh"), ng.Config(256, 1, 6, 2, cluster=True)),  # half a wave: K halves
    (384, 4096, 4096, Epilogue(residual=True), ng.Config(128, 2, 8, 1)),  # 1.5 tiles of 256, both one wave
    (1000, 6144, 4096, Epilogue(activation="silu"), ng.Config(256, 1, 6, 1, persistent=True)),  # 384 CTAs, rows first
    (300, 6144, 4096, Epilogue(activation="silu", residual=True), ng.Config(256, 2, 5, 1, persistent=True)),
    (1000, 4096, 4096, Epilogue(bias=True), ng.Config(256, 2, 5, 1, persistent=True)),  # last tile partial
    (2100, 28672, 4096, Epilogue(activation="silu"), ng.Config(256, 2, 4, 1, persistent=True, tokens_fastest=True)),
    (600, 4096, 4096, Epilogue(activation="swiglu", bias=True), ng.Config(256, 2, 5, 1)),  # exchange in the stages
    (2000, 8192, 4096, Epilogue(activation="swiglu"), ng.Config(256, 2, 3, 1, persistent=True, tokens_fastest=True)),
]


def test_rule_layout_cases_are_the_rules_picks():
    """The configs the GPU rule-layout tests expect are the ones the rules pick, checked on the CPU
    so that no GPU call is spent on a wrong expectation."""
    for w4a8_mode, cases in ((False, PREFILL_RULE_CASES), (True, W4A8_RULE_CASES)):
        for m, n, k, epi, config in cases:
            assert ng.pick_config(m, n, k, epi, w4a8_mode) == config, (m, n, k, epi)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,epi,config", W4A8_RULE_CASES)
def test_gpu_w4a8_rule_layouts_match_float64(m, n, k, epi, config):
    """The W4A8 rule's layouts (one or two warpgroups, persistent in one wave and beyond in
    either tile order, SwiGLU with and without a CTA per tile) match the W4A8 reference in
    float64 through the default route."""
    assert ng.pick_config(m, n, k, epi, True) == config
    out, ref = _gpu_case(m, n, k, epi, seed=m, mode="w4a8")
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1056, 8192, 14336, 28672, 40960])  # rows held in 1 / 2 / 4 / 8 groups per thread; read twice
def test_gpu_act_quant_is_bit_exact(k):
    torch.manual_seed(8)
    x = (torch.randn(33, k, device="cuda") * torch.logspace(-3, 3, k, device="cuda")).to(torch.bfloat16)
    x[0] = 0
    # the kernel's branch-free division: bf16 subnormals (a subnormal scale; signed zeros), zeros
    # among values, 60 octaves in one row
    x[1] = (torch.randn(k, device="cuda") * 2.0**-130).to(torch.bfloat16)
    x[2, ::3] = 0
    x[3] = (torch.randn(k, device="cuda") * torch.exp2(torch.randint(-30, 30, (k,), device="cuda").float()))
    xq, s = nw8.quantize_activation(x)
    # reference on the CPU (CUDA torch divides by a Python scalar as a multiply by its reciprocal)
    rq, rs = w4a8.quantize_activation(x.cpu()[:, ng.w4a8_k_permutation(k)])
    assert torch.equal(xq.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a8"])
@pytest.mark.parametrize("epi", [Epilogue(bias=True, activation="silu", residual=True),
                                 Epilogue(activation="gelu_tanh"), Epilogue(activation="swiglu", bias=True)])
def test_gpu_epilogues(mode, epi):
    out, ref = _gpu_case(37, 1024, 1536, epi, seed=7, mode=mode)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 4e-3, err


GPU_VARIANTS = [ng.Config(8, 1, 4, 4, pdl=True), ng.Config(16, 2, 4, 2, batched=True),
                ng.Config(8, 1, 8, 8, pdl=True, batched=True), ng.Config(128, 2, 5, 1), ng.Config(256, 2, 5, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,m,n,config,out_offset", [
    ("w4a8", 300, 1024, ng.Config(256, 2, 3, 1), 0),  # the staging tile fits only in two passes
    ("w4a16", 37, 1004, None, 0),  # N not a multiple of 8: element stores
    ("w4a8", 100, 1024, None, 1),  # output not 16-byte aligned: element stores
])
def test_gpu_output_staging(mode, m, n, config, out_offset):
    """The epilogue's shared-memory staging and 16-byte stores, and their fallbacks."""
    epi = Epilogue(bias=True, residual=True)
    out, ref = _gpu_case(m, n, 2048, epi, seed=11, mode=mode, config=config, out_offset=out_offset)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


PERSISTENT_CASES = [  # (mode, config, epilogue): every persistent CTA runs 2-8 output tiles
    ("w4a8", ng.Config(256, 2, 4, 1, persistent=True), Epilogue(bias=True, residual=True)),
    ("w4a8", ng.Config(256, 2, 5, 1, persistent=True), Epilogue(activation="silu")),  # 8 staging passes
    ("w4a8", ng.Config(128, 2, 3, 1, persistent=True), Epilogue(activation="swiglu", bias=True)),
    ("w4a16", ng.Config(128, 2, 4, 1, persistent=True), Epilogue(bias=True, residual=True)),
    ("w4a16", ng.Config(128, 1, 6, 1, persistent=True), Epilogue()),
    ("w4a8", ng.Config(256, 2, 4, 1, persistent=True, tokens_fastest=True), Epilogue(bias=True)),
    ("w4a16", ng.Config(128, 2, 5, 1, persistent=True, tokens_fastest=True), Epilogue(residual=True)),
    # W4A8 one-warpgroup 256-token tiles, faster persistent (session 46 tune)
    ("w4a8", ng.Config(256, 1, 5, 1, persistent=True), Epilogue(bias=True)),
    ("w4a8", ng.Config(256, 1, 5, 1, persistent=True, tokens_fastest=True), Epilogue(activation="silu", residual=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,config,epi", PERSISTENT_CASES)
def test_gpu_persistent_matches_float64_reference(mode, config, epi):
    """Persistent CTAs looping over more output tiles than there are SMs (a partial last token tile)."""
    out, ref = _gpu_case(1000, 8192, 1024, epi, seed=5, mode=mode, config=config)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 4e-3, err


SWIGLU_PREFILL_CASES = [  # (mode, m, config): None = the rule's
    ("w4a16", 300, None), ("w4a8", 300, None),
    ("w4a16", 1000, ng.Config(256, 2, 3, 1)), ("w4a8", 1000, ng.Config(256, 2, 5, 1)),  # in the drained stages
    ("w4a16", 1000, ng.Config(128, 2, 4, 1, persistent=True)),  # beside the pipeline, over 256 tiles
    ("w4a8", 1000, ng.Config(256, 2, 3, 1, persistent=True, tokens_fastest=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,m,config", SWIGLU_PREFILL_CASES)
def test_gpu_swiglu_prefill_tile(mode, m, config):
    """SwiGLU at prefill token counts (128- and 256-token tiles): the up half reaches the gate half
    through the drained activation stages, or in a persistent CTA through memory of its own."""
    out, ref = _gpu_case(m, 16384, 1536, Epilogue(activation="swiglu", residual=True), seed=3, mode=mode, config=config)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 4e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("mode,config", [(mode, c) for c in GPU_VARIANTS for mode in ("w4a16", "w4a8")
                                         if ng.fits(c, Epilogue(), mode == "w4a8")])
def test_gpu_config_variants(mode, config):
    """Code variants the benchmarks select explicitly: PDL, batched WGMMA issue, and the
    setmaxnreg-rebalanced two-warpgroup large tiles."""
    m = min(config.bn, 200) - 3
    out, ref = _gpu_case(m, 1024, 2048, Epilogue(bias=True, residual=True), seed=9, mode=mode, config=config)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


CLUSTER_CASES = [  # (mode, turnstile config, M, epilogue): several row blocks per launch, 2-8 splits
    ("w4a16", ng.Config(64, 1, 8, 2), 64, Epilogue()),
    ("w4a16", ng.Config(64, 1, 5, 4), 61, Epilogue(bias=True, activation="silu", residual=True)),
    ("w4a16", ng.Config(16, 2, 4, 4, pdl=True), 40, Epilogue(activation="swiglu", bias=True, residual=True)),  # 3 token tiles
    ("w4a16", ng.Config(32, 1, 8, 8), 32, Epilogue(activation="gelu_tanh")),
    ("w4a16", ng.Config(64, 2, 8, 2), 64, Epilogue(activation="swiglu", bias=True)),
    ("w4a8", ng.Config(64, 1, 4, 2), 64, Epilogue(bias=True)),
    ("w4a8", ng.Config(32, 2, 4, 4), 50, Epilogue(residual=True)),
    ("w4a8", ng.Config(256, 1, 6, 2), 256, Epilogue(bias=True)),  # half-wave W4A8 grids (session 46 tune)
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,config,m,epi", CLUSTER_CASES)
def test_gpu_cluster_split_equals_turnstile_and_float64(mode, config, m, epi):
    """K-splits meeting in a cluster's distributed shared memory: bit for bit the turnstile's
    output (the same partials, summed in split order), and the float64 reference."""
    clustered = dataclasses.replace(config, cluster=True)
    out, ref = _gpu_case(m, 1024, 4096, epi, seed=13, mode=mode, config=clustered)
    turnstile, _ = _gpu_case(m, 1024, 4096, epi, seed=13, mode=mode, config=config)
    assert torch.isfinite(out).all() and torch.equal(out, turnstile)
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,epi", [(24, 14336, 6144, Epilogue(bias=True)),  # 224 CTAs, clusters of 2
                                       (16, 10240, 8192, Epilogue(activation="swiglu")),  # 320 CTAs, clusters of 4
                                       (32, 3584, 18944, Epilogue(residual=True))])  # 224 CTAs, clusters of 8
def test_gpu_two_warpgroup_split_clusters_match_float64(m, n, k, epi):
    """Two-warpgroup 16-32-token K-split grids the rule makes clusters (more CTAs than SMs, under
    90 % of 2 per SM or over 2 per SM) match float64."""
    config = ng.pick_config(m, n, k, epi, False)
    assert config.cluster and config.stages == 4 and config.warpgroups == 2
    out, ref = _gpu_case(m, n, k, epi, seed=m, mode="w4a16", config=config)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,epi", [(32, 4096, 14336, Epilogue(bias=True)),  # 64 CTAs x 4 splits
                                       (24, 10240, 8192, Epilogue(activation="silu", residual=True)),  # 160 x 2
                                       (32, 14336, 4096, Epilogue(bias=True, residual=True)),  # 224 unsplit
                                       (17, 1024, 4096, Epilogue(activation="gelu_tanh"))])  # 16 x 4
def test_gpu_halved_split_one_warpgroup_grids_match_float64(m, n, k, epi):
    """17-32-token grids whose two-warpgroup splits would run <= 16 k-tiles: the rule's
    one-warpgroup CTAs at half the splits (turnstile) match float64 through the default route."""
    config = ng.pick_config(m, n, k, epi, False)
    assert config.warpgroups == 1 and config.stages == 4 and not config.cluster
    out, ref = _gpu_case(m, n, k, epi, seed=m, mode="w4a16")
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


SHORT_SPLIT_CASES = [  # (M, N, K, epilogue): the rule's one-wave short-split configs, 12-32 tokens
    (12, 4096, 4096, Epilogue(bias=True, residual=True)),  # 2-split cluster, explicit (the GEMV route takes 12)
    (17, 6144, 4096, Epilogue(bias=True, residual=True)),  # unsplit, 16 stages
    (32, 4096, 4096, Epilogue(activation="silu")),  # 2-split cluster
    (24, 3584, 3584, Epilogue(bias=True)),  # 2 splits of 14 k-tiles
    (32, 6144, 4096, Epilogue(activation="swiglu", bias=True)),  # two warpgroups, 2-split cluster, 12 stages
    (24, 5632, 8192, Epilogue(bias=True, residual=True)),  # 8-16-k-tile turnstile runs: two warpgroups, 2-split cluster
    (32, 8192, 8192, Epilogue(activation="swiglu")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,epi", SHORT_SPLIT_CASES)
def test_gpu_short_split_one_wave_matches_float64(m, n, k, epi):
    """16-32-token grids the turnstile would split into <= 7-k-tile runs (17-32 tokens: <= 16 on
    wide weights): the rule's one wave of SM-filling CTAs (unsplit or a 2-split cluster, 12-16
    stages) matches float64, through the default route where it takes the WGMMA kernel."""
    config = ng.pick_config(m, n, k, epi, False)
    assert config.stages >= 12 and config.splits <= 2 and config.cluster == (config.splits == 2)
    out, ref = _gpu_case(m, n, k, epi, seed=m, mode="w4a16", config=config if m <= 16 else None)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 12, 16])
@pytest.mark.parametrize("config,epi", [(None, Epilogue()),
                                        (None, Epilogue(bias=True, activation="silu", residual=True)),
                                        (None, Epilogue(activation="swiglu", bias=True, residual=True)),
                                        ("split3", Epilogue(activation="gelu_tanh")),
                                        ("cluster3", Epilogue(bias=True, residual=True)),
                                        ("cluster4", Epilogue(activation="swiglu", bias=True, residual=True))])
def test_gpu_gemv_matches_float64_reference(m, config, epi):
    """The decode GEMV: through the default W4A16 route (the rule's config where the route takes
    the WGMMA kernel), an uneven 3-way K-split through the global turnstile, and K-splits meeting in
    a cluster's distributed shared memory; 9-16 tokens in two 8-token MMA fragments."""

    n, k = 1024, 4096
    tokens = 16 if m > 8 else 8
    cfg = {"split3": gv.GemvConfig(8, 1, 2, 3, tokens),
           "cluster3": gv.GemvConfig(8, 1, 3, 3, tokens, pdl=True, cluster=True),
           "cluster4": gv.GemvConfig(8, 2, 2, 4, tokens, cluster=True),
           None: None if gv.use_gemv(m, n, k, epi, 132) else gv.pick_gemv_config(m, n, k, epi)}[config]
    out, ref = _gpu_case(m, n, k, epi, seed=10 + m, mode="w4a16", config=cfg)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_gemv_multi_round_grid(m):
    """The GEMV rule's config (through the default route where it takes the GEMV) on a grid of three
    rounds of one CTA per SM (288 row blocks), which the rule gives 3 stages: every CTA beyond the
    first round is written."""

    n, k = 18432, 1024
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = gv.pick_gemv_config(m, n, k, Epilogue(), sms)
    assert cfg.stages == 3 and n // 64 > 2 * sms
    route = None if gv.use_gemv(m, n, k, Epilogue(bias=True), sms) else cfg  # None: the default route
    out, ref = _gpu_case(m, n, k, Epilogue(bias=True), seed=20 + m, mode="w4a16", config=route)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 4e-3
