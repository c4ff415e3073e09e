"""Mixed precision: a format per Linear layer (``Recipe.layer_formats``, ``quantize_model(layer_formats=)``),
calibrated per layer and saved as the mixed checkpoints llm-compressor (several config groups) and
ModelOpt (``MIXED_PRECISION``) write. vLLM serving them: ``test_vllm_serving.py``."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
    CompressedTensorsDequantizer,
)
from compressed_tensors.quantization import QuantizationConfig
from test_export import tensors_of
from transformers import AutoModelForCausalLM, LlamaConfig

import quantkit
from quantkit.calibrate import Recipe
from quantkit.export import CheckpointError, describe, load, save
from quantkit.nn import QuantLinear, quantize_model
from quantkit.nn.swap import assign_formats

IDS = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
RTN = Recipe("nvfp4", ("rtn",))
ATTENTION_FP8 = {"*self_attn*": "fp8-block"}


def tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """2-layer Llama, every N and K a multiple of 128 (fp8-block's block)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def quant_layers(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_first_matching_pattern_gives_the_format_and_fused_siblings_must_share_it():
    names = ["m.0.self_attn.q_proj", "m.0.self_attn.k_proj", "m.0.self_attn.v_proj", "m.0.self_attn.o_proj",
             "m.0.mlp.gate_proj", "m.0.mlp.up_proj", "m.0.mlp.down_proj"]
    got = assign_formats(names, "nvfp4", {"*o_proj": "mxfp8", "*self_attn*": "fp8-block", "re:.*down.*": "fp8"})
    assert got == {"m.0.self_attn.q_proj": "fp8-block", "m.0.self_attn.k_proj": "fp8-block",
                   "m.0.self_attn.v_proj": "fp8-block", "m.0.self_attn.o_proj": "mxfp8", "m.0.mlp.gate_proj": "nvfp4",
                   "m.0.mlp.up_proj": "nvfp4", "m.0.mlp.down_proj": "fp8"}
    with pytest.raises(ValueError, match=r"m.0.mlp.gate_proj -> fp8, m.0.mlp.up_proj -> nvfp4: engines run these as one GEMM"):
        assign_formats(names, "nvfp4", {"*gate_proj": "fp8"})
    experts = [f"m.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    assert set(assign_formats(experts, "nvfp4", {"*experts*": "fp8"}).values()) == {"fp8"}
    with pytest.raises(ValueError, match=r"m.1.mlp.experts.0.gate_proj \(and 8 more\) -> nvfp4, m.1.mlp.experts.3.gate_proj "
                                         r"\(and 2 more\) -> fp8: engines run these as one GEMM or one MoE layer"):
        assign_formats(experts, "nvfp4", {"*experts.3.*": "fp8"})  # vLLM builds one MoE layer of all experts
    with pytest.raises(ValueError, match="unknown format"):
        assign_formats(names, "nvfp4", {"*mlp*": "int3"})
    with pytest.raises(ValueError, match="layer_formats pattern 're:\\(' is not a valid regular expression"):
        assign_formats(names, "nvfp4", {"re:(": "fp8"})


def test_recipe_parses_and_checks_layer_formats():
    recipe = Recipe.parse("nvfp4-w4a16", layer_formats=["*self_attn*=fp8-block", "re:.*\\.1\\..*=fp8"])
    assert recipe.layer_formats == {"*self_attn*": "fp8-block", "re:.*\\.1\\..*": "fp8"}
    assert recipe.needs_data  # fp8's static activation scale needs calibration data; nvfp4-w4a16 alone does not
    assert not Recipe.parse("nvfp4-w4a16", "rtn", layer_formats=["*mlp*=fp8-dynamic"]).needs_data
    with pytest.raises(ValueError, match="'self_attn' is not PATTERN=FORMAT"):
        Recipe.parse("nvfp4", layer_formats=["self_attn"])
    with pytest.raises(ValueError, match="unknown format"):
        Recipe("nvfp4", layer_formats={"*": "nvfp3"})


def test_round_to_nearest_layers_equal_those_of_the_single_format_models():
    """Round to nearest quantizes each layer on its own (fused siblings sharing a tensor scale):
    every layer of the mixed model holds the bytes the same layer has in the model quantized
    wholly to its format."""
    mixed, plain = tiny_llama(), {f: tiny_llama() for f in ("nvfp4-w4a16", "fp8-block")}
    report = quantize_model(mixed, "nvfp4-w4a16", layer_formats=ATTENTION_FP8)
    for fmt, model in plain.items():
        quantize_model(model, fmt)
    assert report.formats == {"fp8-block": 8, "nvfp4-w4a16": 6}
    assert {r.name: r.format for r in report.quantized} == {n: m.format for n, m in quant_layers(mixed).items()}
    for name, layer in quant_layers(mixed).items():
        assert layer.format == ("fp8-block" if "self_attn" in name else "nvfp4-w4a16"), name
        twin = quant_layers(plain[layer.format])[name]
        for buffer in ("weight", "weight_scale", "weight_tensor_scale"):
            assert same_bytes(getattr(layer, buffer), getattr(twin, buffer)), (name, buffer)


@pytest.fixture(scope="module")
def calibrated() -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny bf16 Llama calibrated by AWQ + MSE to NVFP4 W4A4 with its attention in fp8-block, and its logits."""
    model = tiny_llama(torch.bfloat16)
    quantkit.quantize(model, Recipe("nvfp4", ("awq", "mse"), layer_formats=ATTENTION_FP8), IDS)
    with torch.no_grad():
        return model, model(IDS[:2]).logits


def test_calibration_runs_each_layer_in_its_format(calibrated):
    """Static NVFP4 input scales only on the NVFP4 layers; and the mixed model, whose attention is
    FP8, is closer to the float model than the same recipe in NVFP4 everywhere."""
    model, _ = calibrated
    layers = quant_layers(model)
    assert {m.format for n, m in layers.items() if "self_attn" in n} == {"fp8-block"}
    assert {m.format for n, m in layers.items() if "mlp" in n} == {"nvfp4"}
    assert all((m.input_scale is not None) == (m.format == "nvfp4") for m in layers.values())
    errors = {}
    for name, layer_formats in (("mixed", ATTENTION_FP8), ("nvfp4", {})):
        reference, quantized = tiny_llama(), tiny_llama()
        quantkit.quantize(quantized, Recipe("nvfp4", ("awq", "mse"), layer_formats=layer_formats), IDS)
        with torch.no_grad():
            want, got = reference(IDS).logits, quantized(IDS).logits
        errors[name] = ((got - want).norm() / want.norm()).item()
    assert errors["mixed"] < 0.8 * errors["nvfp4"], errors


@pytest.mark.parametrize("export", ["compressed-tensors", "modelopt"])
def test_mixed_checkpoint_round_trips(calibrated, export, tmp_path):
    model, logits = calibrated
    save(model, tmp_path / "q", export=export)
    loaded = load(tmp_path / "q", dtype=torch.bfloat16)
    assert {n: m.format for n, m in quant_layers(loaded).items()} == {n: m.format for n, m in quant_layers(model).items()}
    theirs = loaded.state_dict()
    for key, value in model.state_dict().items():
        assert same_bytes(value, theirs[key]), key
    with torch.no_grad():
        assert torch.equal(loaded(IDS[:2]).logits, logits)
    assert describe(tmp_path / "q")["format"] == "fp8-block + nvfp4"


def test_compressed_tensors_config_has_a_group_per_format(calibrated, tmp_path):
    model, _ = calibrated
    save(model, tmp_path / "q")
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    groups = qcfg["config_groups"]
    assert qcfg["format"] == "mixed-precision"
    assert groups["group_0"]["targets"] == ["Linear"] and groups["group_0"]["format"] == "float-quantized"
    assert groups["group_1"]["format"] == "nvfp4-pack-quantized"
    assert groups["group_1"]["targets"] == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2)
                                                  for p in ("down_proj", "gate_proj", "up_proj"))
    validated = QuantizationConfig.model_validate(qcfg).model_dump(mode="json")
    assert validated["config_groups"].keys() == groups.keys()
    for name, group in groups.items():
        assert {k: validated["config_groups"][name][k] for k in group} == group


def test_compressed_tensors_decodes_a_mixed_checkpoint(tmp_path):
    """compressed-tensors' own dequantizer reads each layer in its group's format: exactly for
    fp8-block, and for NVFP4 within its bf16 rounding (see test_export)."""
    model = tiny_llama()
    quantize_model(model, "nvfp4-w4a16", layer_formats=ATTENTION_FP8)
    save(model.to(torch.bfloat16), tmp_path / "q")
    weights = CompressedTensorsDequantizer(tmp_path / "q", ignore=["model.embed_tokens"], dtype=torch.float32).process(
        tensors_of(tmp_path / "q"))
    for name, layer in quant_layers(model).items():
        ours = layer.qweight.dequantize()
        if layer.format == "nvfp4-w4a16":
            ours = ours.to(torch.bfloat16).float()
        assert torch.equal(weights[f"{name}.weight"], ours), name


def test_regex_targets_as_llm_compressor_writes_them_select_by_name_before_class(calibrated, tmp_path):
    """A group that targets layers by ``re:`` pattern wins over one that targets ``Linear``, in
    either order of the groups, as in vLLM."""
    model, logits = calibrated
    save(model, tmp_path / "q")
    path = tmp_path / "q" / "config.json"
    cfg = json.loads(path.read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_1"]["targets"] = ["re:.*mlp.*"]
    cfg["quantization_config"]["config_groups"] = {"a": groups["group_1"], "b": groups["group_0"]}
    path.write_text(json.dumps(cfg))
    loaded = load(tmp_path / "q", dtype=torch.bfloat16)
    assert {n: m.format for n, m in quant_layers(loaded).items()} == {n: m.format for n, m in quant_layers(model).items()}
    with torch.no_grad():
        assert torch.equal(loaded(IDS[:2]).logits, logits)


def test_modelopt_mixed_precision_config(calibrated, tmp_path):
    model, _ = calibrated
    save(model, tmp_path / "q", export="modelopt")
    sidecar = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())["quantization"]
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert sidecar["quant_algo"] == qcfg["quant_algo"] == "MIXED_PRECISION"
    assert sidecar["quantized_layers"] == qcfg["quantized_layers"]
    assert qcfg["quantized_layers"]["model.layers.1.mlp.up_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert qcfg["quantized_layers"]["model.layers.1.self_attn.k_proj"] == {"quant_algo": "fp8_pb_wo"}
    assert len(qcfg["quantized_layers"]) == 14 and "config_groups" not in qcfg


def test_errors_name_the_problem(calibrated, tmp_path):
    model, _ = calibrated
    broken = copy.deepcopy(model)
    broken.model.layers[0].self_attn.q_proj = broken.model.layers[0].mlp.up_proj  # NVFP4 beside fp8-block k/v
    with pytest.raises(ValueError, match=r"q_proj -> nvfp4, .*k_proj \(and 1 more\) -> fp8-block.*must share a format"):
        save(broken, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    mx = tiny_llama()
    quantize_model(mx, "fp8-dynamic", layer_formats={"*mlp*": "mxfp4"})
    with pytest.raises(ValueError, match="ModelOpt has no mxfp4 format"):
        save(mx, tmp_path / "x", export="modelopt")
    save(model, tmp_path / "m", export="modelopt")
    path = tmp_path / "m" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"]["quantized_layers"]["model.layers.0.mlp.up_proj"]["quant_algo"] = "INT4_AWQ"
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_algo 'INT4_AWQ' of layer 'model.layers.0.mlp.up_proj' matches no"):
        load(tmp_path / "m")


def test_automatic_search_spends_the_budget_where_the_loss_recovers_most():
    """search_layer_formats keeps within the bits-per-weight budget, leaves the model as it was,
    and its choice calibrates to a lower loss than the same bytes spent on the lowest-scored units."""
    from quantkit.calibrate.auto_formats import (
        calibration_loss,
        effective_bits,
        search_layer_formats,
    )

    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chosen, units = search_layer_formats(model, IDS, RTN, "fp8-block", 5.5, device="cpu")
    assert {type(m).__name__ for m in model.modules()} == {type(m).__name__ for m in tiny_llama().modules()}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(units) == 2 * 4  # q/k/v, o, gate/up, down per layer
    assert 0 < len(chosen) and effective_bits(model, "nvfp4", chosen) <= 5.5
    assert [u.score / u.extra_bytes for u in units] == sorted((u.score / u.extra_bytes for u in units), reverse=True)
    spent = sum(u.extra_bytes for u in units if chosen.keys() & set(u.names))
    worst, cost = {}, 0
    for unit in reversed(units):
        if cost >= spent:
            break
        worst.update(dict.fromkeys(unit.names, "fp8-block"))
        cost += unit.extra_bytes
    losses = {}
    for label, layer_formats in (("chosen", chosen), ("worst", worst)):
        m = tiny_llama()
        quantkit.quantize(m, Recipe("nvfp4", ("rtn",), layer_formats=layer_formats), IDS)
        losses[label] = calibration_loss(m, IDS, 8)
    assert losses["chosen"] < losses["worst"], losses
    with pytest.raises(ValueError, match="nvfp4 alone takes 4.50 bits per weight, more than effective_bits=4"):
        search_layer_formats(model, IDS, RTN, "fp8-block", 4, device="cpu")
    with pytest.raises(ValueError, match="chooses the layer formats itself"):
        search_layer_formats(model, IDS, Recipe("nvfp4", ("rtn",), layer_formats={"*mlp*": "fp8-block"}), "fp8-block", 5.5)


def test_automatic_search_scores_units_on_the_calibrated_model():
    """With a calibrating recipe, each unit's score is the loss of the model calibrated by that
    recipe minus its loss with the unit alone in the fallback format (recomputed here); AWQ's
    smoothing, folded in place, goes into a copy: the caller's model is left as it was."""
    from quantkit.calibrate.auto_formats import calibration_loss, search_layer_formats

    model = tiny_llama()
    _, units = search_layer_formats(model, IDS, Recipe("nvfp4", ("mse",)), "fp8-block", 5.5, device="cpu")
    calibrated = tiny_llama()
    quantkit.quantize(calibrated, Recipe("nvfp4", ("mse",)), IDS)
    base = calibration_loss(calibrated, IDS, 8)
    for unit in units:
        swapped = copy.deepcopy(calibrated)
        for name in unit.names:
            swapped.set_submodule(name, QuantLinear.from_linear(model.get_submodule(name), "fp8-block"))
        assert unit.score == pytest.approx(base - calibration_loss(swapped, IDS, 8), abs=1e-9)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    chosen, _ = search_layer_formats(model, IDS, "nvfp4", "fp8-block", 5.5, device="cpu")  # awq+mse
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert set(chosen.values()) <= {"fp8-block"}
