"""Reference numerics against independent references: torchao (NVFP4), torch's float8 cast, float64 math."""
import math

import pytest
import torch

from quantkit.formats import FORMAT_NAMES, get_format
from quantkit.formats import codecs, fp8, layouts, mx, nvfp4


def fresh(shape, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    if outliers:
        w.view(-1)[torch.randint(0, w.numel(), (20,), generator=g)] *= 300.0
        w[1, :16] = 0.0                     # an all-zero NVFP4 block
        w[2, 16:48] = 1e-40                 # FP32 subnormals
        w[3, 5] = -0.0
    return w


# ---------------------------------------------------------------- E2M1
def test_e2m1_grid_and_ties_round_to_even():
    vals = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 7.0, 1e9])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    got = codecs.e2m1_decode(codecs.e2m1_encode(vals))
    assert got.tolist() == want
    assert codecs.e2m1_decode(codecs.e2m1_encode(-vals)).tolist() == [-v for v in want]


def test_e2m1_matches_float64_nearest_even():
    x = torch.randn(50000, dtype=torch.float64) * 3
    grid = torch.tensor(codecs.E2M1_GRID, dtype=torch.float64)
    a = x.abs().clamp(max=6.0)
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    # among nearest grid points prefer the even index
    cand = (dist == best).double() * (1 + (torch.arange(8) % 2 == 0).double())
    ref = grid[cand.argmax(1)] * torch.sign(x)
    assert torch.equal(codecs.e2m1_decode(codecs.e2m1_encode(x.float())).double(), ref)


def test_e2m1_decode_every_byte_from_its_bits():
    """Every uint8: sign bit 3, exponent bits 2-1, mantissa bit 0 of the low nibble (exponent 0:
    subnormal ``m/2``, else ``2^(e-1)(1 + m/2)``); the high nibble ignored; code 8 is -0.0."""
    got = codecs.e2m1_decode(torch.arange(256, dtype=torch.uint8))
    for byte in range(256):
        e, m, negative = (byte >> 1) & 3, byte & 1, bool(byte & 8)
        mag = m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        assert got[byte].item() == (-mag if negative else mag)
        assert math.copysign(1.0, got[byte].item()) == (-1.0 if negative else 1.0)


def test_nibble_packing_low_nibble_is_even_index():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = codecs.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(codecs.unpack_nibbles(packed), codes)


def test_e4m3_equals_torch_cast_and_saturates():
    x = torch.randn(100000) * 100
    x[:4] = torch.tensor([1000.0, -1000.0, 448.0, 1e-9])
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    got = codecs.e4m3_encode(x)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert got[0].float() == 448 and got[1].float() == -448
    assert torch.isnan(codecs.e4m3_encode(torch.tensor([math.nan]))).all()


def test_e8m0_scale_is_floor_log2_minus_emax():
    amax = torch.tensor([1.0, 3.0, 448.0, 0.0, 2.0**-130])
    e = codecs.e8m0_from_amax(amax, 448.0, round_up=False)
    assert e.tolist() == [127 - 8, 128 - 8, 135 - 8, 0, 0]
    assert codecs.e8m0_from_amax(torch.tensor([7.5, 3.9]), 6.0, round_up=False).tolist() == [127, 126]
    assert codecs.e8m0_decode(torch.tensor([127, 128, 0], dtype=torch.uint8)).tolist() == [1.0, 2.0, 2.0**-127]


def test_e8m0_floor_scale_is_exact_below_powers_of_two():
    """The OCP floor rule reads ``floor(log2 amax)`` from the exponent: FP32 ``log2`` of the value one
    ulp below ``2**k`` rounds to ``k``. Against Python's exact ``frexp`` on every power of two and
    its lower neighbour, plus the limits (Inf gives the largest scale)."""
    powers = torch.exp2(torch.arange(-126, 128, dtype=torch.float32))
    amax = torch.cat([powers, torch.nextafter(powers, torch.zeros_like(powers)), torch.tensor([math.inf])])
    e = codecs.e8m0_from_amax(amax, 6.0, round_up=False)
    ref = [min(254, max(0, math.frexp(a)[1] - 1 - 2 + 127)) for a in amax[:-1].double().tolist()] + [254]
    assert e.tolist() == ref
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([torch.nextafter(torch.tensor(16.0), torch.tensor(0.0)).item(), 1.0, 0.75])
    assert get_format("mxfp4").quantize_weight(w).dequantize()[0, :3].tolist() == [12.0, 1.0, 1.0]


def test_e8m0_scale_rounded_up_never_clips():
    # 448 maps exactly; one FP32 ulp above 448 needs the next power of two; 0 and 2**-130 give the
    # smallest scale
    amax = torch.tensor([448.0, 448.0 + 2.0**-15, 449.0, 1.0, 3.0 * 2**20, 0.0, 2.0**-130, math.nan])
    e = codecs.e8m0_from_amax(amax, 448.0, round_up=True)
    assert e.tolist() == [127, 128, 128, 127 - 8, 127 + 13, 0, 0, 255]
    assert codecs.e8m0_from_amax(torch.tensor([6.0, 6.5, 1.0]), 6.0, round_up=True).tolist() == [127, 128, 125]


# ---------------------------------------------------------------- NVFP4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_bit_exact_with_torchao(dtype, seed):
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    w = fresh((96, 256), seed).to(dtype)
    qw = get_format("nvfp4").quantize_weight(w)
    pts = nvfp4_tensor.per_tensor_amax_to_scale(w.float().abs().amax())
    # our tensor scale is 1/fl(2688/amax) (the checkpoint convention): within one ulp of torchao's
    assert abs(qw.tensor_scale.item() - pts.item()) <= torch.finfo(torch.float32).eps * pts.item()
    scales, data = nvfp4_tensor.nvfp4_quantize(w, per_tensor_scale=qw.tensor_scale)
    assert torch.equal(qw.scale.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(qw.data, data)


def test_nvfp4_dequantize_is_float64_product():
    w = fresh((32, 128), 3)
    qw = get_format("nvfp4").quantize_weight(w)
    codes = codecs.unpack_nibbles(qw.data)
    ref = torch.tensor(codecs.E2M1_GRID, dtype=torch.float64)[(codes & 7).long()] * (1 - 2 * (codes >> 3).double())
    ref = ref * qw.scale.double().repeat_interleave(16, 1) * qw.tensor_scale.double()
    assert torch.equal(qw.dequantize().double(), ref.float().double())


def test_nvfp4_all_zero_tensor_is_finite_zero():
    qw = get_format("nvfp4").quantize_weight(torch.zeros(4, 32))
    assert torch.equal(qw.dequantize(), torch.zeros(4, 32))


def test_nvfp4_tiny_tensor_keeps_a_finite_nonzero_scale():
    """A tensor amax so small that ``2688 / amax`` overflows is floored at ``2**-116``: the values
    still quantize (to within the E2M1 grid), not all to zero."""
    w = torch.zeros(2, 16)
    w[0, :2] = torch.tensor([1e-36, 5e-37])
    qw = get_format("nvfp4").quantize_weight(w)
    assert 0 < qw.tensor_scale.item() < math.inf
    assert torch.allclose(qw.dequantize()[0, :2].double(), w[0, :2].double(), rtol=0.07)


@pytest.mark.parametrize("name", ["nvfp4", "fp8", "fp8-dynamic", "fp8-block"])
def test_non_finite_activations_poison_their_block_never_clip(name):
    """A NaN activation stays NaN (FP8) or makes its 16-block NaN (NVFP4: E2M1 has no NaN); every
    other value quantizes as if the NaN were 0 (the amax ignores NaN, as the GPU's ``max.f32``).
    An Inf makes every value under its scale NaN: never a silent clip to the top value."""
    act = get_format(name).activation
    x = torch.randn(4, 256) * 100
    x[0, 5] = math.nan
    out = act.qdq(x)
    zeroed = x.clone()
    zeroed[0, 5] = 0
    nan = torch.zeros_like(x, dtype=torch.bool)
    nan[0, :16] = name == "nvfp4"
    nan[0, 5] = True
    assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan], act.qdq(zeroed)[~nan])
    x[0, 5] = math.inf
    group = {"nvfp4": x, "fp8": x, "fp8-dynamic": x[0], "fp8-block": x[0, :128]}[name]
    assert act.qdq(x).isnan().sum() == group.numel()


def test_fp8_scale_underflow_is_one_not_nan():
    """``amax / 448`` underflowing to 0 (amax ~1e-43) gets scale 1, as an all-zero block: no NaN."""
    w = torch.zeros(1, 128)
    w[0, 0] = 1e-43
    qw = get_format("fp8").quantize_weight(w)
    assert qw.scale.item() == 1.0 and not torch.isnan(qw.dequantize()).any()


def test_nvfp4_w4a8_stores_the_nvfp4_w4a16_weight():
    w = fresh((32, 128), 4)
    a, b = get_format("nvfp4-w4a8").quantize_weight(w), get_format("nvfp4-w4a16").quantize_weight(w)
    assert a.format == "nvfp4-w4a8" and torch.equal(a.data, b.data) and torch.equal(a.tensor_scale, b.tensor_scale)
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert torch.equal(a.dequantize(), b.dequantize())


# ---------------------------------------------------------------- FP8 and MX
@pytest.mark.parametrize("block", [(0, 0), (1, 0), (128, 128), (1, 128)])
def test_fp8_blocks_match_float64_reference(block):
    x = fresh((136, 256), 4)
    q, s = fp8.quantize(x, block)
    br, bc = block[0] or 136, block[1] or 256
    xd = x.double()
    for i in range(0, 136, br):
        for j in range(0, 256, bc):
            blk = xd[i:i + br, j:j + bc]
            amax = blk.abs().max()
            scale = torch.tensor(amax.item() / 448.0 if amax > 0 else 1.0, dtype=torch.float32)
            assert s[i // br, j // bc] == scale
            ref = (x[i:i + br, j:j + bc] / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(q[i:i + br, j:j + bc].view(torch.uint8), ref.view(torch.uint8))
    exact = q.double() * s.double().repeat_interleave(br, 0)[:136].repeat_interleave(bc, 1)
    assert torch.equal(fp8.dequantize_with(q, s, block), exact.float())  # one correctly rounded product


@pytest.mark.parametrize("bits", [8, 4])
def test_mx_matches_float64_reference(bits):
    # MXFP8 scales rounded up (no block max clips), MXFP4 scales by the OCP floor rule
    x = fresh((16, 128), 5)
    elem = mx.MXElement(bits)
    scale = elem.scales(x)
    amax = x.double().abs().reshape(16, 4, 32).amax(-1).clamp(min=1e-300)
    if bits == 8:
        ref_e = torch.ceil(torch.log2(amax / 448.0)) + 127
    else:
        ref_e = torch.floor(torch.log2(amax)) - 2 + 127
    ref_e = torch.where(amax > 1e-300, ref_e, torch.zeros_like(amax)).clamp(0, 254)
    assert torch.equal(scale.double(), ref_e)
    out = elem.decode(elem.encode(x, scale), scale)
    x_scaled = x.double().reshape(16, 4, 32) / torch.exp2(ref_e - 127).unsqueeze(-1)
    if bits == 8:
        assert (x_scaled.abs() <= 448).all()
        ref = x_scaled.float().to(torch.float8_e4m3fn).double()
    else:
        assert (x_scaled.abs() > 6).any()  # the floor rule clips some block maxima
        ref = codecs.e2m1_decode(codecs.e2m1_encode(x_scaled.float().clamp(-6, 6))).double()
    assert torch.equal(out.double(), (ref * torch.exp2(ref_e - 127).unsqueeze(-1)).reshape(16, 128))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_mx_bit_exact_with_torchao(bits, seed):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = fresh((64, 256), seed)
    elem_dtype, mode = ((torch.float8_e4m3fn, ScaleCalculationMode.RCEIL) if bits == 8
                        else (torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR))
    scales, data = mx_tensor.to_mx(x, elem_dtype, 32, scaling_mode=mode)
    elem = mx.MXElement(bits)
    ours = elem.scales(x)
    assert torch.equal(ours, scales.view(torch.uint8).reshape(ours.shape))
    assert torch.equal(elem.encode(x, ours).view(torch.uint8), data.view(torch.uint8))


def four_over_six_reference(x: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """E4M3 scales ``[R, K/16]`` of FP32 ``x [R, K]`` by the Four Over Six rule, evaluated in float64:
    per block, the candidate ``e4m3(clamp((amax / top) / ts, 2**-6, 448))`` (FP32, the spec
    formula) for top = 6 and 4 whose float64 reconstruction ``e2m1(x / (s·ts))·s·ts`` (nearest,
    ties to the even grid index, saturating) has the lower squared error; 6 on a tie."""
    blocks = x.reshape(x.shape[0], -1, 16)
    amax = blocks.abs().amax(-1)
    grid = torch.tensor(codecs.E2M1_GRID, dtype=torch.float64)
    even = 1 + (torch.arange(8) % 2 == 0).double()
    best, best_err = None, None
    for top in (6.0, 4.0):
        s = ((amax / top) / ts).clamp(2**-6, 448).to(torch.float8_e4m3fn)
        step = s.double().unsqueeze(-1) * ts.double()
        a = (blocks.double() / step).abs().clamp(max=6.0)
        dist = (a.unsqueeze(-1) - grid).abs()
        nearest = grid[((dist == dist.min(-1, keepdim=True).values).double() * even).argmax(-1)]
        err = ((nearest * torch.sign(blocks.double()) * step - blocks.double()) ** 2).sum(-1)
        if best is None:
            best, best_err = s, err
        else:
            best = torch.where(err < best_err, s.view(torch.uint8), best.view(torch.uint8)).view(torch.float8_e4m3fn)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_four_over_six_scales_match_float64_reference(seed):
    x = fresh((64, 512), seed)
    ts = nvfp4.tensor_scale_from_amax(x.abs().amax())
    got = nvfp4.block_scales(x, ts, four_over_six=True).view(torch.uint8)
    assert torch.equal(got, four_over_six_reference(x, ts).view(torch.uint8))
    six = nvfp4.block_scales(x, ts).view(torch.uint8)
    assert 0.2 < (got != six).float().mean() < 0.8  # both rules are chosen
    row, col = divmod(int(x.abs().argmax()), x.shape[1])
    assert got[row, col // 16] == six[row, col // 16]  # the tensor max's block: its 4-scale would clamp at 448


def test_nvfp4_four_over_six_lowers_every_blocks_error():
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 10, 256)
    errors = {}
    for name in ("nvfp4", "nvfp4-4over6"):
        codes, scale, ts = get_format(name).activation.quantize(x)
        xq = get_format(name).activation.qdq(x)
        assert torch.equal(xq, nvfp4.dequantize_codes(codes, scale, ts))
        errors[name] = ((xq.double() - x.double()) ** 2).reshape(-1, 16).sum(-1)
    assert (errors["nvfp4-4over6"] <= errors["nvfp4"]).all()
    assert errors["nvfp4-4over6"].sum() < 0.9 * errors["nvfp4"].sum()


def test_nvfp4_four_over_six_weights_are_nvfp4_under_the_chosen_scales():
    w = fresh((32, 128), 7)
    qw = get_format("nvfp4-4over6").quantize_weight(w)
    assert qw.format == "nvfp4-4over6"
    assert torch.equal(qw.scale.view(torch.uint8), four_over_six_reference(w, qw.tensor_scale).view(torch.uint8))
    plain = get_format("nvfp4").quantize_weight(w, qw.scale, qw.tensor_scale)
    assert torch.equal(qw.data, plain.data) and torch.equal(qw.dequantize(), plain.dequantize())


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_round_trips_with_bounded_error(name):
    fmt = get_format(name)
    w = fresh((256, 512), 6, outliers=False)
    rel = ((fmt.quantize_weight(w).dequantize() - w).norm() / w.norm()).item()
    assert rel < (0.2 if "4" in name else 0.05)
    if fmt.activation is not None:
        x = torch.randn(3, 7, 512)
        xq = fmt.activation.qdq(x)
        assert xq.shape == x.shape and ((xq - x).norm() / x.norm()).item() < (0.2 if "4" in name else 0.05)


# ---------------------------------------------------------------- layouts and errors
def test_blocked_layout_matches_documented_formula_and_inverts():
    rows, cols = 160, 7
    sf = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    flat = layouts.to_blocked(sf)
    rk = math.ceil(cols / 4)
    assert flat.numel() == math.ceil(rows / 128) * 128 * rk * 4
    for r in range(rows):
        for j in range(cols):
            idx = (r // 128) * rk * 512 + (j // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (j % 4)
            assert flat[idx] == sf[r, j]
    assert int((flat != 0).sum()) == rows * cols  # padding is zero
    assert torch.equal(layouts.from_blocked(flat, rows, cols), sf)
    e4m3 = torch.randn(130, 5).to(torch.float8_e4m3fn)
    assert torch.equal(layouts.from_blocked(layouts.to_blocked(e4m3), 130, 5).view(torch.uint8), e4m3.view(torch.uint8))


def test_bad_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown format 'int3'.*nvfp4"):
        get_format("int3")
    with pytest.raises(ValueError, match="K=40 is not divisible by the block size 16"):
        get_format("nvfp4").quantize_weight(torch.randn(8, 40))
    with pytest.raises(ValueError, match="floating point"):
        get_format("fp8").quantize_weight(torch.ones(8, 32, dtype=torch.int32))
    w = torch.randn(8, 32)
    w[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        get_format("mxfp8").quantize_weight(w)
    w = torch.randn(8, 128)
    w[0, 0] = 3.3e38  # finite, but NVFP4 / MX scales overflow there
    for name in ("nvfp4", "mxfp8", "mxfp4", "fp8"):
        with pytest.raises(ValueError, match="at or above 2\\*\\*127"):
            get_format(name).quantize_weight(w)
    w[0, 0] = 2.0**126  # below the limit every format dequantizes finitely
    assert all(torch.isfinite(get_format(name).quantize_weight(w).dequantize()).all() for name in FORMAT_NAMES)
    with pytest.raises(ValueError, match="needs its tensor_scale"):
        get_format("nvfp4").quantize_weight(torch.randn(8, 32), scale=torch.ones(8, 2).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_storage_declares_the_quantized_shapes(name):
    fmt = get_format(name)
    qw = fmt.quantize_weight(torch.randn(200, 256))
    (ds, dd), (ss, sd), has_ts = fmt.weight.storage(200, 256)
    assert (tuple(qw.data.shape), qw.data.dtype, tuple(qw.scale.shape), qw.scale.dtype) == (ds, dd, ss, sd)
    assert has_ts == (qw.tensor_scale is not None)
