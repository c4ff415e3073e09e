"""FP8 KV cache (``Recipe(kv_cache="fp8")``): calibrated scales, the attention it simulates, and the
checkpoint entries vLLM reads, against float64 math written out here."""
import copy
import json
import math

import pytest
import torch
from f64_reference import e4m3_round_f64
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

import quantkit
from quantkit.calibrate import Recipe, quantize
from quantkit.eval.bench import _cache_kwarg
from quantkit.export import describe
from quantkit.export.io import CheckpointError
from quantkit.nn.kv_cache import (
    attention_modules,
    calibrate_kv_cache,
    enable_kv_cache,
    kv_qdq,
    kv_scales,
)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def rotate_half_f64(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def attention_inputs(model, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The hidden states (after the input norm) and (cos, sin) that layer ``layer``'s attention
    receives when ``model`` runs ``ids``."""
    seen = {}

    def grab(module, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["pe"] = kwargs["position_embeddings"]

    handle = model.model.layers[layer].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen["h"], seen["pe"]


def weight_f64(proj) -> torch.Tensor:
    """The weight a projection applies, float or quantized (``QuantLinear``: its dequantized weight)."""
    return (proj.dequantized_weight() if isinstance(proj, quantkit.QuantLinear) else proj.weight).double()


def keys_values_f64(attn, h: torch.Tensor, pe: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE keys and values ``[B, kv_heads, T, head_dim]`` in float64 from ``attn``'s
    projections (weight-only or unquantized)."""
    b, t, _ = h.shape
    d = attn.head_dim
    k = (h.double() @ weight_f64(attn.k_proj).T).view(b, t, -1, d).transpose(1, 2)
    v = (h.double() @ weight_f64(attn.v_proj).T).view(b, t, -1, d).transpose(1, 2)
    cos, sin = (p.double().unsqueeze(1) for p in pe)
    return k * cos + rotate_half_f64(k) * sin, v


def test_kv_qdq_is_e4m3_of_the_quotient_times_the_scale_and_saturates():
    torch.manual_seed(1)
    x = torch.randn(4, 2, 64, 16, dtype=torch.bfloat16) * 3
    x[0, 0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])
    scale = torch.tensor(0.011)
    got = kv_qdq(x, scale)
    quotient = (x.double() / scale.double()).float().double()  # the division is FP32, as vLLM's cache write
    expect = (e4m3_round_f64(quotient) * scale.double()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expect)
    assert got[0, 0, 0, 0].item() == pytest.approx(448 * 0.011, rel=1e-2) and got[0, 0, 0, 2] == 0
    assert torch.equal(kv_qdq(got, scale), got)  # idempotent: a cache re-read gives the same keys


def test_calibrated_scales_are_the_largest_post_rope_key_and_value_over_448():
    model, ids = tiny_llama(), torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(2))
    float_model = copy.deepcopy(model)
    quantize(model, Recipe("fp8-dynamic", kv_cache="fp8"), ids, device="cpu", batch_size=2)
    scales = kv_scales(model)
    assert sorted(scales) == [f"model.layers.{i}.self_attn" for i in range(2)]
    for attention in attention_modules(model).values():
        del attention.kv_cache  # the weights are calibrated with the cache in the model dtype
    for i in range(2):
        # the calibration records layer i's keys in its float run on the inputs the calibrated
        # layers before it give: those of the quantized model
        h, pe = attention_inputs(model, i, ids)
        k, v = keys_values_f64(float_model.model.layers[i].self_attn, h, pe)
        k_scale, v_scale = scales[f"model.layers.{i}.self_attn"]
        assert k_scale.dtype == torch.float32 and k_scale.item() == pytest.approx(k.abs().max().item() / 448, rel=1e-5)
        assert v_scale.item() == pytest.approx(v.abs().max().item() / 448, rel=1e-5)


def test_calibrate_kv_cache_adds_scales_to_an_already_quantized_model():
    model, ids = tiny_llama(13), torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(14))
    quantkit.quantize_model(model, "nvfp4-w4a16")
    inputs = [attention_inputs(model, i, ids) for i in range(2)]  # before: every layer's cache in float
    calibrate_kv_cache(model, ids, batch_size=2)
    for i, (h, pe) in enumerate(inputs):
        k, v = keys_values_f64(model.model.layers[i].self_attn, h, pe)
        k_scale, v_scale = kv_scales(model)[f"model.layers.{i}.self_attn"]
        assert k_scale.item() == pytest.approx(k.abs().max().item() / 448, rel=1e-5)
        assert v_scale.item() == pytest.approx(v.abs().max().item() / 448, rel=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attention_over_the_fp8_cache_matches_float64_math(implementation):
    model = tiny_llama(3)
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(4))
    attn = model.model.layers[0].self_attn
    h, pe = attention_inputs(model, 0, ids)
    k, v = keys_values_f64(attn, h, pe)
    k_scale, v_scale = k.abs().max() / 448, v.abs().max() / 448
    enable_kv_cache(model, {"model.layers.0.self_attn": (k_scale, v_scale)})
    causal = torch.full((h.shape[1], h.shape[1]), -math.inf).triu(1)[None, None]  # additive, as the model builds it
    with torch.no_grad():
        got = attn(hidden_states=h, position_embeddings=pe, attention_mask=causal)[0]

    def fp8(x, s):  # the FP32 scale and quotient, E4M3 rounding, back in float64
        s = s.float().double()
        return e4m3_round_f64((x / s).float().double()) * s

    def attention_f64(k, v):
        b, t, _ = h.shape
        q = (h.double() @ attn.q_proj.weight.double().T).view(b, t, -1, attn.head_dim).transpose(1, 2)
        cos, sin = (p.double().unsqueeze(1) for p in pe)
        q = q * cos + rotate_half_f64(q) * sin
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        logits = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
        logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return out @ attn.o_proj.weight.double().T

    expect = attention_f64(fp8(k, k_scale), fp8(v, v_scale))
    unquantized = attention_f64(k, v)
    assert (got.double() - expect).abs().max() < 1e-5 * expect.abs().max()
    assert (unquantized - expect).abs().max() > 100 * (got.double() - expect).abs().max()  # not a no-op


def test_cached_decoding_equals_the_full_forward():
    model = tiny_llama(5)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    quantize(model, Recipe("fp8-dynamic", kv_cache="fp8"), ids, device="cpu")
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        cache = model(ids[:, :-1], use_cache=True)[1]
        step = model(ids[:, -1:], **{_cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-5, rtol=1e-5)


def test_the_wrapped_attention_compiles_to_one_graph():
    model = tiny_llama(7)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(8))
    quantize(model, Recipe("fp8-dynamic", kv_cache="fp8"), ids, device="cpu")
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    assert torch.allclose(compiled, eager, atol=1e-6)


@pytest.mark.parametrize("export,k_name,v_name", [
    ("compressed-tensors", "self_attn.k_scale", "self_attn.v_scale"),
    ("modelopt", "self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
])
def test_checkpoint_holds_the_scales_where_vllm_reads_them_and_loads_back(export, k_name, v_name, tmp_path):
    model = tiny_llama(9)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(10))
    quantize(model, Recipe("nvfp4", kv_cache="fp8"), ids, device="cpu")
    logits = model(ids).logits
    out = quantkit.save(model, tmp_path / "ck", export=export)
    cfg = json.loads((out / "config.json").read_text())
    assert not str(cfg.get("_attn_implementation") or "").startswith("quantkit")  # a plain HF config
    qcfg = cfg["quantization_config"]
    if export == "modelopt":
        assert qcfg["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
        sidecar = json.loads((out / "hf_quant_config.json").read_text())
        assert sidecar["quantization"]["kv_cache_quant_algo"] == "FP8"
    else:
        scheme = qcfg["kv_cache_scheme"]
        assert (scheme["num_bits"], scheme["type"], scheme["strategy"], scheme["dynamic"], scheme["symmetric"]) == \
            (8, "float", "tensor", False, True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for i, (k, v) in enumerate(kv_scales(model).values()):
            assert f.get_tensor(f"model.layers.{i}.{k_name}").dtype == torch.float32
            assert f.get_tensor(f"model.layers.{i}.{k_name}").item() == k.item()
            assert f.get_tensor(f"model.layers.{i}.{v_name}").item() == v.item()
    assert describe(out)["kv_cache"] == "fp8"
    loaded = quantkit.load(out, dtype=torch.float32)
    assert {n: (k.item(), v.item()) for n, (k, v) in kv_scales(loaded).items()} == \
        {n: (k.item(), v.item()) for n, (k, v) in kv_scales(model).items()}
    assert torch.allclose(loaded(ids).logits, logits, atol=1e-5, rtol=0)
    # the attention of the loaded model quantizes its cache: scales too small change the logits
    enable_kv_cache(loaded, {n: (k / 64, v / 64) for n, (k, v) in kv_scales(loaded).items()})
    assert not torch.allclose(loaded(ids).logits, logits, atol=1e-3, rtol=0)


def _saved(tmp_path, export="compressed-tensors"):
    model = tiny_llama(11)
    quantize(model, Recipe("fp8-dynamic", kv_cache="fp8"), torch.randint(0, 256, (2, 8)), device="cpu")
    return quantkit.save(model, tmp_path / "ck", export=export)


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_missing_or_invalid_scale_is_a_clear_error(tmp_path):
    out = _saved(tmp_path)
    _rewrite(out, lambda t: t.pop("model.layers.1.self_attn.v_scale"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.v_scale.*missing"):
        quantkit.load(out)
    out = _saved(tmp_path / "nan")
    _rewrite(out, lambda t: t.__setitem__("model.layers.0.self_attn.k_scale", torch.tensor(float("nan"))))
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_scale = nan is not a positive finite"):
        quantkit.load(out)


def test_an_unknown_kv_cache_scheme_or_recipe_is_refused(tmp_path):
    out = _saved(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"]["num_bits"] = 4
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="kv_cache_scheme .* is not one quantkit reads"):
        quantkit.load(out)
    with pytest.raises(ValueError, match="unknown KV-cache format 'int8'"):
        Recipe("nvfp4", kv_cache="int8")


def test_a_model_without_kv_cache_keeps_its_attention_and_config(tmp_path):
    model = tiny_llama(12)
    quantize(model, Recipe("nvfp4"), torch.randint(0, 256, (2, 8)), device="cpu")
    assert model.config._attn_implementation == "sdpa" and not kv_scales(model)
    out = quantkit.save(model, tmp_path / "ck")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    assert describe(out)["kv_cache"] is None
