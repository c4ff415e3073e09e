"""vLLM serves quantkit checkpoints: vLLM's own loader and linear layers on CPU.

For each format and export flavour a calibrated tiny Llama is saved (plus Gemma 3, Qwen3-MoE
experts in shards, a quantized lm_head); ``vllm_driver.py`` (vLLM 0.34's sources, see
``vllm_env.py``) parses the config, picks its scheme per layer, loads every tensor through its
file discovery and weight loaders into its stacked q/k/v, gate/up and expert parameters, and runs
each dense layer on activations captured from the quantkit model. Stacked parameters must hold
the checkpoint's bytes, and each output must match what the checkpoint means as the standard
format it is stored as, computed by ``quantkit.load`` (for the tagged formats, ``nvfp4-4over6``
and ``nvfp4-w4a8``, read without the tag: vLLM serves them as ``nvfp4`` and ``nvfp4-w4a16``).
The checkpoints vLLM refuses are the ones ``quantkit.save`` warns about. Mixed-precision
checkpoints (``Recipe.layer_formats``) are served layer by layer in each layer's format.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen3MoeConfig,
)

import quantkit
from quantkit.export import load, save
from quantkit.nn.swap import DEFAULT_IGNORE, assign_formats
from quantkit.nn.kv_cache import kv_scales

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import vllm_env
from test_export import tensors_of

# vLLM module -> the quantkit projections it stacks, in vLLM's order.
PROJECTIONS = {
    "model.layers.0.self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "model.layers.0.self_attn.o_proj": ("self_attn.o_proj",),
    "model.layers.0.mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "model.layers.0.mlp.down_proj": ("mlp.down_proj",),
}
CT, MODELOPT = "compressed-tensors", "modelopt"
EXPERTS = 4


class Expected(NamedTuple):
    """What vLLM makes of a checkpoint: its config class, the scheme of every linear layer, and
    what its CPU code computes: ``"served"`` the function it serves; ``"weights"`` the weights
    times unquantized activations (vLLM's MXFP8 emulation); ``"none"`` nothing (vLLM selects GPU
    kernels only), so only the loaded parameters are checked."""

    config: str
    scheme: str
    cpu_forward: str = "served"


CASES = {
    ("nvfp4", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW4A4Fp4"),
    ("nvfp4-4over6", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW4A4Fp4"),
    ("nvfp4-w4a16", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW4A4Fp4"),
    ("nvfp4-w4a8", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW4A4Fp4"),
    ("mxfp8", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW8A8Mxfp8", "weights"),
    ("mxfp4", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW4A4Mxfp4", "none"),
    ("fp8-block", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW8A8Fp8", "none"),
    ("fp8-dynamic", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW8A8Fp8"),
    ("fp8", CT): Expected("CompressedTensorsConfig", "CompressedTensorsW8A8Fp8", "none"),
    ("nvfp4", MODELOPT): Expected("ModelOptNvFp4Config", "ModelOptLinearMethod"),
    ("nvfp4-w4a16", MODELOPT): Expected("ModelOptNvFp4Config", "ModelOptLinearMethod"),
    ("fp8-dynamic", MODELOPT): Expected("ModelOptFp8Config", "ModelOptLinearMethod"),
    ("fp8", MODELOPT): Expected("ModelOptFp8Config", "ModelOptLinearMethod"),
    ("fp8-block", MODELOPT): Expected("ModelOptFp8Config", "ModelOptLinearMethod", "none"),
    ("mxfp8", MODELOPT): Expected("ModelOptMxFp8Config", "ModelOptLinearMethod", "weights"),
}
# Parameters vLLM creates that a checkpoint without a quantized KV cache does not fill (vLLM
# defaults them). Also unfilled, in weight-only ModelOpt NVFP4 only: the input scale vLLM registers
# and drops there (see assert_loaded_cleanly).
UNFILLED = ("attn.q_scale", "attn.k_scale", "attn.v_scale", "attn.prob_scale", "attn.q_zero_point",
            "attn.k_zero_point", "attn.v_zero_point")


# Tiny models whose N and K are all multiples of 128 at hidden 256 (k/v_proj: hidden / 2 rows).
MODELS = {
    "llama": lambda hidden: LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "gemma3": lambda hidden: Gemma3TextConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": lambda hidden: Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=EXPERTS, num_experts_per_tok=2),
}


@functools.cache
def calibrated(fmt: str, arch: str = "llama", hidden: int = 256, head: bool = False, kv: bool = False,
               layer_formats: tuple[tuple[str, str], ...] = ()) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny ``arch`` model calibrated to ``fmt`` by round to nearest (``head``: lm_head too;
    ``kv``: with an FP8 KV cache; ``layer_formats``: (pattern, format) pairs for other layers), and
    activations of another batch at the input of each vLLM module of PROJECTIONS it has and,
    with ``head``, of lm_head (``[T, K]`` bf16)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODELS[arch](hidden), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(1))
    recipe = quantkit.Recipe(fmt, ("rtn",), ignore=() if head else DEFAULT_IGNORE, kv_cache="fp8" if kv else None,
                             layer_formats=dict(layer_formats))
    quantkit.quantize(model, recipe, ids[:4])
    inputs, layer = {}, model.model.layers[0]
    modules = dict(layer.named_modules())
    hooks = [modules[members[0]].register_forward_pre_hook(
        lambda _, args, name=name: inputs.__setitem__(name, args[0].reshape(-1, args[0].shape[-1])))
        for name, members in PROJECTIONS.items() if members[0] in modules]
    if head:
        hooks.append(model.lm_head.register_forward_pre_hook(
            lambda _, args: inputs.__setitem__("lm_head", args[0].reshape(-1, args[0].shape[-1]))))
    with torch.no_grad():
        model(ids[4:])
    for hook in hooks:
        hook.remove()
    return model, inputs


def read_untagged(directory: Path, tmp: Path) -> torch.nn.Module:
    """``quantkit.load`` of the checkpoint with its ``quantkit_format`` tag removed: the standard
    format it is stored as, as any other reader sees it."""
    plain = tmp / "untagged"
    shutil.copytree(directory, plain)
    for name in ("config.json", "hf_quant_config.json"):
        path = plain / name
        if path.exists():
            cfg = json.loads(path.read_text())
            for section in (cfg, cfg.get("quantization_config", {}), cfg.get("quantization", {})):
                section.pop("quantkit_format", None)
            path.write_text(json.dumps(cfg))
    return load(plain, dtype=torch.bfloat16)


DENSE = [(fmt, export, "llama") for fmt, export in CASES] + [
    ("nvfp4", CT, "gemma3"), ("nvfp4-w4a16", MODELOPT, "gemma3"), ("fp8-block", CT, "gemma3")]
# Mixed precision: (format, export, arch, (pattern, format) pairs); vLLM serves each layer in its format.
ATTENTION_FP8 = (("*self_attn*", "fp8-dynamic"),)
MIXED = [("nvfp4", CT, "llama", ATTENTION_FP8), ("nvfp4-w4a16", MODELOPT, "llama", ATTENTION_FP8),
         ("fp8-dynamic", CT, "gemma3", (("*down_proj", "nvfp4-w4a16"),)),
         ("nvfp4", MODELOPT, "gemma3", (("*mlp*", "fp8-block"),))]
MIXED_CONFIG = {CT: "CompressedTensorsConfig", MODELOPT: "ModelOptMixedPrecisionConfig"}
# MoE (Qwen3-MoE experts): vLLM's MoE method per format and flavour, and the tensors of each
# expert Linear it stacks into its w13_* (gate and up of every expert) and w2_* (down) parameters.
NVFP4_CT = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
NVFP4_MODELOPT = ("weight", "weight_scale", "weight_scale_2", "input_scale")
MOE = {
    ("nvfp4", CT): ("CompressedTensorsW4A4Nvfp4MoEMethod", NVFP4_CT),
    ("nvfp4", MODELOPT): ("ModelOptNvFp4FusedMoE", NVFP4_MODELOPT),
    ("fp8-block", CT): ("CompressedTensorsW8A8Fp8MoEMethod", ("weight", "weight_scale")),
    ("fp8-dynamic", CT): ("CompressedTensorsW8A8Fp8MoEMethod", ("weight", "weight_scale")),
    ("fp8", CT): ("CompressedTensorsW8A8Fp8MoEMethod", ("weight", "weight_scale", "input_scale")),
    ("fp8", MODELOPT): ("ModelOptFp8MoEMethod", ("weight", "weight_scale", "input_scale")),
    ("mxfp8", CT): ("CompressedTensorsW8A8Mxfp8MoEMethod", ("weight", "weight_scale")),
    ("mxfp8", MODELOPT): ("ModelOptMxFp8FusedMoE", ("weight", "weight_scale")),
}
EXPERTS_MODULE = "model.layers.0.mlp.experts.routed_experts"
SHARD_BYTES = 300_000  # the MoE checkpoints are written in shards with an index


class Key(NamedTuple):
    fmt: str
    export: str
    arch: str = "llama"
    hidden: int = 256
    head: bool = False  # lm_head quantized too
    kv: bool = False  # FP8 KV cache
    layer_formats: tuple[tuple[str, str], ...] = ()  # mixed precision


# Checkpoints quantkit writes (with a warning) and reads, and vLLM refuses, with vLLM's reason.
REFUSED = {
    Key("fp8-block", CT, hidden=128):  # k_proj: 64 rows, half a 128-row block
        "output_partition_size = 64 is not divisible by weight quantization block_n = 128",
    Key("nvfp4-w4a16", CT, head=True): "no module or parameter named 'lm_head.weight_global_scale'",
    Key("fp8-dynamic", MODELOPT, "qwen3_moe"): "shape '[]' is invalid for input of size",  # per-channel experts
    Key("fp8-block", MODELOPT, hidden=128): "start (2) + length (1) exceeds dimension size (2)",
    Key("fp8-block", MODELOPT, "qwen3_moe"): "shape '[]' is invalid for input of size",  # block-scaled experts
}
HEAD = Key("nvfp4-w4a16", MODELOPT, head=True)  # a quantized lm_head vLLM does load
# FP8 KV caches: vLLM's KV-cache method per flavour.
KV = {Key("fp8-dynamic", CT, kv=True): "CompressedTensorsKVCacheMethod",
      Key("nvfp4", CT, "gemma3", kv=True): "CompressedTensorsKVCacheMethod",
      Key("nvfp4", MODELOPT, kv=True): "ModelOptKVCacheMethod"}


def attention_modules(arch: str) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(MODELS[arch](256).num_hidden_layers)]


@dataclass
class Checkpoint:
    directory: Path
    inputs: dict[str, torch.Tensor]
    warnings: list[str]
    result: dict = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[tuple, Checkpoint]:
    """Every case of DENSE, MOE, HEAD, KV and REFUSED, saved by quantkit and run through
    ``vllm_driver.py`` in one subprocess (vLLM's import costs seconds)."""
    try:  # a test dependency, fetched from PyPI on first use: without it the tests fail
        vllm_src = vllm_env.ensure()
    except RuntimeError as e:
        pytest.fail(f"vLLM sources unavailable: {e}")
    root = tmp_path_factory.mktemp("vllm")
    checkpoints, jobs = {}, []
    keys = ([Key(*case) for case in DENSE] + [Key(fmt, export, arch, layer_formats=pairs) for fmt, export, arch, pairs in MIXED]
            + [Key(fmt, export, "qwen3_moe") for fmt, export in MOE] + [HEAD, *KV, *REFUSED])
    for key in keys:
        fmt, export, arch, hidden, head, kv, layer_formats = key
        model, inputs = calibrated(fmt, arch, hidden, head, kv, layer_formats)
        directory = root / "-".join(map(str, key))
        shards = {"max_shard_bytes": SHARD_BYTES} if arch == "qwen3_moe" else {}  # vLLM reads the index
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save(model, directory, export=export, **shards)
        save_file(inputs, directory.with_suffix(".inputs"))
        checkpoints[key] = Checkpoint(directory, inputs, [str(w.message) for w in caught])
        jobs.append({"checkpoint": str(directory), "inputs": str(directory.with_suffix(".inputs")),
                     "outputs": str(directory.with_suffix(".outputs")),
                     "dump": [EXPERTS_MODULE] if arch == "qwen3_moe" else attention_modules(arch) if kv else [],
                     "moe_backend": "emulation" if fmt.startswith("nvfp4") else "triton"})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(vllm_src), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "vllm_driver.py"), str(root / "jobs.json")], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    results = {r["checkpoint"]: r for r in (json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
                                            if line.startswith("RESULT "))}
    assert len(results) == len(jobs), f"vLLM driver failed:\n{done.stderr[-3000:]}"
    for checkpoint in checkpoints.values():
        checkpoint.result = results[str(checkpoint.directory)]
        if "refused" not in checkpoint.result:
            checkpoint.outputs = load_file(checkpoint.directory.with_suffix(".outputs"))
    return checkpoints


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def loaded_params(outputs: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {key.split(":")[1]: value for key, value in outputs.items() if key.startswith(module + ":")}


def assert_loaded_cleanly(checkpoint: Checkpoint, weight_only_modelopt: bool = False) -> None:
    """vLLM built and loaded the model, saw no reason to warn at save, and left unfilled only the
    parameters a checkpoint without a quantized KV cache lacks."""
    assert "refused" not in checkpoint.result, checkpoint.result["refused"]
    assert not [w for w in checkpoint.warnings if "vLLM" in w]
    for name in checkpoint.result["unloaded"]:
        assert name.endswith(UNFILLED) or (weight_only_modelopt and name.endswith(("_proj.input_scale", "lm_head.input_scale"))), name


@pytest.mark.parametrize(("fmt", "export", "arch"), DENSE)
def test_vllm_loads_and_serves_the_checkpoint(fmt, export, arch, served, tmp_path):
    checkpoint = served[Key(fmt, export, arch)]
    assert checkpoint.result["quant_config"] == CASES[fmt, export].config
    check_served(checkpoint, {name: CASES[fmt, export] for name in PROJECTIONS}, tmp_path,
                 weight_only_modelopt=export == MODELOPT and fmt == "nvfp4-w4a16")


@pytest.mark.parametrize(("fmt", "export", "arch", "layer_formats"), MIXED)
def test_vllm_serves_each_layer_of_a_mixed_precision_checkpoint_in_its_format(fmt, export, arch, layer_formats,
                                                                               served, tmp_path):
    checkpoint = served[Key(fmt, export, arch, layer_formats=layer_formats)]
    assert checkpoint.result["quant_config"] == MIXED_CONFIG[export]
    formats = assign_formats([f"model.layers.0.{members[0]}" for members in PROJECTIONS.values()], fmt, dict(layer_formats))
    assert len(set(formats.values())) == 2
    cases = {name: CASES[formats[f"model.layers.0.{members[0]}"], export] for name, members in PROJECTIONS.items()}
    check_served(checkpoint, cases, tmp_path,
                 weight_only_modelopt=export == MODELOPT and "nvfp4-w4a16" in formats.values())


def check_served(checkpoint: Checkpoint, cases: dict[str, Expected], tmp_path: Path, weight_only_modelopt: bool) -> None:
    """vLLM loaded ``checkpoint`` cleanly, chose ``cases[module].scheme`` for each module of
    PROJECTIONS, stacked the members' checkpoint tensors exactly, and (where its CPU code runs the
    layer: ``cases[module].cpu_forward``) computes what ``quantkit.load`` of the untagged checkpoint computes."""
    assert_loaded_cleanly(checkpoint, weight_only_modelopt)
    result, outputs, inputs = checkpoint.result, checkpoint.outputs, checkpoint.inputs
    assert {name: result["schemes"][name] for name in PROJECTIONS} == {name: c.scheme for name, c in cases.items()}

    # vLLM's fused parameters hold exactly the members' checkpoint tensors, stacked in its order.
    tensors = tensors_of(checkpoint.directory)
    for name, members in PROJECTIONS.items():
        prefix = "model.layers.0."
        params = loaded_params(outputs, name)
        compared = [p for p in params if f"{prefix}{members[0]}.{p}" in tensors]
        assert {"weight", "weight_packed"} & set(compared), (name, sorted(params))
        for p in compared:
            stacked = torch.cat([as_bytes(tensors[f"{prefix}{m}.{p}"]) for m in members])
            assert torch.equal(as_bytes(params[p]), stacked), (name, p)

    assert set(result["errors"]) == {name for name, c in cases.items() if c.cpu_forward == "none"}, result["errors"]
    if all(c.cpu_forward == "none" for c in cases.values()):
        return
    reference = read_untagged(checkpoint.directory, tmp_path).model.layers[0]
    with torch.no_grad():
        for name, members in PROJECTIONS.items():
            case = cases[name]
            if case.cpu_forward == "none":
                continue
            layers = [reference.get_submodule(m) for m in members]
            x = inputs[name]
            if case.cpu_forward == "weights":
                expected = torch.cat([x @ layer.dequantized_weight().to(x.dtype).t() for layer in layers], dim=-1)
            else:
                expected = torch.cat([layer(x) for layer in layers], dim=-1)
            got, expected = outputs[name].float(), expected.float()
            assert got.shape == expected.shape, name
            error = ((got - expected).norm() / expected.norm()).item()
            assert error <= 1e-2, (name, error)


@pytest.mark.parametrize(("fmt", "export"), list(MOE))
def test_vllm_loads_the_moe_experts(fmt, export, served):
    """Qwen3-MoE, written in shards: vLLM's loader finds them through the index, and its MoE method
    takes every expert's tensors under quantkit's per-expert names, stacked as w13 = [gate; up]
    and w2 = down per expert (a per-expert scale where vLLM keeps one: gate's and up's are one
    value, as they share it); the router stays unquantized."""
    method, names = MOE[fmt, export]
    checkpoint = served[Key(fmt, export, "qwen3_moe")]
    assert len(list(checkpoint.directory.glob("model-*-of-*.safetensors"))) > 1
    assert (checkpoint.directory / "model.safetensors.index.json").exists()
    assert_loaded_cleanly(checkpoint)
    assert checkpoint.result["schemes"][EXPERTS_MODULE] == method
    assert checkpoint.result["schemes"]["model.layers.0.mlp.gate"] == "UnquantizedLinearMethod"
    tensors, params = tensors_of(checkpoint.directory), loaded_params(checkpoint.outputs, EXPERTS_MODULE)
    expert = "model.layers.0.mlp.experts.{}.{}.{}"
    for stacked, members in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
        for name in names:
            ours = [[tensors[expert.format(e, m, name)] for m in members] for e in range(EXPERTS)]
            theirs = params[f"{stacked}_{name}"]
            flat = torch.cat([as_bytes(t) for per_expert in ours for t in per_expert])
            if as_bytes(theirs).numel() == flat.numel():
                assert torch.equal(as_bytes(theirs), flat), (stacked, name)
            else:
                assert theirs.numel() == EXPERTS, (stacked, name, tuple(theirs.shape))
                for value, per_expert in zip(theirs.reshape(-1).tolist(), ours):
                    assert all(t.numel() == 1 and t.item() == value for t in per_expert), (stacked, name)


def test_vllm_loads_a_quantized_lm_head_from_modelopt(served):
    checkpoint = served[HEAD]
    assert_loaded_cleanly(checkpoint, weight_only_modelopt=True)
    assert checkpoint.result["schemes"]["lm_head"] == "ModelOptLinearMethod"
    tensors, params = tensors_of(checkpoint.directory), loaded_params(checkpoint.outputs, "lm_head")
    for name in ("weight", "weight_scale", "weight_scale_2"):
        assert torch.equal(as_bytes(params[name]), as_bytes(tensors[f"lm_head.{name}"])), name
    assert not checkpoint.result["errors"], checkpoint.result["errors"]
    x = checkpoint.inputs["lm_head"]
    with torch.no_grad():
        expected = load(checkpoint.directory, dtype=torch.bfloat16).lm_head(x).float()
    got = checkpoint.outputs["lm_head"].float()
    assert got.shape == expected.shape and (got - expected).norm() <= 1e-2 * expected.norm()


@pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                    reason="vLLM's CPU attention backend serves an FP8 KV cache only on AVX-512 or AMX hosts")
@pytest.mark.parametrize("key", list(KV), ids=lambda key: f"{key.fmt}-{key.export}-{key.arch}")
def test_vllm_loads_the_fp8_kv_cache_scales(key, served):
    """vLLM's KV-cache method takes every attention layer's ``k_scale`` / ``v_scale`` under the
    flavour's names (remapped to ``self_attn.attn.*``), equal to quantkit's calibrated scales."""
    checkpoint = served[key]
    assert_loaded_cleanly(checkpoint)
    assert not [n for n in checkpoint.result["unloaded"] if n.endswith(("attn.k_scale", "attn.v_scale"))]
    scales = kv_scales(calibrated(key.fmt, key.arch, key.hidden, key.head, key.kv)[0])
    assert len(scales) == len(attention_modules(key.arch))
    for module in attention_modules(key.arch):
        assert checkpoint.result["schemes"][module] == KV[key]
        params = loaded_params(checkpoint.outputs, module)
        k_scale, v_scale = scales[module.removesuffix(".attn")]
        assert params["k_scale"].item() == k_scale.item() and params["v_scale"].item() == v_scale.item(), module


@pytest.mark.parametrize("key", list(REFUSED), ids=lambda key: f"{key.fmt}-hidden{key.hidden}-head{key.head}")
def test_vllm_refuses_what_save_warns_about(key, served):
    checkpoint = served[key]
    assert [w for w in checkpoint.warnings if w.startswith("vLLM will not load")]
    assert REFUSED[key] in checkpoint.result.get("refused", "")
