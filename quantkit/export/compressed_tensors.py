"""The compressed-tensors flavour: what llm-compressor writes and vLLM loads.

Each quantkit format maps to one of compressed-tensors' preset schemes (``NVFP4``, ``NVFP4A16``,
``MXFP4``, ``MXFP8``, ``FP8_BLOCK``, ``FP8_DYNAMIC``, ``FP8``), written as the single config group
``group_0`` targeting ``Linear``, with the skipped Linear layers in ``ignore``. A mixed-precision
model (formats per layer) gets ``group_0`` for its most used format and one more group per other
format, targeting those layers by name (names win over ``Linear`` in vLLM and here), each group
with its own compression ``format`` and the top-level one ``mixed-precision``, as llm-compressor
writes them.

Tensors per Linear ``[N, K]`` (scalars are shape ``[1]``):

=============  =========================  ===================================================
format         compression format         tensors
=============  =========================  ===================================================
nvfp4          nvfp4-pack-quantized       ``weight_packed`` u8 [N, K/2], ``weight_scale`` E4M3 [N, K/16],
                                          ``weight_global_scale`` = 1/s_g, ``input_global_scale`` = 1/input_scale
nvfp4-4over6   nvfp4-pack-quantized       as nvfp4 (config too), plus ``"quantkit_format": "nvfp4-4over6"``
nvfp4-w4a16    nvfp4-pack-quantized       as nvfp4, without ``input_global_scale``
nvfp4-w4a8     nvfp4-pack-quantized       as nvfp4-w4a16 (config too), plus ``"quantkit_format": "nvfp4-w4a8"``
mxfp4          mxfp4-pack-quantized       ``weight_packed`` u8 [N, K/2], ``weight_scale`` E8M0 (u8) [N, K/32]
mxfp8          mxfp8-quantized            ``weight`` E4M3 [N, K], ``weight_scale`` E8M0 (u8) [N, K/32]
fp8-block      float-quantized            ``weight`` E4M3 [N, K], ``weight_scale`` FP32 [⌈N/128⌉, K/128]
fp8-dynamic    float-quantized            ``weight`` E4M3 [N, K], ``weight_scale`` FP32 [N, 1]
fp8            float-quantized            ``weight`` E4M3 [N, K], ``weight_scale`` FP32 [1], ``input_scale`` FP32 [1]
=============  =========================  ===================================================

An FP8 KV cache (:mod:`quantkit.nn.kv_cache`) adds ``kv_cache_scheme`` (8-bit float, per tensor,
static, symmetric: llm-compressor's and the one vLLM reads) and per attention module FP32
``self_attn.k_scale`` and ``self_attn.v_scale`` (shape ``[]``).

The global scales are stored in compressed-tensors' reciprocal convention (see
:func:`quantkit.export.layout.reciprocal`). FP8 scales are written in FP32 (llm-compressor writes
the model dtype; vLLM reads both into FP32 parameters).
"""
from __future__ import annotations

import re
from collections import Counter
from math import ceil

import torch
from torch import nn

from quantkit.export.io import CheckpointError
from quantkit.export.layout import FLOAT_SCALES, STORED_AS, Scheme, TensorSpec, main_format, tag_format, tagged_format

NAME = "compressed-tensors"
KV_SCALE_NAMES = ("k_scale", "v_scale")  # under the attention module
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
                   "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
VERSION = "0.20.1"  # the compressed-tensors release whose config layout this mirrors

_E4M3 = torch.float8_e4m3fn


def _args(bits: int, strategy: str, *, group_size: int | None = None, dynamic: bool | str = False,
          scale_dtype: str | None = None, observer: str | None = None, block: list[int] | None = None) -> dict:
    """A ``QuantizationArgs`` dict as compressed-tensors serializes it (unset optional fields omitted)."""
    args = {"num_bits": bits, "type": "float", "symmetric": True, "group_size": group_size,
            "strategy": strategy, "dynamic": dynamic}
    if block is not None:
        args["block_structure"] = block
    if scale_dtype is not None:
        args["scale_dtype"] = scale_dtype
    if observer is not None:
        args["observer"] = observer
    return args


_NVFP4_WEIGHTS = _args(4, "tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn")
_MX = {bits: _args(bits, "group", group_size=32, scale_dtype="torch.uint8") for bits in (4, 8)}

# quantkit format -> (compressed-tensors preset name, compression format, weights, input_activations)
SCHEMES: dict[str, tuple[str, str, dict, dict | None]] = {
    "nvfp4": ("NVFP4", "nvfp4-pack-quantized", _NVFP4_WEIGHTS,
              _args(4, "tensor_group", group_size=16, dynamic="local", scale_dtype="torch.float8_e4m3fn",
                    observer="static_minmax")),
    "nvfp4-w4a16": ("NVFP4A16", "nvfp4-pack-quantized", _NVFP4_WEIGHTS, None),
    "mxfp4": ("MXFP4", "mxfp4-pack-quantized", _MX[4], {**_MX[4], "dynamic": True}),
    "mxfp8": ("MXFP8", "mxfp8-quantized", _MX[8], {**_MX[8], "dynamic": True}),
    "fp8-block": ("FP8_BLOCK", "float-quantized", _args(8, "block", block=[128, 128]),
                  _args(8, "group", group_size=128, dynamic=True)),
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized", _args(8, "channel"), _args(8, "token", dynamic=True)),
    "fp8": ("FP8", "float-quantized", _args(8, "tensor"), _args(8, "tensor", observer="static_minmax")),
}
SCHEMES.update({fmt: SCHEMES[stored] for fmt, stored in STORED_AS.items()})


def _nvfp4_specs(static_input: bool) -> tuple[TensorSpec, ...]:
    specs = (TensorSpec("weight_packed", "weight", torch.uint8, lambda n, k: (n, k // 2)),
             TensorSpec("weight_scale", "weight_scale", _E4M3, lambda n, k: (n, k // 16)),
             TensorSpec("weight_global_scale", "weight_tensor_scale", torch.float32, lambda n, k: (1,), reciprocal=True))
    if static_input:
        specs += (TensorSpec("input_global_scale", "input_scale", torch.float32, lambda n, k: (1,), reciprocal=True),)
    return specs


def _fp8_specs(scale_shape, static_input: bool = False) -> tuple[TensorSpec, ...]:
    specs = (TensorSpec("weight", "weight", _E4M3, lambda n, k: (n, k)),
             TensorSpec("weight_scale", "weight_scale", torch.float32, scale_shape, accept=FLOAT_SCALES))
    if static_input:
        specs += (TensorSpec("input_scale", "input_scale", torch.float32, lambda n, k: (1,), accept=FLOAT_SCALES),)
    return specs


_SPECS: dict[str, tuple[TensorSpec, ...]] = {
    "nvfp4": _nvfp4_specs(static_input=True),
    "nvfp4-w4a16": _nvfp4_specs(static_input=False),
    "mxfp4": (TensorSpec("weight_packed", "weight", torch.uint8, lambda n, k: (n, k // 2)),
              TensorSpec("weight_scale", "weight_scale", torch.uint8, lambda n, k: (n, k // 32))),
    "mxfp8": (TensorSpec("weight", "weight", _E4M3, lambda n, k: (n, k)),
              TensorSpec("weight_scale", "weight_scale", torch.uint8, lambda n, k: (n, k // 32))),
    "fp8-block": _fp8_specs(lambda n, k: (ceil(n / 128), k // 128)),
    "fp8-dynamic": _fp8_specs(lambda n, k: (n, 1)),
    "fp8": _fp8_specs(lambda n, k: (1,), static_input=True),
}
_SPECS.update({fmt: _SPECS[stored] for fmt, stored in STORED_AS.items()})


def tensor_specs(fmt: str) -> tuple[TensorSpec, ...]:
    """The on-disk tensors of one Linear in quantkit format ``fmt`` (every quantkit format has one)."""
    return _SPECS[fmt]


def _group(fmt: str, targets: list[str], mixed: bool) -> dict:
    _, compression, weights, inputs = SCHEMES[fmt]
    group = {"targets": targets, "weights": weights, "input_activations": inputs,
             "output_activations": None, "format": compression}
    return tag_format(group, fmt) if mixed else group


def quantization_config(formats: dict[str, str], ignore: list[str], kv_cache: str | None = None) -> dict:
    """The ``quantization_config`` entry of config.json for the quantized Linear layers ``formats``
    (checkpoint name -> quantkit format), the skipped Linear names ``ignore`` and ``kv_cache``
    (``"fp8"`` or ``None``). A format stored as another (see
    :data:`~quantkit.export.layout.STORED_AS`) adds ``quantkit_format``: at the top level, and in
    its group when the model mixes formats."""
    main = main_format(formats)
    count = Counter(formats.values())
    others = sorted(set(count) - {main}, key=lambda f: (-count[f], f))  # most used first
    groups = {"group_0": _group(main, ["Linear"], bool(others))}
    for i, fmt in enumerate(others, 1):
        groups[f"group_{i}"] = _group(fmt, sorted(n for n, f in formats.items() if f == fmt), True)
    return tag_format({"config_groups": groups, "format": "mixed-precision" if others else SCHEMES[main][1],
                       "global_compression_ratio": None, "ignore": list(ignore),
                       "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv_cache else None, "moe_sparsity_config": None,
                       "quant_method": "compressed-tensors", "quantization_status": "compressed",
                       "sparsity_config": {}, "transform_config": {}, "version": VERSION}, main)


def sidecar_files(formats: dict[str, str], ignore: list[str], kv_cache: str | None = None) -> dict[str, dict]:
    """Extra JSON files this flavour writes next to config.json (none)."""
    return {}


_SIGNATURE_KEYS = ("num_bits", "type", "strategy", "group_size", "block_structure", "symmetric", "dynamic")


def _signature(args: dict | None) -> tuple | None:
    if args is None:
        return None
    if not isinstance(args, dict):
        raise CheckpointError(f"quantization args must be objects, got {args!r}")
    defaults = {"type": "int", "symmetric": True, "group_size": None, "block_structure": None, "dynamic": False}
    return tuple(str(args.get(key, defaults.get(key))).lower() for key in _SIGNATURE_KEYS)


_STORED = {fmt: scheme for fmt, scheme in SCHEMES.items() if fmt not in STORED_AS}
_BY_SIGNATURE = {(_signature(w), _signature(a)): fmt for fmt, (_, _, w, a) in _STORED.items()}
_BY_PRESET = {preset: fmt for fmt, (preset, *_rest) in _STORED.items()}
_READABLE = {"float-quantized": "naive-quantized"}  # same tensors under another compression name


def _names(name: str, pattern: str) -> bool:
    """compressed-tensors' name rule: ``re:`` regex match or the exact module name."""
    return re.match(pattern[3:], name) is not None if pattern.startswith("re:") else pattern == name


def _matches(name: str, module: nn.Module, pattern: str) -> bool:
    """compressed-tensors' rule: :func:`_names`, or a class name in the MRO."""
    return _names(name, pattern) or any(cls.__name__ == pattern for cls in type(module).__mro__)


def read_config(qcfg: dict) -> Scheme:
    """The :class:`Scheme` of a compressed-tensors ``quantization_config``.

    A layer takes the format of the group that targets it by name, else of one that targets its
    class (vLLM's order). Raises :class:`CheckpointError` for configs no quantkit format matches
    (other bit widths, dense/fake-quant storage)."""
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config has no config_groups")
    by_format: dict[str, list[str]] = {}
    for group_name, group in groups.items():
        if isinstance(group, list):  # {"NVFP4": ["Linear"]}: a preset name and its targets
            fmt = _BY_PRESET.get(group_name.upper())
            group = {"targets": group, "format": SCHEMES[fmt][1] if fmt else None}
        elif isinstance(group, dict):
            fmt = _BY_SIGNATURE.get((_signature(group.get("weights")), _signature(group.get("input_activations"))))
        else:
            raise CheckpointError(f"quantization_config group {group_name!r} is neither a scheme nor a target list")
        if fmt is None:
            raise CheckpointError(f"quantization_config group {group_name!r} matches no quantkit format "
                                  f"(supported: compressed-tensors presets {', '.join(_BY_PRESET)})")
        compression = group.get("format") or qcfg.get("format")
        if compression not in (SCHEMES[fmt][1], _READABLE.get(SCHEMES[fmt][1])):
            raise CheckpointError(f"quantization_config group {group_name!r}: {fmt} weights stored as "
                                  f"{compression!r} cannot be read; expected {SCHEMES[fmt][1]!r}")
        fmt = tagged_format(group if "quantkit_format" in group else qcfg, fmt)
        by_format.setdefault(fmt, []).extend(group.get("targets") or [])
    ignore = list(qcfg.get("ignore") or [])

    def format_of(name: str, module: nn.Module) -> str | None:
        if not isinstance(module, nn.Linear) or any(_matches(name, module, p) for p in ignore):
            return None
        by_name = (f for f, targets in by_format.items() if any(_names(name, t) for t in targets))
        by_class = (f for f, targets in by_format.items() if any(_matches(name, module, t) for t in targets))
        return next(by_name, None) or next(by_class, None)

    return Scheme(tuple(by_format), tuple(ignore), format_of, _kv_cache(qcfg.get("kv_cache_scheme")))


def _kv_cache(scheme: dict | None) -> str | None:
    """``"fp8"`` for the KV-cache scheme quantkit reads (8-bit float, per tensor, static,
    symmetric), ``None`` for none; :class:`CheckpointError` for any other."""
    if scheme is None:
        return None
    wanted = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    given = {"symmetric": True, **scheme} if isinstance(scheme, dict) else {}  # symmetric unless it says not
    if any(given.get(k) != v for k, v in wanted.items()):
        raise CheckpointError(f"kv_cache_scheme {scheme!r} is not one quantkit reads (FP8 E4M3 with one static "
                              "scale per tensor: num_bits 8, type float, strategy tensor, dynamic false)")
    return "fp8"
