"""MoE experts: split into per-expert Linears, calibrated on all tokens, quantized, saved under the
per-expert names vLLM's MoE loaders read, and reloaded bit for bit (tiny configs, CPU)."""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import warnings

import pytest
import torch
import transformers
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import quantkit
from quantkit.calibrate import pipeline
from quantkit.export import load, save
from quantkit.formats import get_format
from quantkit.nn import QuantLinear, quantize_model
from quantkit.nn.experts import LinearExperts, linearize_experts

E, LAYERS, H, I = 4, 2, 32, 32
VOCAB = 96

CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, moe_intermediate_size=I, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=E, num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=E, num_experts_per_tok=2),
    # transposed [E, H, 2I] storage, interleaved gate/up rows, biases, clamped SwiGLU, router with a bias
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=E, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"]),
}
# Where the experts of layer l live on the hub (what save_pretrained writes) and their leaf names
# (gate, up, down): vLLM's Qwen3-MoE loader calls FusedMoE.make_expert_params_mapping(
# ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj"),
# Mixtral's uses "w1", "w2", "w3" under block_sparse_moe (vllm/model_executor/models/{qwen3_moe,mixtral}.py);
# the mapping sends "experts.{e}.{leaf}." to the FusedMoE parameters "experts.w13_*" / "experts.w2_*"
# (vllm/model_executor/layers/fused_moe/layer.py). gpt-oss: fused on the hub; per-expert names as
# llm-compressor and GptOssForCausalLM.get_expert_mapping spell them.
HUB_EXPERTS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
               "gpt_oss": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# The tensors per expert Linear that vLLM's NVFP4 MoE methods register (w13_/w2_ + these):
# CompressedTensorsW4A4Nvfp4MoEMethod.create_weights (compressed_tensors_moe.py) and
# ModelOptNvFp4FusedMoE.create_weights (modelopt.py).
NVFP4_TENSORS = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
                 "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale")}
PROJ = ("gate_proj", "up_proj", "down_proj")


@functools.cache
def _float_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    config._experts_implementation = "eager"  # the reference loop, exact in float64
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model


def float_model(arch: str, dtype=torch.float32) -> torch.nn.Module:
    """A fresh copy of the tiny random ``arch`` model (fused experts) in ``dtype``."""
    return copy.deepcopy(_float_model(arch)).to(dtype)


def tokens(n: int, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def expert_names(layer: int, e: int) -> list[str]:
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}" for p in PROJ]


ALL_EXPERT_LINEARS = {n for layer in range(LAYERS) for e in range(E) for n in expert_names(layer, e)}


@pytest.mark.parametrize("arch", CONFIGS)
def test_linearized_model_gives_the_same_logits_without_copying_weights(arch):
    model = float_model(arch, torch.float64)
    ids = tokens(2)
    with torch.no_grad():
        reference = model(ids).logits
        fused = dict(model.model.layers[0].mlp.experts.named_parameters())
        assert linearize_experts(model) == {}
        assert not any(p.dim() == 3 for p in model.parameters())
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-12, atol=1e-12)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == E
    assert {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n} == ALL_EXPERT_LINEARS
    gate_up = fused["gate_up_proj"].detach()
    if arch == "gpt_oss":  # [E, H, 2I], gate/up interleaved in the last dimension
        gate, up = gate_up[1, :, 0::2].T, gate_up[1, :, 1::2].T
        torch.testing.assert_close(experts[1].gate_proj.bias, fused["gate_up_proj_bias"][1, 0::2], rtol=0, atol=0)
    else:  # [E, 2I, H] = [gate; up]; the per-expert weights are views of the fused storage
        gate, up = gate_up[1, :I], gate_up[1, I:]
        ptr = gate_up.untyped_storage().data_ptr()
        assert all(lin.weight.untyped_storage().data_ptr() == ptr for ex in experts for lin in (ex.gate_proj, ex.up_proj))
    assert torch.equal(experts[1].gate_proj.weight, gate) and torch.equal(experts[1].up_proj.weight, up)


OTHER_FAMILIES = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, moe_intermediate_size=I, shared_expert_intermediate_size=I,
        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, num_experts=E, num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, moe_intermediate_size=I, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
    "olmoe": lambda: transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, num_experts=E, num_experts_per_tok=2),
}


@pytest.mark.parametrize("arch", OTHER_FAMILIES)
def test_other_moe_families_are_linearized_and_fully_quantized(arch):
    """Shared experts (Qwen2-MoE, DeepSeek-V3), a dense first layer (DeepSeek-V3), OLMoE: the same
    logits after splitting, and every Linear quantized except the routers and lm_head."""
    torch.manual_seed(0)
    config = OTHER_FAMILIES[arch]()
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    ids = tokens(2)
    with torch.no_grad():
        reference = model(ids).logits
        assert linearize_experts(model) == {}
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-12, atol=1e-12)
    report = quantize_model(model.float(), "nvfp4-w4a16")
    moe_layers = range(1, LAYERS) if arch == "deepseek_v3" else range(LAYERS)
    assert {n for layer in moe_layers for e in range(E) for n in expert_names(layer, e)} <= {r.name for r in report.quantized}
    assert {r.name for r in report.skipped} == {"lm_head"} | {f"model.layers.{layer}.mlp.gate" for layer in moe_layers} | (
        {f"model.layers.{layer}.mlp.shared_expert_gate" for layer in moe_layers} if arch == "qwen2_moe" else set())


def test_unsupported_experts_layout_is_listed_with_its_reason():
    model = float_model("qwen3_moe")
    for layer in model.model.layers:
        layer.mlp.experts.has_post_expert_norm = True
    report = quantize_model(model, "nvfp4-w4a16")
    reasons = {r.name: r.reason for r in report.skipped}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert "post-expert norm" in reasons[name] and reasons[name].startswith("fused expert weights left unquantized")


class RecordingContext(pipeline.LayerContext):
    """LayerContext that keeps every calibrated layer's statistics in ``RecordingContext.stats``."""

    stats: dict[str, object] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordingContext.stats.update(self.stats)


def _never_route_last_expert(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[E - 1] = -1e4


def test_never_routed_expert_is_calibrated_on_all_tokens(monkeypatch):
    """gpt-oss whose router bias keeps expert 3 out of every top-2: its observers still see all
    tokens; its inputs' Hessian and its down_proj input amax equal float64 references computed from
    every token entering the MoE block."""
    model = float_model("gpt_oss")
    _never_route_last_expert(model)
    ids = tokens(4)
    routed, mlp_inputs = [], []
    reference = float_model("gpt_oss", torch.float64)
    _never_route_last_expert(reference)
    hooks = [reference.model.layers[0].mlp.router.register_forward_hook(lambda m, a, out: routed.append(out[2])),
             reference.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: mlp_inputs.append(a[0]))]
    with torch.no_grad():
        reference(ids)
    for h in hooks:
        h.remove()
    assert not (torch.cat(routed) == E - 1).any()  # expert 3 is never picked

    RecordingContext.stats = {}
    monkeypatch.setattr(pipeline, "LayerContext", RecordingContext)
    report = quantkit.quantize(model, quantkit.Recipe("nvfp4", ("gptq",)), ids, device="cpu", batch_size=2)
    assert {r.name for r in report.quantized} >= ALL_EXPERT_LINEARS
    stats = RecordingContext.stats
    assert {n for n in stats if ".experts." in n} == ALL_EXPERT_LINEARS
    assert all(stats[n].tokens == ids.numel() for n in ALL_EXPERT_LINEARS)
    # gate/up of all experts of a block see the same input: one observer, one Hessian per block
    gate_up = [n for e in range(E) for n in expert_names(0, e)[:2]]
    assert len({id(stats[n]) for n in gate_up}) == 1
    assert len({id(stats[n]) for e in range(E) for n in expert_names(0, e)[2:]}) == E

    x = torch.cat(mlp_inputs).reshape(-1, H)  # float64, all tokens entering layer 0's MoE block
    torch.testing.assert_close(stats["model.layers.0.mlp.experts.3.gate_proj"].hessian.double(), x.T @ x / len(x),
                               rtol=1e-4, atol=1e-6)
    ex = reference.model.layers[0].mlp.experts
    gate_up = x @ ex.gate_up_proj[3] + ex.gate_up_proj_bias[3]
    down_in = ex._apply_gate(gate_up)
    torch.testing.assert_close(stats["model.layers.0.mlp.experts.3.down_proj"].channel_amax.double(),
                               down_in.abs().amax(0), rtol=1e-4, atol=1e-6)


def _rtn_reference(fused: dict[str, torch.Tensor], e: int, interleaved_transposed: bool, fmt: str):
    """Independent per-expert RTN quantization from the fused tensors: gate and up of expert ``e``
    share the amax (one NVFP4 global scale), down has its own."""
    f = get_format(fmt)
    gate_up, down = fused["gate_up_proj"].detach().float(), fused["down_proj"].detach().float()
    if interleaved_transposed:
        w = {"gate_proj": gate_up[e, :, 0::2].T, "up_proj": gate_up[e, :, 1::2].T, "down_proj": down[e].T}
    else:
        w = {"gate_proj": gate_up[e, :I], "up_proj": gate_up[e, I:], "down_proj": down[e]}
    shared = torch.maximum(w["gate_proj"].abs().amax(), w["up_proj"].abs().amax())
    out = {}
    for p, wp in w.items():
        amax = shared if p != "down_proj" else wp.abs().amax()
        out[p] = f.quantize_weight(wp.contiguous(), *f.weight.compute_scales(wp.contiguous(), amax))
    return out


@pytest.mark.parametrize("arch", CONFIGS)
def test_quantized_experts_match_an_independent_rtn_reference(arch):
    """Every expert Linear becomes a QuantLinear holding exactly the RTN quantization of its slice
    of the fused tensors (gate/up sharing the global scale); with those weights (nvfp4-w4a16) the
    model's logits equal a float model whose expert weights are the dequantized reference."""
    model = float_model(arch)
    fused = [dict(layer.mlp.experts.named_parameters()) for layer in model.model.layers]
    report = quantkit.quantize(model, quantkit.Recipe("nvfp4-w4a16", ("rtn",)), tokens(4), device="cpu")
    assert {r.name for r in report.quantized} >= ALL_EXPERT_LINEARS
    assert not [r for r in report.skipped if ".experts" in r.name]
    emulated = float_model(arch)
    linearize_experts(emulated)
    for layer in range(LAYERS):
        for e in range(E):
            ref = _rtn_reference(fused[layer], e, arch == "gpt_oss", "nvfp4-w4a16")
            ours = model.model.layers[layer].mlp.experts[e]
            for p in PROJ:
                q = getattr(ours, p)
                assert isinstance(q, QuantLinear)
                assert torch.equal(q.weight, ref[p].data) and torch.equal(q.weight_scale, ref[p].scale)
                assert torch.equal(q.weight_tensor_scale, ref[p].tensor_scale)
                with torch.no_grad():
                    getattr(emulated.model.layers[layer].mlp.experts[e], p).weight.copy_(ref[p].dequantize())
            assert torch.equal(ours.gate_proj.weight_tensor_scale, ours.up_proj.weight_tensor_scale)
    ids = tokens(2, seed=5)
    with torch.no_grad():
        for name, m in emulated.named_modules():  # the non-expert Linears: take the model's quantized weights
            if isinstance(m, torch.nn.Linear) and ".experts." not in name and isinstance(model.get_submodule(name), QuantLinear):
                m.weight.copy_(model.get_submodule(name).qweight.dequantize())
        torch.testing.assert_close(model(ids).logits, emulated(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_nvfp4_logits_are_close_to_the_float_model(arch):
    """W4A4 NVFP4 with calibrated static input scales (gate/up of an expert sharing them): the
    logits' relative error stays within twice that of RTN NVFP4 weights alone (the activations are
    4-bit too), and GPTQ on the experts' all-token Hessians lowers it. (Tiny random models amplify
    errors: measured w4a16 0.28 / 0.24, nvfp4 0.36 / 0.35, nvfp4+gptq 0.32 / 0.28.)"""
    ids = tokens(2, seed=7)
    errors = {}
    with torch.no_grad():
        reference = float_model(arch)(ids).logits
        for recipe in ("nvfp4-w4a16", "nvfp4", "gptq"):
            model = float_model(arch)
            if recipe == "nvfp4-w4a16":
                quantize_model(model, recipe)
            else:
                quantkit.quantize(model, quantkit.Recipe("nvfp4", (recipe,) if recipe == "gptq" else ("rtn",)), tokens(8), device="cpu")
            errors[recipe] = ((model(ids).logits - reference).norm() / reference.norm()).item()
    for layer in model.model.layers:
        for ex in layer.mlp.experts:
            assert ex.gate_proj.input_scale is not None and torch.equal(ex.gate_proj.input_scale, ex.up_proj.input_scale)
    assert 0 < errors["nvfp4-w4a16"] < errors["nvfp4"] < 2 * errors["nvfp4-w4a16"], errors
    assert errors["gptq"] < errors["nvfp4"], errors


@functools.cache
def _quantized(arch: str) -> torch.nn.Module:
    model = float_model(arch)
    quantkit.quantize(model, "nvfp4", tokens(4), device="cpu")
    return model


def _keys(directory) -> set[str]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("export", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("arch", CONFIGS)
def test_checkpoint_uses_vllm_expert_names_and_reloads_bit_exactly(arch, export, tmp_path):
    model = _quantized(arch)
    save(model, tmp_path / "q", export=export)
    keys = _keys(tmp_path / "q")
    block, leaves = HUB_EXPERTS[arch]
    expected = {f"model.layers.{layer}.{block}.experts.{e}.{leaf}.{t}" for layer in range(LAYERS) for e in range(E)
                for leaf in leaves for t in NVFP4_TENSORS[export]}
    if arch == "gpt_oss":
        expected |= {f"model.layers.{layer}.mlp.experts.{e}.{p}.bias" for layer in range(LAYERS) for e in range(E) for p in PROJ}
    assert {k for k in keys if ".experts." in k} == expected
    # Routers stay in high precision and are listed as such (llm-compressor lists "...mlp.gate").
    router = {"qwen3_moe": "mlp.gate", "mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}[arch]
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {n for n in ignore if n != "lm_head"} == {f"model.layers.{layer}.{router}" for layer in range(LAYERS)}
    assert {f"model.layers.{layer}.{router}.weight" for layer in range(LAYERS)} <= keys
    # The other tensors keep the names save_pretrained gives the float model (the hub checkpoint's);
    # a quantized layer's tensors stand for its float ".weight".
    float_model(arch).save_pretrained(tmp_path / "float")
    quantized_layers = {k.rsplit(".", 1)[0] for k in keys if k.endswith(".weight_scale")}
    as_float = {f"{k.rsplit('.', 1)[0]}.weight" if k.rsplit(".", 1)[0] in quantized_layers and not k.endswith(".bias")
                else k for k in keys if ".experts." not in k}
    assert as_float == {k for k in _keys(tmp_path / "float") if ".experts." not in k}

    loaded = load(tmp_path / "q", dtype=torch.float32)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    ids = tokens(2, seed=9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("export", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("fmt", ["fp8-dynamic", "fp8-block"])
def test_save_warns_about_per_channel_or_block_fp8_experts_only_in_modelopt(fmt, export, tmp_path):
    # vLLM's ModelOpt FP8 MoE method takes per-tensor expert scales only (tests/test_vllm_serving.py).
    # fp8-block needs multiples of 128: the qwen3_moe test model, 4× wider
    wide = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
                                       moe_intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=64, num_experts=E, num_experts_per_tok=2)
    model = float_model("qwen3_moe") if fmt == "fp8-dynamic" else AutoModelForCausalLM.from_config(wide).eval()
    quantize_model(model, fmt)
    assert any(".experts." in name for name, m in model.named_modules() if isinstance(m, QuantLinear))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(model, tmp_path / "q", export=export)
    messages = [str(w.message) for w in caught if "vLLM will not load" in str(w.message)]
    assert len([m for m in messages if "MoE experts" in m]) == (export == "modelopt")
    ours, theirs = model.state_dict(), load(tmp_path / "q", dtype=torch.float32).state_dict()  # quantkit reads it
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_compressed_tensors_decompressor_decodes_the_experts(tmp_path):
    """compressed-tensors' own dequantizer reads each expert weight of our Mixtral checkpoint (hub
    names) to our dequantized weight (bf16-rounded, see test_export)."""
    model = _quantized("mixtral")
    save(model, tmp_path / "q")
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    decoded = CompressedTensorsDequantizer(tmp_path / "q", ignore=["model.embed_tokens"], dtype=torch.float32)
    weights = decoded.process(tensors)
    for layer in range(LAYERS):
        for e in range(E):
            for leaf, p in zip(("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
                ours = getattr(model.model.layers[layer].mlp.experts[e], p).qweight.dequantize().to(torch.bfloat16).float()
                assert torch.equal(weights[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{leaf}.weight"], ours)


def test_cli_quantizes_a_tiny_moe_end_to_end(tmp_path, monkeypatch):
    """`quantkit quantize` on a bf16 Mixtral directory: every expert quantized (none in the skipped
    rows), a checkpoint with hub expert names that loads back with QuantLinear experts."""
    from typer.testing import CliRunner

    from quantkit.cli import app
    from test_eval_fixtures import tiny_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = tiny_tokenizer()
    config = CONFIGS["mixtral"]()
    config.vocab_size = len(tok)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "bf16"), "--out", str(tmp_path / "q"), "--format", "nvfp4",
                                   "--samples", "4", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    # experts + q/k/v/o quantized; lm_head and the routers skipped
    assert f"{len(ALL_EXPERT_LINEARS) + 4 * LAYERS} layers quantized, {1 + LAYERS} skipped" in res.output
    assert {k for k in _keys(tmp_path / "q") if k.endswith(".weight_packed") and ".experts." in k} == {
        f"model.layers.{layer}.block_sparse_moe.experts.{e}.{leaf}.weight_packed"
        for layer in range(LAYERS) for e in range(E) for leaf in ("w1", "w2", "w3")}
    model = quantkit.load(tmp_path / "q")
    assert all(isinstance(getattr(ex, p), QuantLinear) for layer in model.model.layers for ex in layer.mlp.experts for p in PROJ)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, len(tok), (1, 8))).logits.float()).all()


def test_experts_left_in_high_precision_round_trip_under_hub_names(tmp_path):
    """Experts excluded by an ignore pattern are written in float under the hub names (Mixtral
    ``w1``/``w3``/``w2``), listed as ignored, and read back into the per-expert Linears."""
    model = float_model("mixtral")
    report = quantize_model(model, "nvfp4-w4a16", ignore=("lm_head", "*.experts.1.*"))
    assert {r.name for r in report.skipped if ".experts." in r.name} == {
        n for layer in range(LAYERS) for n in expert_names(layer, 1)}
    save(model, tmp_path / "q")
    keys = _keys(tmp_path / "q")
    hub = {f"model.layers.{layer}.block_sparse_moe.experts.1.{leaf}.weight" for layer in range(LAYERS) for leaf in ("w1", "w2", "w3")}
    assert hub <= keys
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {k.removesuffix(".weight") for k in hub} <= set(ignore)
    loaded = load(tmp_path / "q", dtype=torch.float32)
    assert isinstance(loaded.model.layers[0].mlp.experts[1].up_proj, torch.nn.Linear)
    assert torch.equal(loaded.model.layers[0].mlp.experts[1].up_proj.weight, model.model.layers[0].mlp.experts[1].up_proj.weight)
    ids = tokens(2, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_transformers_loads_the_checkpoint_by_its_hub_names(arch, tmp_path):
    """transformers' own compressed-tensors loader (its hub-name conversion, dequantizing) finds
    every tensor of our checkpoint: none missing, only the input scales unused; attention weights equal our
    dequantized ones; each expert weight equals ours up to one factor per tensor. (transformers
    5.24 drops NVFP4 experts' weight_global_scale: the factor is 1/s_g, huggingface/transformers#48371.)"""
    from transformers import CompressedTensorsConfig

    model = _quantized(arch)
    save(model, tmp_path / "q")
    theirs, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "q", dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True),
        output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # dequantizing, it has no use for the activation scales
    assert info["unexpected_keys"] and all(k.endswith(".input_global_scale") for k in info["unexpected_keys"])
    for layer in range(LAYERS):
        ours = model.model.layers[layer]
        for p in "qkvo":
            want = getattr(ours.self_attn, f"{p}_proj").qweight.dequantize()
            torch.testing.assert_close(getattr(theirs.model.layers[layer].self_attn, f"{p}_proj").weight.float(), want,
                                       rtol=2 ** -8, atol=0)  # bf16-rounded
        fused = theirs.model.layers[layer].mlp.experts
        for e in range(E):
            got = {"gate_proj": fused.gate_up_proj[e, :I], "up_proj": fused.gate_up_proj[e, I:], "down_proj": fused.down_proj[e]}
            for p in PROJ:
                layer_q = getattr(ours.mlp.experts[e], p)
                mine = layer_q.qweight.dequantize()
                factor = got[p].float().abs().amax() / mine.abs().amax()
                assert any(torch.isclose(factor, f, rtol=2 ** -7) for f in (torch.tensor(1.0), 1 / layer_q.weight_tensor_scale))
                torch.testing.assert_close(got[p].detach().float(), mine * factor, rtol=2 ** -7, atol=0)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _quantize_digest(out) -> None:
    """Quantize tiny Qwen3-MoE (nvfp4 + GPTQ, batches of 2) and write its digest to ``out/rank{r}``."""
    from quantkit.calibrate.distributed import world

    model = float_model("qwen3_moe")
    quantkit.quantize(model, quantkit.Recipe("nvfp4", ("gptq",)), tokens(8), device="cpu", batch_size=2)
    (out / f"rank{world()[0]}").write_text(_digest(model))


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from quantkit.calibrate.distributed import init_from_env

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    assert init_from_env()
    try:
        _quantize_digest(out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_calibrate_the_experts_as_one_process(tmp_path):
    """torchrun-style data parallelism: 2 gloo ranks, each on half the batches, end with the MoE
    model one process quantizes on all of them, bit for bit (expert statistics reduced over ranks)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "parallel").mkdir()
    (tmp_path / "single").mkdir()
    mp.spawn(_rank, args=(port, tmp_path / "parallel"), nprocs=2, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: same GEMM reduction order
    try:
        _quantize_digest(tmp_path / "single")
    finally:
        torch.set_num_threads(threads)
    digests = {(tmp_path / "parallel" / f"rank{r}").read_text() for r in range(2)}
    assert digests == {(tmp_path / "single" / "rank0").read_text()}


def test_experts_left_fused_keep_their_names_and_round_trip(tmp_path, monkeypatch):
    """Experts of a layout quantkit cannot split stay fused: the checkpoint keeps the model's fused
    names (the hub's per-expert names would need the split) and reloads them exactly."""
    from quantkit.nn import experts

    monkeypatch.setattr(experts, "unsupported_reason", lambda module: "kept fused for this test")
    model = float_model("qwen3_moe")
    report = quantize_model(model, "nvfp4-w4a16")
    assert {r.name for r in report.skipped if "experts" in r.name} == {
        f"model.layers.{layer}.mlp.experts.{p}" for layer in range(LAYERS) for p in ("gate_up_proj", "down_proj")}
    save(model, tmp_path / "q")
    assert {k for k in _keys(tmp_path / "q") if "experts" in k} == {
        f"model.layers.{layer}.mlp.experts.{p}" for layer in range(LAYERS) for p in ("gate_up_proj", "down_proj")}
    loaded = load(tmp_path / "q", dtype=torch.float32)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    loaded.config._experts_implementation = "eager"  # as the original (not saved in config.json)
    ids = tokens(2, seed=4)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
