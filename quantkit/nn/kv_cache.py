"""FP8 KV cache: one static FP32 scale per attention layer for its keys and one for its values, as
vLLM stores them with ``--kv-cache-dtype fp8``: the cache holds ``e4m3(k / k_scale)`` (saturated
to ±448) and attention reads ``e4m3 · k_scale``.

quantkit computes the same function in the model itself: each attention module gets a
:class:`KVCacheScales` child ``kv_cache`` (FP32 ``k_scale`` and ``v_scale``), and the model's attention implementation (transformers'
``AttentionInterface``: ``sdpa``, ``eager``, ...) is wrapped so that the keys and values it
attends over are quantize-dequantized with them. Keys are taken where the cache stores them: after
the projection, the head norm and RoPE. The round trip is idempotent, so attending over a cache of
such keys equals quantizing each key once when it is written.

Calibration (:func:`observe`) records ``max |k|`` and ``max |v|`` per attention module over the
calibration tokens; the scale is ``amax / 448`` (ModelOpt's and llm-compressor's rule).
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from quantkit.formats.codecs import E4M3_MAX, e4m3_encode
from quantkit.nn.linear import moved_only

KV_CACHE_FORMATS = ("fp8",)
FP8_KV_PREFIX = "quantkit_fp8_kv:"


def kv_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, any float dtype) through an FP8 cache with per-tensor ``scale`` (FP32
    scalar): ``e4m3(x / scale) · scale`` in FP32 (round to nearest even, saturating), cast back to
    ``x.dtype``."""
    return (e4m3_encode(x.float() / scale).float() * scale).to(x.dtype)


class KVCacheScales(nn.Module):
    """The FP8 KV-cache scales of one attention module: FP32 scalar buffers ``k_scale`` and
    ``v_scale``. They stay FP32 under ``model.to(dtype)`` (device moves apply)."""

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor):
        super().__init__()
        self.register_buffer("k_scale", k_scale.float().reshape(()))
        self.register_buffer("v_scale", v_scale.float().reshape(()))

    def _apply(self, fn, recurse=True):
        for name, t in self._buffers.items():
            self._buffers[name] = moved_only(fn, t)
        return self


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The self-attention modules of ``model`` by name: modules with ``k_proj`` and ``v_proj``
    children (quantized or not), as in every transformers decoder."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "k_proj", None), nn.Module) and isinstance(getattr(m, "v_proj", None), nn.Module)}


def _base_attention(base: str):
    """The attention function transformers calls for implementation ``base``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":  # every modeling file defines its own
        return lambda module: sys.modules[type(module).__module__].eager_attention_forward
    function = ALL_ATTENTION_FUNCTIONS[base]
    return lambda module: function


def register_fp8_kv(base: str) -> str:
    """Register (once) the FP8-KV wrapper of attention implementation ``base``, and its mask
    function; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    name = FP8_KV_PREFIX + base
    if name in AttentionInterface._global_mapping:
        return name
    if base != "eager" and base not in AttentionInterface._global_mapping:
        raise ValueError(f"an FP8 KV cache cannot wrap attention implementation {base!r}")
    inner = _base_attention(base)

    def attention(module, query, key, value, attention_mask, **kwargs):
        observer = getattr(module, "_kv_observer", None)
        if observer is not None:
            observer(key, value)
        scales = getattr(module, "kv_cache", None)
        if isinstance(scales, KVCacheScales):
            key, value = kv_qdq(key, scales.k_scale), kv_qdq(value, scales.v_scale)
        return inner(module)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def _device(module: nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    tensor = next(module.buffers(), None) if tensor is None else tensor
    return torch.device("cpu") if tensor is None or tensor.is_meta else tensor.device


def _use_wrapper(model: nn.Module) -> None:
    current = model.config._attn_implementation or "eager"
    if not current.startswith(FP8_KV_PREFIX):
        name = register_fp8_kv(current)
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                             "AttentionInterface, so quantkit cannot give it an FP8 KV cache")


def enable_kv_cache(model: nn.Module, scales: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give the attention modules named in ``scales`` (name -> ``(k_scale, v_scale)``, FP32
    scalars) an FP8 KV cache with those scales. Raises ``ValueError`` for a scale that is not a
    positive finite number."""
    modules = dict(model.named_modules())
    for name, (k, v) in scales.items():
        k, v = (torch.as_tensor(s, dtype=torch.float32).reshape(()) for s in (k, v))
        for kind, s in (("k_scale", k), ("v_scale", v)):
            if not (torch.isfinite(s) and s > 0):
                raise ValueError(f"{name}.{kind} = {s.item()} is not a positive finite FP8 KV-cache scale")
        modules[name].kv_cache = KVCacheScales(k, v).to(_device(modules[name]))
    _use_wrapper(model)


def kv_scales(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The FP8 KV-cache scales of ``model``'s attention modules that have them (name ->
    ``(k_scale, v_scale)``); empty if it has none."""
    return {name: (m.kv_cache.k_scale, m.kv_cache.v_scale) for name, m in attention_modules(model).items()
            if isinstance(getattr(m, "kv_cache", None), KVCacheScales)}


@contextmanager
def observe(model: nn.Module, modules: dict[str, nn.Module]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """While active, every call of the attention modules ``modules`` (name -> module) records the
    largest ``|k|`` and ``|v|`` it attends over; yields name -> ``[k_amax, v_amax]`` (FP32 scalars,
    filled as the modules run). The model's attention implementation is wrapped for good (see
    :func:`enable_kv_cache`) unless ``modules`` is empty; the observers are removed on exit."""
    if modules:
        _use_wrapper(model)
    amax: dict[str, list[torch.Tensor]] = {}

    def observer(name: str):
        def record(key: torch.Tensor, value: torch.Tensor) -> None:
            new = [key.detach().abs().amax().float(), value.detach().abs().amax().float()]
            amax[name] = [torch.maximum(a, b) for a, b in zip(amax[name], new)] if name in amax else new
        return record

    for name, module in modules.items():
        module._kv_observer = observer(name)
    try:
        yield amax
    finally:
        for module in modules.values():
            del module._kv_observer


@torch.no_grad()
def calibrate_kv_cache(model: nn.Module, calib_data: torch.Tensor, batch_size: int = 8) -> None:
    """Give an already quantized (or float) ``model`` an FP8 KV cache: run ``calib_data`` (int64
    token ids ``[samples, seq_len]``, on the model's device) through the whole model and set each
    attention module whose attention runs on it (a vision tower's does not on text) to its largest
    key and value over 448. Unlike ``Recipe(kv_cache="fp8")`` the layers before an attention module
    keep their own cache in the model dtype during this pass, and the whole model must fit the
    device. Under ``torchrun`` (an
    initialized process group) each rank passes the same ``calib_data``, runs its share of the
    batches, and every rank sets the largest values over all of them, as :func:`quantkit.quantize`."""
    # imported here: quantkit.calibrate imports this module
    from quantkit.calibrate.distributed import shard

    modules = attention_modules(model)
    with observe(model, modules) as amax:
        for batch in shard(calib_data.split(batch_size)):
            model(input_ids=batch, use_cache=False)
    ran = [name for name in modules if name in amax]  # not, say, a vision tower's attention on text
    enable_kv_cache(model, {name: scales_from_amax(amax[name]) for name in ran})


def scales_from_amax(amax: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale, v_scale)`` = ``amax / 448``, ``amax`` (``[max |k|, max |v|]``) first reduced to
    its largest over the ranks under ``torch.distributed`` (an all-zero tensor gets scale 1)."""
    # imported here: quantkit.calibrate imports this module
    from quantkit.calibrate.distributed import all_reduce_

    k, v = (all_reduce_(a, "max") for a in amax)
    k, v = (torch.where(a > 0, a / E4M3_MAX, torch.ones_like(a)).cpu() for a in (k, v))
    return k, v
