"""QuantLinear, the reference GEMM and quantize_model against float64 math."""
import pytest
import torch
from torch import nn

from quantkit import kernels
from quantkit.formats import FORMAT_NAMES, get_format
from quantkit.kernels import reference
from quantkit.kernels.epilogue import Epilogue, interleave_gate_up
from quantkit.nn import QuantLinear, quantize_model
from quantkit.nn.swap import fused_groups


def linear(k=256, n=128, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.exp(torch.randn(n, 1)))
    return lin


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantlinear_equals_float64_reference(name):
    fmt = get_format(name)
    lin = linear()
    q = QuantLinear.from_linear(lin, name)
    x = torch.randn(5, 3, 256)
    w = q.qweight.dequantize().double()
    xq = (fmt.activation.qdq(x) if fmt.activation else x).double()
    ref = xq @ w.T + lin.bias.double()
    out = q(x)
    assert out.shape == (5, 3, 128) and out.dtype == x.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_state_dict_round_trip_is_bit_exact():
    lin = linear(bias=True)
    q = QuantLinear.from_linear(lin, "nvfp4", input_scale=torch.tensor(0.01))
    fresh = QuantLinear(256, 128, True, format="nvfp4", static_input=True, dtype=torch.float32)
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(4, 256)
    assert set(q.state_dict()) == {"weight", "weight_scale", "weight_tensor_scale", "input_scale", "bias"}
    assert torch.equal(fresh(x), q(x))


def test_epilogue_reference_matches_float64():
    gate, up = torch.randn(128, 64), torch.randn(128, 64)
    w = interleave_gate_up(gate, up)
    qw = get_format("nvfp4-w4a16").quantize_weight(w)
    wd = qw.dequantize().double()
    x, bias, res = torch.randn(6, 64), torch.randn(256), torch.randn(6, 128)
    out = reference.gemm(x, qw, Epilogue(bias=True, activation="swiglu", residual=True), bias=bias, residual=res)
    y = x.double() @ wd.T + bias.double()
    g = torch.cat([y[:, i:i + 64] for i in range(0, 256, 128)], 1)
    u = torch.cat([y[:, i + 64:i + 128] for i in range(0, 256, 128)], 1)
    ref = g * torch.sigmoid(g) * u + res.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_requant_fp8_block_epilogue_decodes_to_bf16_output():
    qw = get_format("fp8-block").quantize_weight(torch.randn(256, 256))
    x = torch.randn(3, 256)
    q, s = reference.gemm(x, qw, Epilogue(requant="fp8-block"))
    y = reference.gemm(x, qw).to(torch.bfloat16).float()
    decoded = q.float() * s.repeat_interleave(128, 1)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    assert ((decoded - y).abs() <= y.abs() * 2.0 ** -4 + 1e-12).all()  # within half an E4M3 ulp


def test_reference_mode_on_cpu_and_dispatch():
    q = QuantLinear.from_linear(linear(), "fp8-block")
    x = torch.randn(2, 256)
    assert kernels.select_backend(x, q.qweight) is None
    with kernels.use_reference():
        assert torch.equal(q(x), q(x))


def test_quantize_model_reports_every_linear_and_shares_fused_scales():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = quantize_model(model, "nvfp4", ignore=["lm_head", "*.0.mlp.down_proj"])
    assert {r.name for r in report.layers} == names
    assert {r.name: r.reason for r in report.skipped} == {
        "lm_head": "ignored by pattern", "model.layers.0.mlp.down_proj": "ignored by pattern"}
    fp8_model = LlamaForCausalLM(cfg)
    fp8_report = quantize_model(fp8_model, "fp8-block")  # K=64/96 do not divide by 128: all skipped
    assert {r.name: r.reason for r in fp8_report.skipped}["model.layers.0.mlp.down_proj"] == "K=96 not divisible by 128 (fp8-block)"
    assert all(isinstance(model.get_submodule(r.name), QuantLinear) for r in report.quantized)
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight_tensor_scale == attn.k_proj.weight_tensor_scale == attn.v_proj.weight_tensor_scale
    amax = max(model.model.layers[1].self_attn.q_proj.qweight.dequantize().abs().max(), 0)
    assert attn.q_proj.weight_tensor_scale.item() >= amax / (6 * 448) * 0.9
    mlp = model.model.layers[1].mlp
    assert mlp.gate_proj.weight_tensor_scale == mlp.up_proj.weight_tensor_scale
    assert fused_groups(["a.q_proj", "a.k_proj", "a.v_proj", "b.q_proj"]) == [["a.q_proj", "a.k_proj", "a.v_proj"]]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_an_empty_batch_gives_an_empty_output(fmt):
    linear = torch.nn.Linear(256, 64)
    for q in (QuantLinear.from_linear(linear, fmt),) + ((QuantLinear.from_linear(
            linear, fmt, input_scale=get_format(fmt).activation.input_scale_from_amax(torch.tensor(4.0))),)
            if get_format(fmt).activation is not None and get_format(fmt).activation.static else ()):
        for shape in ((0, 256), (2, 0, 256)):
            out = q(torch.randn(shape))
            assert out.shape == (*shape[:-1], 64) and out.dtype == torch.float32


def test_quantizing_a_tied_output_layer_unties_it_and_a_string_ignore_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    ids = torch.randint(0, 128, (1, 5))
    with pytest.raises(TypeError, match=r"ignore takes a list of patterns, not the string 'lm_head'"):
        quantize_model(model, "nvfp4-w4a16", ignore="lm_head")
    quantize_model(model, "nvfp4-w4a16", ignore=[])
    before = model(ids).logits
    assert model.config.tie_word_embeddings is False
    model.tie_weights()  # transformers calls it on loads and resizes: the packed weight must stay
    model.lm_head._forget()
    assert model.lm_head.weight.dtype == torch.uint8 and torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8-dynamic", "mxfp8"])
def test_casts_skip_the_quantized_buffers_but_moves_and_sharing_reach_them(fmt):
    q = QuantLinear.from_linear(torch.nn.Linear(64, 32), fmt)
    dtypes = {n: b.dtype for n, b in q.named_buffers()}
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        assert {n: b.dtype for n, b in cast(q).named_buffers()} == dtypes
    q.share_memory()
    assert all(b.is_shared() for b in q.buffers()) and q.bias.is_shared()


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="in_features=40 is not divisible by the block size 16"):
        QuantLinear(40, 8, format="nvfp4")
    with pytest.raises(ValueError, match="takes no calibrated input scale"):
        QuantLinear(64, 8, format="nvfp4-w4a16", static_input=True)
    linear = torch.nn.Linear(64, 8)
    with torch.no_grad():
        linear.bias[2] = float("inf")
    with pytest.raises(ValueError, match="nvfp4: the bias contains NaN or Inf"):
        QuantLinear.from_linear(linear, "nvfp4")


@pytest.mark.parametrize("name,ms", [("nvfp4", (3, 5, 11)), ("fp8-block", (3, 5, 11)), ("mxfp8", (3, 5, 11)),
                                     ("nvfp4-w4a8", (4096, 4097, 5000))])
def test_quantlinear_compiled_first_is_one_graph(name, ms):
    """Compiled before any eager call, a QuantLinear traces once for every M (its caches are built
    at load, or left out of the trace) and equals the eager module (called after: its first eager
    call fills the reference path's cache, which a compiled call after it would retrace for)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counters outlive reset()
    q = QuantLinear.from_linear(linear(k=128, n=64), name)
    compiled = torch.compile(q, backend="aot_eager", dynamic=True)
    xs = [torch.randn(m, 128) for m in ms]
    outs = [compiled(x) for x in xs]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for x, out in zip(xs, outs):
        assert torch.equal(out, q(x)), x.shape


def test_buffers_assigned_anew_are_what_the_forward_reads():
    """Buffers replaced by assignment (``module.weight = t``, as accelerate's offload hooks do)
    after calls that cached the old ones: the next call reads the new weight, not the caches."""
    a = QuantLinear.from_linear(linear(k=128, n=64, bias=False), "nvfp4")
    b = QuantLinear.from_linear(linear(k=128, n=64, bias=False, seed=1), "nvfp4")
    x = torch.randn(3, 128)
    assert not torch.equal(a(x), b(x))
    a.weight, a.weight_scale, a.weight_tensor_scale = b.weight.clone(), b.weight_scale.clone(), b.weight_tensor_scale.clone()
    assert torch.equal(a(x), b(x))


def test_fused_moe_experts_are_split_and_quantized():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, head_dim=16)
    report = quantize_model(Qwen3MoeForCausalLM(cfg), "nvfp4")
    experts = {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    assert {r.name for r in report.quantized} == {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"} | experts
    assert {r.name: r.reason for r in report.skipped} == {
        "model.layers.0.mlp.gate": "MoE router: kept in high precision", "lm_head": "ignored by pattern"}
