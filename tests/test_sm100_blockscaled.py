"""sm100 block-scaled GEMM (NVFP4, MXFP8): emulation on CPU, compile-only checks for sm_100a, GPU
numerics on Blackwell.

* The FP64 emulation (:mod:`quantkit.kernels.emulate`) reads the kernel's operands (packed values,
  128×4-swizzled scales) and must equal dequantize-then-matmul in float64, the project oracle
  (:mod:`quantkit.kernels.reference`) within bf16 rounding, and :mod:`quantkit.formats`'
  requantization within one step.
* One subprocess (``CUTE_DSL_ARCH=sm_100a``; the arch is read once per process) traces CuTe's
  scale-factor layout against the swizzle formula and compiles a covering set of kernel variants,
  keeping PTX and cubin; the tests read what it reports.
"""
import functools
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quantkit.formats import get_format, layouts
from quantkit.formats.codecs import (
    e2m1_decode,
    e8m0_from_amax,
    pack_nibbles,
    unpack_nibbles,
)
from quantkit.formats.mx import MXElement
from quantkit.formats.nvfp4 import block_scales, quantize_values, tensor_scale_from_amax
from quantkit.kernels import emulate, reference
from quantkit.kernels.epilogue import Epilogue, interleave_gate_up

FMTS = ("nvfp4", "mxfp8")


# ----------------------------------------------------------------------------- operands
def quantize_act(x: torch.Tensor, fmt: str):
    """Activation operands the way a producer hands them to the kernel: (values, swizzled scales,
    FP32 tensor scale or None)."""
    if fmt == "nvfp4":
        ts = tensor_scale_from_amax(x.float().abs().amax())
        sb = block_scales(x, ts)
        return pack_nibbles(quantize_values(x, sb, ts)), layouts.to_blocked(sb), ts
    elem = MXElement(8)
    e = elem.scales(x)
    return elem.encode(x, e), layouts.to_blocked(e), None


@functools.lru_cache(maxsize=None)
def operands(m: int, n: int, k: int, fmt: str, seed: int = 0, w: torch.Tensor | None = None):
    """Random-normal ``x [m, k]`` and ``w [n, k]`` quantized to ``fmt`` (cached: callers must not
    modify them); returns (x, qweight, kernel kwargs, s_g(x)), alpha = s_g(x)·s_g(w) for nvfp4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) if w is None else w
    qw = get_format(fmt).quantize_weight(w)
    xq, xs, ts = quantize_act(x, fmt)
    alpha = (ts * qw.tensor_scale).reshape(1) if fmt == "nvfp4" else None
    args = dict(x_q=xq, x_scale=xs, w_q=qw.data, w_scale=layouts.to_blocked(qw.scale), fmt=fmt, alpha=alpha)
    return x, qw, args, ts


def dequant_f64(values: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Row-major dequantization without the tensor scale, in float64 (independent of the swizzle)."""
    if fmt == "nvfp4":
        v = e2m1_decode(unpack_nibbles(values)).double()
        s = scale.double()
    else:
        v = values.double()
        s = torch.exp2(scale.double() - 127)
    return (v.reshape(v.shape[0], -1, emulate.BLOCK[fmt]) * s.unsqueeze(-1)).reshape(v.shape)


# ----------------------------------------------------------------------------- layout + emulation
@pytest.mark.parametrize("rows,cols", [(128, 4), (200, 24), (300, 8), (1, 1), (129, 5)])
def test_swizzle_formula_matches_to_blocked(rows, cols):
    sf = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    flat = layouts.to_blocked(sf)
    assert flat.numel() == emulate.swizzled_size(rows, cols)
    assert torch.equal(flat[emulate.swizzled_offsets(rows, cols)], sf)
    written = torch.zeros_like(flat, dtype=torch.bool)
    written[emulate.swizzled_offsets(rows, cols).reshape(-1)] = True
    assert int(flat[~written].count_nonzero()) == 0  # padding is zero
    assert torch.equal(emulate.write_scales(sf), flat)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,n,k", [(200, 256, 384), (64, 128, 256), (1, 384, 128)])
def test_emulated_gemm_equals_dequant_matmul(fmt, m, n, k):
    x, qw, args, ts = operands(m, n, k, fmt, seed=m + n + k)
    got = emulate.blockscaled_gemm(**args)
    xh = dequant_f64(args["x_q"], layouts.from_blocked(args["x_scale"], m, k // emulate.BLOCK[fmt]), fmt)
    want = xh @ dequant_f64(qw.data, qw.scale, fmt).T
    if fmt == "nvfp4":
        want = want * args["alpha"].double()
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


EPILOGUES = [
    Epilogue(),
    Epilogue(bias=True, activation="silu", residual=True),
    Epilogue(bias=True, activation="gelu_tanh"),
    Epilogue(activation="relu", residual=True),
    Epilogue(bias=True, activation="swiglu", residual=True),
]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("epi", EPILOGUES, ids=lambda e: f"{e.activation}-b{int(e.bias)}-r{int(e.residual)}")
def test_emulation_matches_reference_oracle(fmt, epi):
    """Emulation (swizzled operands, FP64) vs the project oracle (bf16 x, QuantizedWeight, FP32)."""
    m, n, k = 96, 256, 256
    x, qw, args, ts = operands(m, n, k, fmt, seed=7)
    g = torch.Generator().manual_seed(1)
    n_out = n // 2 if epi.activation == "swiglu" else n
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if epi.bias else None
    residual = torch.randn(m, n_out, generator=g).to(torch.bfloat16) if epi.residual else None
    got = emulate.blockscaled_gemm(**args, epilogue=epi, bias=bias, residual=residual).to(torch.bfloat16)
    want = reference.gemm(x, qw, epi, bias=bias, residual=residual, input_scale=ts)
    assert got.shape == want.shape == (m, n_out)
    # FP64 vs FP32 accumulation, both rounded to bf16: at most one bf16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert (got == want).float().mean() > 0.9


def test_swiglu_pairs_interleaved_gate_and_up_rows():
    m, n, k = 64, 128, 256
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(n, k, generator=g), torch.randn(n, k, generator=g)
    x, qw, args, _ = operands(m, 2 * n, k, "mxfp8", w=interleave_gate_up(gate, up))
    got = emulate.blockscaled_gemm(**args, epilogue=Epilogue(activation="swiglu"))
    xh = emulate.dequantize(args["x_q"], args["x_scale"], "mxfp8")
    gq, uq = (get_format("mxfp8").quantize_weight(t) for t in (gate, up))
    gh, uh = (dequant_f64(q.data, q.scale, "mxfp8") for q in (gq, uq))
    want = torch.nn.functional.silu(xh @ gh.T) * (xh @ uh.T)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_mxfp8_requant_exponent_bit_rule_equals_formats():
    """The epilogue's E8M0 rule, ``E - 8 + (mantissa > 0x600000)`` from the FP32 bits of the block
    amax (``MX_E4M3_EMAX``, ``E4M3_MAX_MANTISSA``), equals quantkit.formats' ``ceil(log2(fl(amax /
    448)))`` on every mantissa near 1.75 and on random amax over the normal exponent range."""
    g = torch.Generator().manual_seed(0)
    near = torch.arange(0x600000 - 4096, 0x600000 + 4096, dtype=torch.int64)
    exps = torch.randint(9, 254, (near.numel(),), generator=g)
    rand = torch.randint(0, 1 << 23, (1 << 20,), generator=g) | (torch.randint(9, 254, (1 << 20,), generator=g) << 23)
    bits = torch.cat([near | (exps << 23), rand])
    amax = bits.to(torch.int32).view(torch.float32)
    kernel_rule = ((bits >> 23) - 8 + (((bits & 0x7FFFFF) + (0x7FFFFF - 0x600000)) >> 23)).clamp(0, 254)
    assert torch.equal(e8m0_from_amax(amax, 448.0, round_up=True).long(), kernel_rule)


@pytest.mark.parametrize("out_fmt", FMTS)
@pytest.mark.parametrize("in_fmt", FMTS)
def test_requant_within_one_step_of_formats(in_fmt, out_fmt):
    """Requantized emulator output decodes within one element step of quantkit.formats applied to
    the same bf16 result, and scales within one code."""
    m, n, k = 200, 256, 256
    x, qw, args, _ = operands(m, n, k, in_fmt, seed=11)
    y = emulate.blockscaled_gemm(**args).to(torch.bfloat16)
    rq_scale = tensor_scale_from_amax(y.float().abs().amax()).reshape(1) if out_fmt == "nvfp4" else None
    vals, flat = emulate.blockscaled_gemm(**args, epilogue=Epilogue(requant=out_fmt), requant_scale=rq_scale)
    block = emulate.BLOCK[out_fmt]
    got_sf = emulate.read_scales(flat, m, n // block)
    if out_fmt == "nvfp4":
        assert vals.shape == (m, n // 2) and vals.dtype == torch.uint8 and flat.dtype == torch.float8_e4m3fn
        want_sf = block_scales(y, rq_scale)
        want_codes = quantize_values(y, want_sf, rq_scale)
        want_sf = want_sf.view(torch.uint8)
        got_v = e2m1_decode(unpack_nibbles(vals)).double()
        want_v = e2m1_decode(want_codes).double()
        step = torch.where(want_v.abs() >= 4, 2.0, torch.where(want_v.abs() >= 2, 1.0, 0.5))
        got_scaled = got_v.reshape(m, -1, block) * got_sf.view(torch.float8_e4m3fn).double().unsqueeze(-1)
        want_scaled = want_v.reshape(m, -1, block) * want_sf.view(torch.float8_e4m3fn).double().unsqueeze(-1)
        unit = torch.maximum(got_sf.view(torch.float8_e4m3fn).double(), want_sf.view(torch.float8_e4m3fn).double())
    else:
        assert vals.shape == (m, n) and vals.dtype == torch.float8_e4m3fn and flat.dtype == torch.uint8
        elem = MXElement(8)
        want_sf = elem.scales(y)
        want_q = elem.encode(y, want_sf)
        got_v, want_v = vals.double(), want_q.double()
        step = 2.0 ** (torch.floor(torch.log2(want_v.abs().clamp(min=2**-6))) - 3)
        got_scaled = got_v.reshape(m, -1, block) * torch.exp2(got_sf.double() - 127).unsqueeze(-1)
        want_scaled = want_v.reshape(m, -1, block) * torch.exp2(want_sf.double() - 127).unsqueeze(-1)
        unit = torch.exp2(torch.maximum(got_sf, want_sf).double() - 127)
    assert (got_sf.int() - want_sf.int()).abs().max() <= 1
    assert (got_sf == want_sf).float().mean() > 0.99
    tol = (step.reshape(m, -1, block) * unit.unsqueeze(-1)) * 1.0001
    assert ((got_scaled - want_scaled).abs() <= tol).all()
    assert (got_v == want_v).float().mean() > 0.99
    # the values are a real quantization of y: decoded error well under the bf16 signal
    dec = got_scaled.reshape(m, n) * (rq_scale.double() if out_fmt == "nvfp4" else 1.0)
    assert (dec - y.double()).norm() < 0.2 * y.double().norm()


# ----------------------------------------------------------------------------- compile-only (sm_100a)
COMPILE_CASES = {  # every (format, tile), every activation, both requants on 1-CTA and 2-CTA tiles
    # name: (fmt, tile, epilogue kwargs, has_alpha)
    "nvfp4_128x128_plain": ("nvfp4", (128, 128), {}, True),
    "nvfp4_256x128_bias_silu_res": ("nvfp4", (256, 128), dict(bias=True, activation="silu", residual=True), True),
    "nvfp4_128x256_swiglu_to_nvfp4": ("nvfp4", (128, 256), dict(bias=True, activation="swiglu", residual=True,
                                                               requant="nvfp4"), True),
    "nvfp4_256x256_relu_to_mxfp8": ("nvfp4", (256, 256), dict(activation="relu", requant="mxfp8"), True),
    "mxfp8_128x128_bias_gelu_res": ("mxfp8", (128, 128), dict(bias=True, activation="gelu_tanh", residual=True),
                                    False),
    "mxfp8_256x128_to_nvfp4": ("mxfp8", (256, 128), dict(requant="nvfp4"), False),
    "mxfp8_128x256_bias_swiglu": ("mxfp8", (128, 256), dict(bias=True, activation="swiglu"), False),
    "mxfp8_256x256_swiglu_res_to_mxfp8": ("mxfp8", (256, 256), dict(activation="swiglu", residual=True,
                                                                   requant="mxfp8"), False),
}

_WORKER = textwrap.dedent("""
    import json, os, sys, time
    from quantkit.kernels import emulate
    from quantkit.kernels.epilogue import Epilogue
    from quantkit.kernels.sm100 import compile_variant
    from quantkit.kernels.sm100.blockscaled_gemm import scale_layout_offsets

    cases, root = json.loads(sys.argv[1]), sys.argv[2]
    report = {"layout": {}, "compiled": {}}
    for rows, k, block in ((256, 128, 16), (160, 256, 32)):
        want = emulate.swizzled_offsets(rows, k // block).tolist()
        report["layout"][f"{rows}x{k}/{block}"] = scale_layout_offsets(rows, k, block) == want
    for name, (fmt, tile, epi, has_alpha) in cases.items():
        os.makedirs(f"{root}/{name}")  # CuTeDSL dumps nothing into a missing directory
        t = time.time()
        compile_variant(fmt, tuple(tile), Epilogue(**epi), has_alpha=has_alpha, arch="sm_100a",
                        options=f"--keep-ptx --keep-cubin --dump-dir {root}/{name}")
        report["compiled"][name] = round(time.time() - t, 2)
    print(json.dumps(report))
""")



@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("cutlass")
    root = tmp_path_factory.mktemp("sm100")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(COMPILE_CASES), str(root)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), root


def _artifact(root: Path, name: str, suffix: str) -> Path:
    (path,) = (root / name).glob(f"*{suffix}")
    return path


def test_cute_scale_layout_is_the_swizzle_formula(compiled):
    report, _ = compiled
    assert report["layout"] and all(report["layout"].values()), report["layout"]


@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_variant_compiles_to_blockscaled_tcgen05(compiled, name):
    report, root = compiled
    fmt, tile, epi, _ = COMPILE_CASES[name]
    assert name in report["compiled"]
    ptx = _artifact(root, name, ".ptx").read_text()
    assert ".target sm_100a" in ptx
    kind = "kind::mxf4nvf4.block_scale" if fmt == "nvfp4" else "kind::mxf8f6f4.block_scale"
    group = "cta_group::2" if tile[0] == 256 else "cta_group::1"
    mma = [line for line in ptx.splitlines() if "tcgen05.mma" in line]
    assert mma and all(kind in line and group in line for line in mma), mma[:2]
    if fmt == "nvfp4":
        assert all("block16" in line for line in mma)
    assert f"tcgen05.cp.{group}" in ptx  # scale factors smem -> tmem
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "tcgen05.ld.sync.aligned.32x32b.x32" in ptx
    assert ptx.index("tcgen05.wait::ld") > ptx.index("tcgen05.ld.sync")  # registers read after the wait
    requant = epi.get("requant")
    assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (requant == "nvfp4")
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (requant is not None)  # mxfp8 values / nvfp4 scales
    cubin = _artifact(root, name, ".cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF" and struct.unpack_from("<H", cubin, 0x12)[0] == 190  # EM_CUDA
    assert (struct.unpack_from("<I", cubin, 0x30)[0] >> 8) & 0xFF == 100  # SM 100
    assert b"sm_100a" in cubin


# ----------------------------------------------------------------------------- host checks (CPU)
def test_host_rejects_cpu_tensors_with_runtime_error():
    from quantkit.kernels.sm100 import blockscaled_gemm

    _, _, args, _ = operands(128, 128, 128, "nvfp4")
    with pytest.raises(RuntimeError, match="CUDA"):
        blockscaled_gemm(**args)


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import quantkit.kernels.sm100  # noqa: F401  (registers the ops)

    with FakeTensorMode():
        xq = torch.empty(300, 128, dtype=torch.uint8)
        wq = torch.empty(512, 128, dtype=torch.uint8)
        xs = torch.empty(emulate.swizzled_size(300, 16), dtype=torch.float8_e4m3fn)
        ws = torch.empty(emulate.swizzled_size(512, 16), dtype=torch.float8_e4m3fn)
        out = torch.ops.quantkit.sm100_blockscaled_gemm(xq, xs, wq, ws, None, None, None, "nvfp4", "swiglu")
        vals, sf = torch.ops.quantkit.sm100_blockscaled_gemm_requant(xq, xs, wq, ws, None, None, None, None,
                                                                     "nvfp4", "identity", "nvfp4")
    assert out.shape == (300, 256) and out.dtype == torch.bfloat16
    assert vals.shape == (300, 256) and sf.shape == (emulate.swizzled_size(300, 32),)


# ----------------------------------------------------------------------------- GPU (Blackwell only)
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tile", [(128, 128), (256, 128), (128, 256), (256, 256)])
@pytest.mark.parametrize("epi", EPILOGUES + [Epilogue(requant="nvfp4"), Epilogue(activation="swiglu",
                                                                                   requant="mxfp8")],
                         ids=lambda e: f"{e.activation}-b{int(e.bias)}-r{int(e.residual)}-{e.requant}")
def test_kernel_equals_emulation_on_blackwell(fmt, tile, epi):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (10, 0):
        pytest.skip("needs an sm_100 GPU")
    from quantkit.kernels.sm100 import blockscaled_gemm

    m, n, k = 300, 512, 768
    _, _, args, _ = operands(m, n, k, fmt, seed=5)
    g = torch.Generator().manual_seed(2)
    n_out = n // 2 if epi.activation == "swiglu" else n
    extra = dict(epilogue=epi,
                 bias=torch.randn(n, generator=g).to(torch.bfloat16) if epi.bias else None,
                 residual=torch.randn(m, n_out, generator=g).to(torch.bfloat16) if epi.residual else None,
                 requant_scale=torch.tensor([0.05]) if epi.requant == "nvfp4" else None)
    want = emulate.blockscaled_gemm(**args, **extra)
    cuda = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in {**args, **extra}.items()}
    got = blockscaled_gemm(**cuda, tile=tile)
    if epi.requant is None:
        torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2**-7, atol=1e-2)
    else:
        vals, flat = got
        block = emulate.BLOCK[epi.requant]
        want_vals, want_flat = want
        got_sf = emulate.read_scales(flat.cpu(), m, n_out // block)
        want_sf = emulate.read_scales(want_flat, m, n_out // block)
        assert (got_sf == want_sf).float().mean() > 0.98
        assert (vals.cpu().view(torch.uint8) == want_vals.view(torch.uint8)).float().mean() > 0.95
