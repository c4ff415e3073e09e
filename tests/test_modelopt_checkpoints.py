"""quantkit.load reads checkpoints that NVIDIA ModelOpt itself wrote.

``modelopt_writer.py`` (a subprocess) calibrates tiny Llama and Qwen3-MoE models with ModelOpt's
``mtq.quantize`` and writes them with its ``export_hf_checkpoint``: ``FP8``,
``FP8_PER_CHANNEL_PER_TOKEN``, ``fp8_pb_wo``, ``MXFP8``, ``NVFP4`` (dense and MoE experts) and
``W4A16_NVFP4``, in ModelOpt's own names, shapes and config (its ``exclude_modules`` wildcards, the
router it adds, the 4-D block scales). Each must load as its quantkit format, with every weight
equal to ModelOpt's dequantization formula applied to the files and the static activation scales
taken as written, and the loaded model must stay close to the bf16 model it was quantized from.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from quantkit.export import describe, load
from quantkit.nn import QuantLinear
from quantkit.nn.kv_cache import kv_scales, observe, scales_from_amax

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from modelopt_writer import CALIB_IDS, CONFIGS, TEST_IDS, tiny_model
from test_export import modelopt_dequantized, tensors_of


def expected(case: str) -> tuple[str, float]:
    """The quantkit format ModelOpt case ``case`` loads as, and the largest relative logit error
    against the bf16 model (measured: 0.06 for the FP8 formats, 0.16-0.22 for NVFP4; static input
    scales read 4x too small, which clips the activations, give 0.42-0.48)."""
    fmt = case.removesuffix("-moe").removesuffix("-kv")
    return fmt, 0.3 if fmt.startswith("nvfp4") else 0.1


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """ModelOpt's checkpoints (nvidia-modelopt is a test dependency: a missing one fails here)."""
    out = tmp_path_factory.mktemp("modelopt")
    done = subprocess.run([sys.executable, str(HERE / "modelopt_writer.py"), str(out)], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("case", list(CONFIGS))
def test_quantkit_loads_what_modelopt_wrote(case, written):
    fmt, tolerance = expected(case)
    directory = written / case
    sidecar = json.loads((directory / "hf_quant_config.json").read_text())
    assert sidecar["producer"]["name"] == "modelopt"
    assert describe(directory)["format"] == fmt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(directory, dtype=torch.bfloat16)
    # ModelOpt scales q/k/v and gate/up separately; vLLM re-rounds them to one scale per stack
    assert any("re-rounds" in str(w.message) for w in caught) == (fmt == "fp8")
    files = tensors_of(directory)

    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    written_layers = {k.removesuffix(".weight_scale") for k in files if k.endswith(".weight_scale")}
    assert set(quantized) == written_layers
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, QuantLinear)
    if case.endswith("moe"):
        assert sum(".experts." in n for n in quantized) == 4 * 3
        assert not isinstance(model.model.layers[0].mlp.gate, QuantLinear)
    for name, layer in quantized.items():
        assert layer.format == fmt, name
        assert torch.equal(layer.qweight.dequantize(), modelopt_dequantized(files, name, fmt).float()), name
        if f"{name}.input_scale" in files:
            assert layer.input_scale.item() == files[f"{name}.input_scale"].item(), name

    reference = load_file(written / f"{case}.reference.safetensors")["logits"].float()
    with torch.no_grad():
        logits = model(TEST_IDS).logits.float()
    assert (logits - reference).norm() <= tolerance * reference.norm()


def test_quantkit_reads_modelopt_fp8_kv_cache_scales_and_computes_them_the_same_way(written):
    """ModelOpt's FP8 KV cache (``FP8_KV_CFG``): quantkit takes its ``k_proj.k_scale`` /
    ``v_proj.v_scale`` as written, and quantkit's observer (``max |k| / 448`` of the keys and values
    the attention receives) on the bf16 model ModelOpt calibrated, with ModelOpt's calibration
    batch, gives ModelOpt's scales."""
    directory = written / "fp8-kv"
    assert describe(directory)["kv_cache"] == "fp8"
    files = tensors_of(directory)
    k_scale, v_scale = kv_scales(load(directory, dtype=torch.bfloat16))["model.layers.0.self_attn"]
    assert k_scale.item() == files["model.layers.0.self_attn.k_proj.k_scale"].item()
    assert v_scale.item() == files["model.layers.0.self_attn.v_proj.v_scale"].item()
    torch.manual_seed(0)  # the model the writer quantized
    reference = tiny_model(CONFIGS["fp8-kv"][1])
    with observe(reference, {"attention": reference.model.layers[0].self_attn}) as amax, torch.no_grad():
        reference(CALIB_IDS)
    ours = scales_from_amax(amax["attention"])
    assert (ours[0].item(), ours[1].item()) == pytest.approx((k_scale.item(), v_scale.item()), rel=1e-6)
