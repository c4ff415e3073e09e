"""save / load / describe: a quantized Hugging Face model to and from a checkpoint directory vLLM loads."""
from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from quantkit.export import compressed_tensors, modelopt
from quantkit.export.io import (
    CONFIG,
    MAX_SHARD_BYTES,
    CheckpointError,
    CheckpointTensors,
    atomic_directory,
    read_json,
    write_json,
    write_safetensors,
)
from quantkit.export.layout import Scheme, TensorSpec, export_layer, import_layer
from quantkit.export.names import CheckpointNames
from quantkit.formats import QuantizedWeight, get_format
from quantkit.nn import QuantLinear
from quantkit.nn.experts import expert_modules, linearize_experts, router_names
from quantkit.nn.fuse import FusedProjections, straddling_members
from quantkit.nn.kv_cache import attention_modules, enable_kv_cache, kv_scales
from quantkit.nn.swap import check_shared_formats, fused_groups

FLAVOURS: dict[str, ModuleType] = {compressed_tensors.NAME: compressed_tensors, modelopt.NAME: modelopt}


def _flavour(export: str) -> ModuleType:
    try:
        return FLAVOURS[export]
    except KeyError:
        raise ValueError(f"unknown export flavour {export!r}; valid: {', '.join(FLAVOURS)}") from None


def save(model: nn.Module, out_dir: str | os.PathLike, *, export: str = "compressed-tensors", tokenizer=None,
         max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the quantized Hugging Face ``model`` to ``out_dir`` as a checkpoint vLLM loads.

    ``export``: ``"compressed-tensors"`` (llm-compressor's layout) or ``"modelopt"`` (NVIDIA
    ModelOpt's). Writes ``config.json`` (the model's config plus ``quantization_config``),
    safetensors weights (sharded with an index above ``max_shard_bytes``), the generation config,
    the tokenizer when given, and ModelOpt's ``hf_quant_config.json``. The
    :class:`~quantkit.nn.QuantLinear` layers may have different formats (a mixed-precision
    checkpoint; fused siblings such as q/k/v, and one MoE block's experts, share one); the model's other ``nn.Linear`` layers
    and its MoE routers are listed as ignored. Tensors take the names of the model's hub checkpoint
    (what ``save_pretrained`` writes, :class:`~quantkit.export.names.CheckpointNames`); MoE experts
    are written per expert (``...experts.{e}.gate_proj.weight_packed`` etc.), as vLLM's MoE
    loaders read them. A model with an FP8 KV cache (``Recipe(kv_cache="fp8")``,
    :mod:`quantkit.nn.kv_cache`) also gets its per-layer ``k_scale`` / ``v_scale`` and the
    flavour's KV-cache entry in the config. The write is atomic (see :func:`quantkit.export.io.atomic_directory`).
    Raises ``ValueError`` for a model without QuantLinear layers or with fused projections
    (:func:`quantkit.fuse_projections`), fused siblings or one MoE block's experts in different
    formats, a format the flavour lacks, or a static-activation format (nvfp4, fp8) whose layers
    have no calibrated ``input_scale``.
    """
    flavour = _flavour(export)
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        raise ValueError("save needs a Hugging Face model (one with a .config)")
    if any(isinstance(m, FusedProjections) for m in model.modules()):
        raise ValueError("the model's projections are fused for inference (quantkit.fuse_projections): "
                         "save the model before fusing them")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not layers:
        raise ValueError("the model has no QuantLinear layers: quantize it first (quantkit.quantize or quantize_model)")
    formats = {name: m.format for name, m in layers.items()}
    check_shared_formats(formats)
    specs = {fmt: flavour.tensor_specs(fmt) for fmt in set(formats.values())}  # a format the flavour lacks fails here
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    for fmt in specs:
        _warn_where_vllm_refuses(model, {n: m for n, m in layers.items() if m.format == fmt}, output_embeddings, fmt,
                                 export)
    names = CheckpointNames(model)
    high_precision = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)] + router_names(model)
    ignore = [names.module(name) for name in high_precision]
    kv = kv_scales(model)
    kv_cache = "fp8" if kv else None
    tensors = _tensors_to_write(model, layers, specs, names, skip={f"{a}.kv_cache" for a in kv})
    for attention, scales in kv.items():
        for local, scale in zip(flavour.KV_SCALE_NAMES, scales):
            tensors[f"{names.module(attention)}.{local}"] = scale.detach().float().cpu().reshape(())
    cfg = config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    on_disk = {names.module(name): fmt for name, fmt in formats.items()}
    cfg["quantization_config"] = flavour.quantization_config(on_disk, ignore, kv_cache)
    if cfg.get("tie_word_embeddings") and isinstance(output_embeddings, QuantLinear):
        cfg["tie_word_embeddings"] = False  # a quantized lm_head no longer shares the embedding matrix
    with atomic_directory(out_dir) as tmp:
        write_safetensors(tensors, tmp, max_shard_bytes)
        for name, obj in flavour.sidecar_files(on_disk, ignore, kv_cache).items():
            write_json(tmp / name, obj)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(tmp / CONFIG, cfg)  # last: a directory without config.json is never loaded
    return Path(out_dir)


def _warn_where_vllm_refuses(model: nn.Module, layers: dict[str, QuantLinear], head: nn.Module | None, fmt: str,
                             export: str) -> None:
    """Warn about the checkpoints quantkit writes and reads but vLLM (0.34, checked in
    tests/test_vllm_serving.py) refuses: a scale block straddling two projections vLLM stacks
    (q/k/v, gate/up: every member but the last must fill whole blocks of rows, e.g. 128 for
    fp8-block); a quantized ``lm_head`` in compressed-tensors (vLLM's ``ParallelLMHead`` takes
    only ``weight`` there; it loads a ModelOpt one); and MoE experts in ModelOpt ``fp8-dynamic`` or
    ``fp8-block`` (vLLM's ModelOpt FP8 MoE method takes per-tensor expert scales only)."""
    rows = get_format(fmt).weight.block[0]
    ragged = [group[i] for group in fused_groups(layers)
              for i in straddling_members([layers[name].out_features for name in group], rows)]
    if ragged:
        warnings.warn(f"vLLM will not load this {fmt} checkpoint: {', '.join(ragged)} "
                      f"{'has' if len(ragged) == 1 else 'have'} output rows that are not a multiple of the "
                      f"{rows}-row scale block, and vLLM stacks them with the next projection of their group. "
                      f"quantkit.load reads it; for vLLM choose a format without row blocks (e.g. fp8-dynamic)",
                      stacklevel=3)
    if export == compressed_tensors.NAME and head is not None and head in layers.values():
        warnings.warn("vLLM will not load this compressed-tensors checkpoint: its output layer (lm_head) is "
                      "quantized, and vLLM reads only an unquantized lm_head from compressed-tensors. quantkit.load "
                      "reads it; for vLLM keep lm_head in the ignore list or save with export='modelopt'",
                      stacklevel=3)
    if export == modelopt.NAME and fmt in ("fp8-dynamic", "fp8-block") and any(
            isinstance(m, QuantLinear) and m.format == fmt for experts in expert_modules(model) for m in experts.modules()):
        warnings.warn(f"vLLM will not load this modelopt {fmt} checkpoint: its MoE experts have "
                      f"{'per-channel' if fmt == 'fp8-dynamic' else '128x128 block'} scales, and vLLM's ModelOpt "
                      "FP8 MoE method takes per-tensor expert scales only. quantkit.load reads it; for vLLM save "
                      "with export='compressed-tensors'", stacklevel=3)


def _tensors_to_write(model: nn.Module, layers: dict[str, QuantLinear], specs: dict[str, tuple[TensorSpec, ...]],
                      names: CheckpointNames, skip: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its checkpoint name (``names``): QuantLinear layers per
    ``specs`` of their format, the rest as in ``state_dict`` except the tensors of the modules in ``skip``. Tied tensors (the same storage, shape and offset, e.g.
    a tied lm_head) are written once, under their first name, as Hugging Face does."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        disk = names.module(name)
        out.update({f"{disk}.{k}": v for k, v in export_layer(layer, specs[layer.format], name).items()})
        if layer.bias is not None:
            out[f"{disk}.bias"] = layer.bias.detach().cpu().contiguous()
    seen: set[tuple] = set()
    storages: set[int] = set()
    for key, t in model.state_dict().items():
        module = key.rpartition(".")[0]
        if module in layers or module in skip:
            continue
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if view in seen:
            continue
        seen.add(view)
        shares_storage = view[0] in storages
        storages.add(view[0])
        t = t.detach().cpu().contiguous()
        out[names.tensor(key)] = t.clone() if shares_storage else t
    return out


def _quantization_config(directory: Path, cfg: dict) -> tuple[ModuleType, Scheme]:
    """The flavour and :class:`Scheme` of a checkpoint, from config.json or ModelOpt's sidecar file."""
    where, qcfg = directory / CONFIG, cfg.get("quantization_config")
    if qcfg is None and (directory / modelopt.SIDECAR).is_file():
        where = directory / modelopt.SIDECAR
        qcfg = {"quant_method": modelopt.NAME, **read_json(where)}
    if not isinstance(qcfg, dict):
        raise CheckpointError(f"{where}: no quantization_config object: not a quantized checkpoint")
    method = str(qcfg.get("quant_method", "")).lower()
    if method == compressed_tensors.NAME:
        flavour = compressed_tensors
    elif method.startswith(modelopt.NAME):
        flavour = modelopt
    else:
        raise CheckpointError(f"{where}: quant_method {method!r} is not one quantkit reads "
                              f"({compressed_tensors.NAME}, {modelopt.NAME})")
    try:
        return flavour, flavour.read_config(qcfg)
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None


def _empty_model(directory: Path, cfg: dict, dtype: torch.dtype) -> nn.Module:
    """The model config.json describes, with parameters on the meta device (buffers real) and fused
    MoE experts split into per-expert Linears, as :func:`save` found them."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"{directory / CONFIG}: unknown or missing model_type {model_type!r}")
    config = CONFIG_MAPPING[model_type].from_dict(cfg)
    architecture = getattr(transformers, (cfg.get("architectures") or [""])[0], None)
    with init_empty_weights():
        if isinstance(architecture, type) and issubclass(architecture, transformers.PreTrainedModel):
            model = architecture._from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    linearize_experts(model)
    return model


def _load_layer(model: nn.Module, name: str, disk: str, linear: nn.Linear, fmt: str, specs: tuple[TensorSpec, ...],
                tensors: CheckpointTensors, dtype: torch.dtype) -> None:
    """Replace ``linear`` (called ``name``, ``disk`` in the checkpoint) by a QuantLinear filled from
    the checkpoint."""
    n, k = linear.out_features, linear.in_features
    fields = import_layer(tensors, f"{disk}.", specs, n, k)
    try:
        layer = QuantLinear(k, n, linear.bias is not None, format=fmt, static_input="input_scale" in fields, dtype=dtype)
    except ValueError as err:
        raise CheckpointError(f"{tensors.directory}: layer {name!r}: {err}") from None
    tensor_scale = fields.get("weight_tensor_scale")
    qweight = QuantizedWeight(fmt, fields["weight"].reshape(layer.weight.shape),
                              fields["weight_scale"].reshape(layer.weight_scale.shape),
                              None if tensor_scale is None else tensor_scale.reshape(()), (n, k))
    input_scale = fields.get("input_scale")
    layer.load_quantized(qweight, None if input_scale is None else input_scale.reshape(()))
    if layer.bias is not None:
        layer.bias.data.copy_(tensors.take(f"{disk}.bias", _FLOATS, (n,)))
    model.set_submodule(name, layer)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _load_kv_scales(model: nn.Module, flavour: ModuleType, tensors: CheckpointTensors, names: CheckpointNames) -> None:
    """Give each attention module whose scales the checkpoint holds (``flavour.KV_SCALE_NAMES``) its
    FP8 KV cache; the others (a multimodal model's vision tower, decoder layers the calibration
    data did not run) keep theirs in the model dtype. A checkpoint that declares the cache and
    holds no scale is refused."""
    first = flavour.KV_SCALE_NAMES[0]
    held = [name for name in attention_modules(model) if f"{names.module(name)}.{first}" in tensors]
    if not held:
        raise CheckpointError(f"{tensors.directory}: the config declares an FP8 KV cache, but no attention "
                              f"module has a {first} tensor")
    scales = {name: tuple(tensors.take(f"{names.module(name)}.{local}", _FLOATS, ()).float()
                          for local in flavour.KV_SCALE_NAMES)
              for name in held}
    try:
        enable_kv_cache(model, scales)
    except ValueError as err:
        raise CheckpointError(f"{tensors.directory}: {err}") from None


def _load_rest(model: nn.Module, tensors: CheckpointTensors, names: CheckpointNames) -> None:
    """Load the checkpoint's remaining tensors into the model's parameters and buffers they name
    (floating tensors cast to the parameter's dtype; shapes must match)."""
    expected = model.state_dict(keep_vars=True)
    state = {}
    for disk in tensors.untaken():
        name = names.model_key(disk)
        if name not in expected:
            continue
        want = expected[name]
        dtypes = _FLOATS if want.is_floating_point() else (want.dtype,)
        state[name] = tensors.take(disk, dtypes, tuple(want.shape)).to(want.dtype)
    model.load_state_dict(state, strict=False, assign=True)


def load(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model saved in checkpoint directory ``path``, with :class:`~quantkit.nn.QuantLinear` layers.

    Reads both export flavours of :func:`save` and, where the format matches a quantkit format,
    checkpoints written by llm-compressor or ModelOpt. The model is built from config.json with
    empty weights (MoE experts split into per-expert Linears), its quantized Linear layers (per the quantization config and its ignore list)
    are swapped for QuantLinears, every tensor is loaded with its on-disk convention undone,
    weights are tied as the config says, and the model is returned on ``device`` in eval mode;
    non-quantized floating tensors take ``dtype``. Raises :class:`CheckpointError` naming the file
    and problem for a missing directory, config or weights, a corrupt safetensors file, a tensor
    that is missing, unexpected, or of the wrong shape or dtype, or an unknown quantization format.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    cfg = read_json(directory / CONFIG)
    flavour, scheme = _quantization_config(directory, cfg)
    specs = {fmt: flavour.tensor_specs(fmt) for fmt in scheme.formats}
    tensors = CheckpointTensors(directory)
    model = _empty_model(directory, cfg, dtype)
    names = CheckpointNames(model)
    for name, module in list(model.named_modules()):
        fmt = scheme.format_of(names.module(name), module)
        if fmt is not None:
            _load_layer(model, name, names.module(name), module, fmt, specs[fmt], tensors, dtype)
    if scheme.kv_cache:
        _load_kv_scales(model, flavour, tensors, names)
    _load_rest(model, tensors, names)
    model.tie_weights()
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise CheckpointError(f"{directory}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:3]}")
    unexpected = tensors.untaken()
    if unexpected:
        raise CheckpointError(f"{directory}: {len(unexpected)} unexpected tensor(s) the model has no place for "
                              f"(or a layer the config leaves unquantized holds quantized tensors), e.g. {unexpected[:3]}")
    _warn_where_vllm_rerounds(model, directory)
    if (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.to(device).eval()


def _warn_where_vllm_rerounds(model: nn.Module, directory: Path) -> None:
    """Warn about per-tensor ``fp8`` layers whose stacked projections (q/k/v, gate/up) have
    separate weight scales, as ModelOpt and llm-compressor write them: quantkit computes them as
    written, vLLM stacks each group with one scale and re-rounds every member to the largest
    (``requantize_with_max_scale``). quantkit's own checkpoints share one scale per group."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.format == "fp8"}
    split = [group for group in fused_groups(layers) if len({layers[n].weight_scale.item() for n in group}) > 1]
    if split:
        warnings.warn(f"{directory}: {len(split)} stacked projection group(s), e.g. {', '.join(split[0])}, have "
                      "separate per-tensor FP8 weight scales. quantkit computes them as written; vLLM stacks each "
                      "group with one scale and re-rounds every member to the largest, so it serves slightly "
                      "different weights (benchmarks/accuracy_gemma.py --vllm-stacking evaluates those)", stacklevel=2)


def describe(path: str | os.PathLike) -> dict:
    """What checkpoint ``path`` holds, from its config and safetensors headers (no tensor is read).

    Keys: ``architecture``, ``export`` (flavour), ``format`` (quantkit format), ``kv_cache``
    (``"fp8"`` or ``None``), ``quantized_layers``,
    ``ignored_layers`` (entries of the ignore list), ``files``, ``tensors``, ``tensor_bytes`` and
    ``bytes_by_dtype`` (safetensors dtype names, e.g. ``{"U8": ..., "F8_E4M3": ..., "BF16": ...}``).
    Raises :class:`CheckpointError` for a missing directory, an unreadable config or quantization
    config, or a corrupt safetensors header. Tensors are not checked against the config (missing,
    extra or misshapen ones): :func:`load` does that (``quantkit inspect --check``)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    cfg = read_json(directory / CONFIG)
    flavour, scheme = _quantization_config(directory, cfg)
    tensors = CheckpointTensors(directory)
    by_dtype = Counter()
    for info in tensors.info.values():
        by_dtype[info.dtype] += info.nbytes
    return {
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "export": flavour.NAME,
        "format": scheme.format,
        "kv_cache": scheme.kv_cache,
        "quantized_layers": sum(name.endswith(".weight_scale") for name in tensors.info),
        "ignored_layers": len(scheme.ignore),
        "files": sorted({info.file for info in tensors.info.values()}),
        "tensors": len(tensors.info),
        "tensor_bytes": sum(by_dtype.values()),
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
    }
