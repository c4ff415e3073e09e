"""The NVIDIA ModelOpt flavour: ``hf_quant_config.json`` plus ``quant_method: modelopt`` in config.json.

ModelOpt keeps quantkit's own (multiply) scale convention, so nothing is inverted. Tensors per
Linear ``[N, K]`` (scalars are shape ``[]``), as vLLM's ``modelopt.py`` reads them:

============  ===========================  ============================================================
format        quant_algo                   tensors
============  ===========================  ============================================================
nvfp4         NVFP4                        ``weight`` u8 [N, K/2], ``weight_scale`` E4M3 [N, K/16],
                                           ``weight_scale_2`` FP32 = s_g, ``input_scale`` FP32
nvfp4-4over6  NVFP4                        as nvfp4, plus ``"quantkit_format": "nvfp4-4over6"`` in config.json
nvfp4-w4a16   W4A16_NVFP4                  as nvfp4, without ``input_scale``
nvfp4-w4a8    W4A16_NVFP4                  as nvfp4-w4a16, plus ``"quantkit_format": "nvfp4-w4a8"`` in config.json
fp8           FP8                          ``weight`` E4M3 [N, K], ``weight_scale`` FP32, ``input_scale`` FP32
fp8-dynamic   FP8_PER_CHANNEL_PER_TOKEN    ``weight`` E4M3 [N, K], ``weight_scale`` FP32 [N]
fp8-block     fp8_pb_wo                    ``weight`` E4M3 [N, K], ``weight_scale`` FP32 [⌈N/128⌉, 1, K/128, 1]
mxfp8         MXFP8                        ``weight`` E4M3 [N, K], ``weight_scale`` E8M0 (u8) [N, K/32]
============  ===========================  ============================================================

An FP8 KV cache (:mod:`quantkit.nn.kv_cache`) adds ``kv_cache_quant_algo: FP8`` to
:data:`SIDECAR` (config.json: ``kv_cache_scheme``, as ModelOpt converts it) and per attention module
FP32 ``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale`` (``amax / 448``, shape ``[]``).

These are what ModelOpt's ``export_hf_checkpoint`` writes (``fp8_pb_wo`` in lower case and the
4-D block scale included). ModelOpt calls ``fp8_pb_wo`` weight-only; vLLM serves it as W8A8 with
activations quantized dynamically per 1×128 group, which is quantkit's ``fp8-block``, so that is
the format it loads as. ModelOpt has no MXFP4 format: that raises ``ValueError`` on save (use the
compressed-tensors flavour). ``W4A16_NVFP4``, ``FP8_PER_CHANNEL_PER_TOKEN``, ``fp8_pb_wo`` and
``MXFP8`` need a recent vLLM (0.34 reads all of them); ``NVFP4`` and ``FP8`` load in every vLLM
with ModelOpt support.

A mixed-precision model (formats per layer) is written as ModelOpt's ``MIXED_PRECISION``: a
``quantized_layers`` entry per quantized Linear with its ``quant_algo`` (and ``group_size``), in
both files, as ModelOpt's ``auto_quantize`` export does; vLLM 0.34 reads it (``modelopt_mixed``).
"""
from __future__ import annotations

from collections import Counter
from fnmatch import fnmatchcase
from math import ceil

import torch
from torch import nn

import quantkit
from quantkit.export.io import CheckpointError
from quantkit.export.layout import FLOAT_SCALES, STORED_AS, Scheme, TensorSpec, main_format, tag_format, tagged_format

NAME = "modelopt"
SIDECAR = "hf_quant_config.json"
GROUP_SIZE = 16
KV_SCALE_NAMES = ("k_proj.k_scale", "v_proj.v_scale")  # under the attention module
_KV_ALGOS = {"fp8": "FP8"}

_E4M3 = torch.float8_e4m3fn
ALGOS = {"nvfp4": "NVFP4", "nvfp4-w4a16": "W4A16_NVFP4", "fp8": "FP8", "fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN",
         "fp8-block": "fp8_pb_wo", "mxfp8": "MXFP8"}
_FORMATS = {algo.upper(): fmt for fmt, algo in ALGOS.items()}
MIXED = "MIXED_PRECISION"
_GROUP_SIZES = {"nvfp4": GROUP_SIZE, "nvfp4-w4a16": GROUP_SIZE, "mxfp8": 32}  # the sidecar's group_size
ALGOS.update({fmt: ALGOS[stored] for fmt, stored in STORED_AS.items() if stored in ALGOS})


def _scalar(name: str, field: str) -> TensorSpec:
    return TensorSpec(name, field, torch.float32, lambda n, k: ())


_NVFP4 = (TensorSpec("weight", "weight", torch.uint8, lambda n, k: (n, k // 2)),
          TensorSpec("weight_scale", "weight_scale", _E4M3, lambda n, k: (n, k // GROUP_SIZE)),
          _scalar("weight_scale_2", "weight_tensor_scale"))
_FP8_WEIGHT = TensorSpec("weight", "weight", _E4M3, lambda n, k: (n, k))
_SPECS: dict[str, tuple[TensorSpec, ...]] = {
    "nvfp4": (*_NVFP4, _scalar("input_scale", "input_scale")),
    "nvfp4-w4a16": _NVFP4,
    "fp8": (_FP8_WEIGHT, TensorSpec("weight_scale", "weight_scale", torch.float32, lambda n, k: (), accept=FLOAT_SCALES),
            TensorSpec("input_scale", "input_scale", torch.float32, lambda n, k: (), accept=FLOAT_SCALES)),
    "fp8-dynamic": (_FP8_WEIGHT, TensorSpec("weight_scale", "weight_scale", torch.float32, lambda n, k: (n,),
                                            accept=FLOAT_SCALES)),
    "fp8-block": (_FP8_WEIGHT, TensorSpec("weight_scale", "weight_scale", torch.float32,
                                          lambda n, k: (ceil(n / 128), 1, k // 128, 1), accept=FLOAT_SCALES)),
    "mxfp8": (_FP8_WEIGHT, TensorSpec("weight_scale", "weight_scale", torch.uint8,
                                      lambda n, k: (n, k // _GROUP_SIZES["mxfp8"]))),
}
_SPECS.update({fmt: _SPECS[stored] for fmt, stored in STORED_AS.items() if stored in _SPECS})


def tensor_specs(fmt: str) -> tuple[TensorSpec, ...]:
    """The on-disk tensors of one Linear in ``fmt``; ``ValueError`` for formats ModelOpt lacks."""
    if fmt not in _SPECS:
        raise ValueError(f"ModelOpt has no {fmt} format (it has {', '.join(ALGOS)}); "
                         f"save with export='compressed-tensors' instead")
    return _SPECS[fmt]


def _algo(fmt: str) -> dict:
    """``quant_algo`` (and ``group_size``) of ``fmt``, as :data:`SIDECAR` states them."""
    stored = STORED_AS.get(fmt, fmt)
    return {"quant_algo": ALGOS[fmt], **({"group_size": _GROUP_SIZES[stored]} if stored in _GROUP_SIZES else {})}


def _quantized_layers(formats: dict[str, str]) -> dict[str, dict] | None:
    """``MIXED_PRECISION``'s per-layer entries when ``formats`` (name -> format) mixes formats, else ``None``."""
    if len(set(formats.values())) == 1:
        return None
    return {name: tag_format(_algo(fmt), fmt) for name, fmt in sorted(formats.items())}


def _hf_quant_config(formats: dict[str, str], ignore: list[str], kv_cache: str | None) -> dict:
    layers = _quantized_layers(formats)
    head = {"quant_algo": MIXED} if layers else _algo(main_format(formats))
    quantization = {**head, "kv_cache_quant_algo": _KV_ALGOS.get(kv_cache), "exclude_modules": list(ignore)}
    if layers:
        quantization["quantized_layers"] = layers
    return {"producer": {"name": "quantkit", "version": quantkit.__version__}, "quantization": quantization}


def quantization_config(formats: dict[str, str], ignore: list[str], kv_cache: str | None = None) -> dict:
    """config.json's ``quantization_config`` for the quantized Linear layers ``formats`` (checkpoint
    name -> quantkit format): what ModelOpt's ``convert_hf_quant_config_format`` makes of
    :data:`SIDECAR` (config groups for NVFP4 and FP8, ``ignore``, ``quant_algo``, ``producer``;
    ``quantkit_format`` for a format stored as another, see :data:`~quantkit.export.layout.STORED_AS`;
    ``quantized_layers`` for a mixed-precision model)."""
    sidecar = _hf_quant_config(formats, ignore, kv_cache)
    fmt = main_format(formats)
    layers = sidecar["quantization"].get("quantized_layers")
    out = {"ignore": list(ignore), "quant_algo": MIXED if layers else ALGOS[fmt], "producer": sidecar["producer"],
           "quant_method": "modelopt"}
    if layers:
        out["quantized_layers"] = layers
    if kv_cache:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    stored = STORED_AS.get(fmt, fmt)
    if not layers and stored in ("nvfp4", "fp8"):
        bits, extra = (4, {"group_size": GROUP_SIZE}) if stored == "nvfp4" else (8, {})
        args = {"dynamic": False, "num_bits": bits, "type": "float", **extra}
        out["config_groups"] = {"group_0": {"input_activations": args, "weights": dict(args), "targets": ["Linear"]}}
    return tag_format(out, fmt)


def sidecar_files(formats: dict[str, str], ignore: list[str], kv_cache: str | None = None) -> dict[str, dict]:
    """``{"hf_quant_config.json": ...}``, the file ModelOpt writes and older vLLMs read."""
    return {SIDECAR: _hf_quant_config(formats, ignore, kv_cache)}


def _format(entry: dict, where: str) -> str:
    """The quantkit format of a ``quant_algo`` / ``group_size`` entry (``where`` names it in errors)."""
    algo = str(entry.get("quant_algo", "")).upper()
    if algo not in _FORMATS:
        raise CheckpointError(f"ModelOpt quant_algo {algo or None!r}{where} matches no quantkit format "
                              f"(supported: {', '.join(_FORMATS)}, {MIXED})")
    group_size = entry.get("group_size")
    size = _GROUP_SIZES.get(_FORMATS[algo])
    if size is not None and group_size not in (None, size):
        raise CheckpointError(f"ModelOpt {algo}{where} with group_size {group_size} is not {_FORMATS[algo]} "
                              f"(group size {size})")
    return _FORMATS[algo]


def read_config(qcfg: dict) -> Scheme:
    """The :class:`Scheme` of config.json's ``quantization_config`` or
    the ``hf_quant_config.json`` form (``{"quantization": {...}}``), one format or ``MIXED_PRECISION``
    with its ``quantized_layers``; :class:`CheckpointError` if unknown."""
    nested = isinstance(qcfg.get("quantization"), dict)
    details = qcfg["quantization"] if nested else qcfg
    exclude = list(details.get("exclude_modules" if nested else "ignore") or [])
    kv_cache = _kv_cache(details.get("kv_cache_quant_algo"), qcfg.get("kv_cache_scheme"))
    if str(details.get("quant_algo", "")).upper() == MIXED:
        entries = details.get("quantized_layers")
        if not isinstance(entries, dict) or not entries or not all(isinstance(e, dict) for e in entries.values()):
            raise CheckpointError(f"ModelOpt {MIXED} needs a quantized_layers object of per-layer quant_algo entries")
        layers = {name: tagged_format(e, _format(e, f" of layer {name!r}")) for name, e in entries.items()}

        def format_of(name: str, module: nn.Module) -> str | None:
            return layers.get(name) if isinstance(module, nn.Linear) else None

        return Scheme(tuple(f for f, _ in Counter(layers.values()).most_common()), tuple(exclude), format_of, kv_cache)
    fmt = tagged_format(qcfg, _format(details, ""))

    def format_of_layer(name: str, module: nn.Module) -> str | None:
        excluded = any(name == p or fnmatchcase(name, p) for p in exclude)
        return fmt if isinstance(module, nn.Linear) and not excluded else None

    return Scheme((fmt,), tuple(exclude), format_of_layer, kv_cache)


def _kv_cache(algo, scheme) -> str | None:
    """``"fp8"`` for ModelOpt's FP8 KV cache (``kv_cache_quant_algo: FP8`` in :data:`SIDECAR`, or
    config.json's ``kv_cache_scheme``), ``None`` for none; :class:`CheckpointError` otherwise."""
    if algo is None and scheme is None:
        return None
    fp8 = (str(algo).upper() == "FP8" if algo is not None else isinstance(scheme, dict)
           and (scheme.get("num_bits"), scheme.get("type"), scheme.get("dynamic")) == (8, "float", False))
    if not fp8:
        raise CheckpointError(f"ModelOpt KV cache {algo if algo is not None else scheme!r} is not one quantkit reads (FP8)")
    return "fp8"
