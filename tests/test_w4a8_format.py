"""The ``nvfp4-w4a8`` format: W4A16 below the M crossover, W4A8 above, against float64 math.

The float64 reference here is independent of :mod:`quantkit.formats.w4a8`: E2M1 values from
their table, E4M3 rounding by nearest-grid search, FP32 divisions as float64 divisions rounded to
FP32 (exact: float64 holds the quotient to more than twice FP32's precision).
"""
import pytest
import torch

import quantkit
from quantkit import kernels
from quantkit.formats import get_format, w4a8
from quantkit.formats.codecs import unpack_nibbles
from quantkit.kernels.sm90 import nvfp4_supports
from quantkit.kernels.epilogue import Epilogue
from quantkit.nn import QuantLinear, quantize_model
from f64_reference import e4m3_round_f64

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_f64(packed: torch.Tensor) -> torch.Tensor:
    codes = unpack_nibbles(packed).long()
    return E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()


def w4a8_f64(x: torch.Tensor, qw) -> torch.Tensor:
    """float64 W4A8 accumulator ``[M, N']`` of ``x [M, K]`` (module docstring of formats.w4a8)."""
    n, k = qw.shape
    sb = qw.scale.double()
    c = torch.tensor([float(torch.floor(torch.log2(r.max()))) for r in sb], dtype=torch.float64)
    v = (e2m1_f64(qw.data).reshape(n, -1, 16) * sb[..., None]).reshape(n, k)
    w8 = e4m3_round_f64(v * 2.0 ** -c[:, None])
    x64 = x.double()
    amax = x64.abs().amax(1)
    sx = torch.where(amax > 0, (amax / 448).float().double(), torch.ones_like(amax))
    xq = e4m3_round_f64((x64 / sx[:, None]).float().double())
    return (xq @ w8.T) * sx[:, None] * 2.0 ** c[None, :] * qw.tensor_scale.double()


def layer(k: int, n: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.mul_(torch.exp(torch.randn(n, 1)))  # rows of different magnitudes: different c_n
    return lin


def test_crossover_rule():
    """W4A8 from M = 33 for N' >= 33792, 65 for N' >= 10240, 160 for N' >= 6144, 384 for
    N' >= 3072, 2048 for N' >= 2048, else 4096 (the H200 crossover, benchmarks/notes/w4a8_format.md;
    from 6144 rows re-timed on the H100, benchmarks/NOTES.md sessions 48-49)."""
    first_m = {128: 4096, 1024: 4096, 2047: 4096, 2048: 2048, 3071: 2048, 3072: 384, 4096: 384, 6143: 384,
               6144: 160, 8192: 160, 10239: 160, 10240: 65, 28672: 65, 33791: 65, 33792: 33, 57344: 33}
    for n, m_from in first_m.items():
        for m in (1, 32, 33, 64, 65, 127, 128, 159, 160, 255, 256, 383, 384, 1024, 2047, 2048, 4095, 4096, 8192):
            assert w4a8.use_w4a8(m, n) == (m >= m_from), (m, n)


@pytest.mark.parametrize("m,n,w4a8_path", [(32, 33792, False), (33, 33792, True), (64, 10240, False), (65, 10240, True),
                                           (159, 6144, False), (160, 6144, True),
                                           (383, 3072, False), (384, 3072, True), (4095, 128, False), (4096, 128, True)])
def test_reference_is_w4a16_below_and_w4a8_above_the_crossover(m, n, w4a8_path):
    k = 64
    lin = layer(k, n, seed=m)
    q8, q16 = QuantLinear.from_linear(lin, "nvfp4-w4a8"), QuantLinear.from_linear(lin, "nvfp4-w4a16")
    x = torch.randn(m, k) * torch.logspace(-2, 1, k)  # per-column spread: FP8 activation error is visible
    out8, out16 = q8(x.reshape(1, m, k)).reshape(m, n), q16(x)  # all leading dims count as tokens
    bias = lin.bias.detach().double()
    if w4a8_path:
        ref = w4a8_f64(x, q8.qweight) + bias
        assert torch.allclose(out8.double(), ref, rtol=2e-6, atol=1e-6 * ref.abs().max().item())
        err = ((out8 - out16).double().norm() / out16.double().norm()).item()
        assert 1e-3 < err < 5e-2, err  # the W4A8 rounding, not a no-op, within its error bound
    else:
        assert torch.equal(out8, out16)
        ref = x.double() @ q16.qweight.dequantize().double().T + bias
        assert ((out8.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_w4a8_accumulator_matches_float64_on_zero_rows_and_bf16_inputs():
    lin = layer(128, 64, seed=3)
    qw = get_format("nvfp4-w4a8").quantize_weight(lin.weight.detach())
    x = torch.randn(4096, 128).to(torch.bfloat16)
    x[5] = 0
    acc = w4a8.format_accumulate(x, qw)
    ref = w4a8_f64(x, qw)
    assert torch.equal(acc[5], torch.zeros(64)) and "w4a8" in qw.layouts  # converted weight cached
    assert torch.allclose(acc.double(), ref, rtol=2e-6, atol=1e-6 * ref.abs().max().item())
    assert torch.equal(w4a8.format_accumulate(x, qw), acc)  # cached weight: same result


def test_weights_are_nvfp4_w4a16_weights_and_need_no_calibration_data():
    from quantkit.calibrate.pipeline import quantize as calibrate
    from quantkit.calibrate.recipe import Recipe
    from test_eval_fixtures import tiny_llama

    assert not Recipe("nvfp4-w4a8").needs_data and get_format("nvfp4-w4a8").activation is None
    with pytest.raises(ValueError, match="takes no calibrated input scale"):
        QuantLinear(64, 8, format="nvfp4-w4a8", static_input=True)
    models = {fmt: tiny_llama(96) for fmt in ("nvfp4-w4a8", "nvfp4-w4a16")}
    for fmt, model in models.items():
        calibrate(model, Recipe(fmt, ("rtn",)), None)  # no data
    sd8, sd16 = models["nvfp4-w4a8"].state_dict(), models["nvfp4-w4a16"].state_dict()
    assert sd8.keys() == sd16.keys() and all(torch.equal(sd8[k], sd16[k]) for k in sd8)
    formats = {m.format for m in models["nvfp4-w4a8"].modules() if isinstance(m, QuantLinear)}
    assert formats == {"nvfp4-w4a8"}


def test_quantize_model_and_torch_compile_with_dynamic_tokens():
    model = torch.nn.Sequential(layer(64, 128), torch.nn.ReLU(), layer(128, 64, seed=1))
    quantize_model(model, "nvfp4-w4a8", ignore=[])
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        for m in (3, 4096, 7):  # W4A16, W4A8, W4A16 again
            x = torch.randn(m, 64)
            assert torch.equal(compiled(x), model(x)), m


def test_sm90_backend_takes_the_format():
    qw = get_format("nvfp4-w4a8").quantize_weight(torch.randn(256, 256))
    x = torch.randn(4, 256).to(torch.bfloat16)
    assert nvfp4_supports(x, qw, Epilogue(bias=True, activation="silu"))
    assert not nvfp4_supports(x, qw, Epilogue(requant="fp8-block")) and not nvfp4_supports(x.float(), qw, Epilogue())
    assert kernels.select_backend(x, qw) is None  # CPU: the reference


# ----------------------------------------------------------------------------- checkpoint
@pytest.mark.parametrize("export", ["compressed-tensors", "modelopt"])
def test_checkpoint_is_nvfp4_w4a16_on_disk_and_loads_as_nvfp4_w4a8(export, tmp_path):
    import json

    from safetensors.torch import load_file
    from test_eval_fixtures import tiny_llama

    ids = torch.tensor([[1, 5, 17, 33, 70, 7, 50, 3]])
    dirs = {}
    for fmt in ("nvfp4-w4a8", "nvfp4-w4a16"):
        model = tiny_llama(96).to(torch.bfloat16)
        quantize_model(model, fmt)
        dirs[fmt] = quantkit.save(model, tmp_path / fmt, export=export)
    tensors = {f: {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(p).items()} for f, d in dirs.items()}
    assert tensors["nvfp4-w4a8"].keys() == tensors["nvfp4-w4a16"].keys()
    assert all(torch.equal(v, tensors["nvfp4-w4a16"][k]) for k, v in tensors["nvfp4-w4a8"].items())
    qcfg = {f: json.loads((d / "config.json").read_text())["quantization_config"] for f, d in dirs.items()}
    # what vLLM reads (the preset / quant_algo) is nvfp4-w4a16's: it serves the checkpoint W4A16
    assert {k: v for k, v in qcfg["nvfp4-w4a8"].items() if k != "quantkit_format"} == qcfg["nvfp4-w4a16"]
    assert qcfg["nvfp4-w4a8"]["quantkit_format"] == "nvfp4-w4a8" and "quantkit_format" not in qcfg["nvfp4-w4a16"]
    for fmt, d in dirs.items():
        loaded = quantkit.load(d)
        assert {m.format for m in loaded.modules() if isinstance(m, QuantLinear)} == {fmt}
        assert torch.isfinite(loaded(ids).logits).all()


def test_cli_quantize_writes_an_nvfp4_w4a8_checkpoint(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from quantkit.cli import app
    from test_eval_fixtures import tiny_llama, tiny_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = tiny_tokenizer()
    tiny_llama(len(tok), max_positions=128).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q"), "--format", "nvfp4-w4a8"])
    assert res.exit_code == 0, res.output
    layers = [m for m in quantkit.load(tmp_path / "q").modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and {m.format for m in layers} == {"nvfp4-w4a8"}


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(m, n) for n in (1024, 8192, 10240)
                                 for m in (1, 16, 64, 65, 127, 128, 159, 160, 255, 256, 383, 384, 4096)]
                         + [(32, 33792), (33, 33792)])
def test_gpu_quantlinear_equals_its_cpu_reference(m, n):
    """bf16 output vs the FP32 reference: one bf16 rounding plus the GPU's accumulation order."""
    lin = layer(1024, n, seed=m).to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nvfp4-w4a8")
    x = torch.randn(m, 1024).to(torch.bfloat16)
    ref = q(x.float()).double()  # CPU reference in FP32 (same function: x holds bf16 values)
    qc = q.cuda()
    assert kernels.select_backend(x.cuda(), qc.qweight, qc.epilogue) is not None
    out = qc(x.cuda()).double().cpu()
    assert torch.isfinite(out).all()
    tol = 2.0 ** -8 * ref.abs() + 2.0 ** -8 * ref.abs().max(1, keepdim=True).values
    assert ((out - ref).abs() <= tol).all(), ((out - ref).abs() / ref.abs().max(1, keepdim=True).values).max()


@pytest.mark.gpu
def test_gpu_compile_and_cuda_graph_across_the_crossover():
    """One compiled graph for decode and prefill M (the kernel choice is inside the op)."""
    lin = layer(1024, 8192).to(torch.bfloat16).cuda()
    q = QuantLinear.from_linear(lin, "nvfp4-w4a8")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counters outlive reset(): other tests' graphs must not count
    compiled = torch.compile(q, dynamic=True)
    for m in (16, 512, 17):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        eager = q(x)
        assert torch.equal(compiled(x), eager), m
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 1
    static = torch.randn(512, 1024, dtype=torch.bfloat16, device="cuda")
    q(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = q(static)
    static.copy_(torch.randn_like(static))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, q(static))
