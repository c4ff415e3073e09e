"""Multimodal models: only the language model is quantized. The default ignore patterns leave the
vision tower in high precision (the calibration pipeline runs only the decoder layers, and
llm-compressor's and ModelOpt's multimodal recipes do the same); the checkpoint round-trips, image
inputs included, and vLLM loads it under the hub checkpoint's names and serves its layers."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MllamaConfig,
    MllamaForConditionalGeneration,
    MllamaTextConfig,
    MllamaVisionConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    SiglipVisionConfig,
)
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLVisionConfig,
)
from typer.testing import CliRunner

import quantkit
from quantkit.calibrate import CalibrationError
from quantkit.cli import app
from quantkit.nn import QuantLinear, calibrate_kv_cache
from quantkit.nn.kv_cache import kv_scales

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import vllm_env
from test_eval_fixtures import tiny_tokenizer

BOI, EOI, IMAGE = 509, 510, 511
TEXT = torch.randint(0, 500, (4, 24), generator=torch.Generator().manual_seed(1))
PROMPT = torch.tensor([[2, 7, BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI, 40, 41, 42]])
PIXELS = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)


def tiny_gemma3_vlm(vision_layers: int = 1) -> Gemma3ForConditionalGeneration:
    """Gemma 3 (2 decoder layers) with a SigLIP vision tower (K = 32 and 64: quantizable by size), bf16."""
    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                            sliding_window=16)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                                num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                          boi_token_index=BOI, eoi_token_index=EOI)
    return Gemma3ForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()


def tiny_qwen25_vl() -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL: vision blocks and patch merger under ``model.visual``."""
    text = Qwen2_5_VLTextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    vision = Qwen2_5_VLVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                                    fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=EOI,
                              vision_start_token_id=BOI, bos_token_id=1, eos_token_id=2)
    return Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()


def tiny_llava() -> LlavaForConditionalGeneration:
    """LLaVA: a CLIP tower and a two-Linear ``multi_modal_projector``."""
    text = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE)
    return LlavaForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()


def tiny_mllama(cross_attention_layers=(1,)) -> MllamaForConditionalGeneration:
    """Mllama (Llama 3.2 Vision), 3 decoder layers: cross-attention layers (default: layer 1),
    which the model skips on text-only input."""
    text = MllamaTextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=list(cross_attention_layers),
                            max_position_embeddings=128, pad_token_id=0)
    vision = MllamaVisionConfig(hidden_size=32, intermediate_layers_indices=[0], num_hidden_layers=2, num_global_layers=1,
                                attention_heads=2, image_size=32, patch_size=8, vision_output_dim=64,
                                intermediate_size=64)
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE)
    return MllamaForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()


def linears(model, kind=torch.nn.Linear) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, kind)}


@pytest.mark.parametrize("vision_layers", [1, 3])  # 3: the tower holds more blocks than the decoder (as 7B VLMs do)
def test_only_the_language_model_is_quantized(vision_layers):
    model = tiny_gemma3_vlm(vision_layers)
    vision = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("model.vision_tower.")}
    text_linears = {n for n in linears(model) if n.startswith("model.language_model.")}
    vision_linears = {n for n in linears(model) if n.startswith("model.vision_tower.")}
    assert len(text_linears) == 14 and len(vision_linears) == 6 * vision_layers + 3
    report = quantkit.quantize(model, "nvfp4", TEXT, batch_size=2)
    assert linears(model, QuantLinear) == text_linears
    assert {r.name: r.reason for r in report.layers if r.name in vision_linears} == \
           dict.fromkeys(vision_linears, "ignored by pattern")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in vision.items())


@pytest.mark.parametrize("build", [tiny_qwen25_vl, tiny_llava])
def test_other_multimodal_layouts_keep_their_towers(build):
    torch.manual_seed(0)
    model = build()
    text_linears = {n for n in linears(model) if n.startswith("model.language_model.")}
    others = linears(model) - text_linears - {"lm_head"}
    assert len(text_linears) == 14 and len(others) >= 2
    quantkit.quantize(model, "nvfp4", TEXT, batch_size=2)
    assert linears(model, QuantLinear) == text_linears and linears(model) - linears(model, QuantLinear) >= others


def test_layers_the_model_skips_on_text_stay_unquantized(tmp_path):
    torch.manual_seed(0)
    model = tiny_mllama()
    cross = {n for n in linears(model) if n.startswith("model.language_model.layers.1.")}
    text_linears = {n for n in linears(model) if n.startswith("model.language_model.")}
    assert len(cross) == 7 and len(text_linears) == 21
    report = quantkit.quantize(model, "nvfp4", TEXT, batch_size=2)
    assert linears(model, QuantLinear) == text_linears - cross
    assert {r.name: r.reason for r in report.layers if r.name in cross} == \
           dict.fromkeys(cross, "its decoder layer does not run on the calibration data")
    quantkit.save(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(quantkit.load(tmp_path)(input_ids=TEXT[:1]).logits, model(input_ids=TEXT[:1]).logits)


def test_a_model_that_calls_no_decoder_layer_is_a_clear_error():
    with pytest.raises(CalibrationError, match="called none of its decoder layers"):
        quantkit.quantize(tiny_mllama(cross_attention_layers=(0, 1, 2)), "nvfp4", TEXT, batch_size=2)


def test_fp8_kv_cache_covers_the_language_model(tmp_path):
    # the vision tower's attention has no KV cache (and never runs on text)
    model = tiny_gemma3_vlm()
    quantkit.quantize(model, quantkit.Recipe("nvfp4", kv_cache="fp8"), TEXT, batch_size=2)
    assert set(kv_scales(model)) == {f"model.language_model.layers.{i}.self_attn" for i in range(2)}
    quantkit.save(model, tmp_path)
    loaded = quantkit.load(tmp_path)
    assert set(kv_scales(loaded)) == set(kv_scales(model))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=TEXT[:1]).logits, model(input_ids=TEXT[:1]).logits)
    added = tiny_gemma3_vlm()
    calibrate_kv_cache(added, TEXT, batch_size=2)
    assert set(kv_scales(added)) == set(kv_scales(model))


@pytest.mark.parametrize("export", ["compressed-tensors", "modelopt"])
def test_checkpoint_round_trips_with_images(export, tmp_path):
    model = tiny_gemma3_vlm()
    quantkit.quantize(model, "nvfp4", TEXT, batch_size=2)
    quantkit.save(model, tmp_path, export=export)
    config = json.loads((tmp_path / "config.json").read_text())
    # the names of Gemma 3's hub checkpoints (google/gemma-3-4b-it), which vLLM loads
    assert "vision_tower.vision_model.encoder.layers.0.mlp.fc1" in config["quantization_config"]["ignore"]
    names = safe_open(tmp_path / "model.safetensors", "pt").keys()
    assert {"vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "language_model.model.layers.0.mlp.down_proj.weight_scale"} <= set(names)
    loaded = quantkit.load(tmp_path)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(theirs[k], v) for k, v in ours.items())
    assert linears(loaded, QuantLinear) == linears(model, QuantLinear)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=PROMPT, pixel_values=PIXELS).logits,
                           model(input_ids=PROMPT, pixel_values=PIXELS).logits)
        assert torch.equal(loaded(input_ids=TEXT[:1]).logits, model(input_ids=TEXT[:1]).logits)


# (model, vLLM's vision modules as vLLM names them, one of them to compare with quantkit's module)
VLLM_CASES = {
    "gemma3": (tiny_gemma3_vlm, [f"vision_tower.vision_model.encoder.layers.0.{m}" for m in
                                 ("self_attn.qkv_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")],
               ("vision_tower.vision_model.encoder.layers.0.mlp.fc1", "model.vision_tower.encoder.layers.0.mlp.fc1")),
    "qwen2.5-vl": (tiny_qwen25_vl, [f"visual.{m}" for m in ("blocks.0.attn.qkv", "blocks.0.attn.proj",
                                                            "blocks.0.mlp.gate_up_proj", "blocks.0.mlp.down_proj",
                                                            "merger.mlp.0", "merger.mlp.2")],
                   ("visual.merger.mlp.0", "model.visual.merger.mlp.0")),
}


@pytest.mark.parametrize("case", VLLM_CASES)
def test_vllm_loads_the_checkpoint_and_serves_its_quantized_layers(case, tmp_path):
    # (LLaVA is left out: vLLM's LLaVA module imports mistral_common, which the tests do not install)
    try:  # a test dependency, fetched from PyPI on first use: without it the test fails
        vllm_src = vllm_env.ensure()
    except RuntimeError as e:
        pytest.fail(f"vLLM sources unavailable: {e}")
    build, vision, (dumped, ours_name) = VLLM_CASES[case]
    model = build()
    quantkit.quantize(model, "nvfp4", TEXT, batch_size=2)
    quantkit.save(model, tmp_path / "ckpt")
    down = "language_model.model.layers.0.mlp.down_proj"
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    save_file({down: x}, tmp_path / "inputs")
    job = {"checkpoint": str(tmp_path / "ckpt"), "inputs": str(tmp_path / "inputs"), "outputs": str(tmp_path / "out"),
           "dump": [dumped]}
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    path = os.pathsep.join([str(vllm_src), str(HERE / "vllm_stub"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(HERE / "vllm_driver.py"), str(tmp_path / "jobs.json")],
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True, timeout=900, check=False)
    results = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, done.stderr[-3000:]
    result = results[0]
    assert "refused" not in result, result["refused"]
    schemes = result["schemes"]
    assert {n: s for n, s in schemes.items() if n.startswith(("vision_tower.", "visual."))} == dict.fromkeys(
        vision, "UnquantizedLinearMethod")
    assert schemes[down] == "CompressedTensorsW4A4Fp4" and not result["errors"]
    assert all(".attn." in p for p in result["unloaded"])  # only the attention's KV-cache scales: none saved
    out = load_file(tmp_path / "out")
    assert torch.equal(out[f"{dumped}:weight"].to(torch.bfloat16), model.get_submodule(ours_name).weight)
    with torch.no_grad():
        ours = model.get_submodule("model.language_model.layers.0.mlp.down_proj")(x)
    torch.testing.assert_close(out[down], ours, rtol=0, atol=float(ours.abs().max()) * 2**-7)  # bf16 rounding of vLLM's matmul


@pytest.mark.parametrize("build", [tiny_llava, tiny_gemma3_vlm])
def test_cli_quantizes_a_multimodal_model_directory(build, tmp_path, monkeypatch):
    # LLaVA is no AutoModelForCausalLM: the CLI loads it as an image-text-to-text model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build()
    model.save_pretrained(tmp_path / "src")
    tiny_tokenizer().save_pretrained(tmp_path / "src")
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "q"), "--format",
                                   "nvfp4-w4a16", "--samples", "4", "--seq-len", "16", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    loaded = quantkit.load(tmp_path / "q")
    assert type(loaded) is type(model)
    assert linears(loaded, QuantLinear) == {n for n in linears(model) if n.startswith("model.language_model.")}
