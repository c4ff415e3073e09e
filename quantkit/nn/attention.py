"""Decode attention for grouped-query models without repeating the KV cache.

transformers' ``sdpa`` attention repeats each key/value head for its ``G`` query heads
(``repeat_kv``) whenever a mask is given (transformers 5.2x skips that for one query token, but
not under ``torch.compile``), which is how a compiled decode step over a static cache runs: every
step copies the whole cache ``G`` times and attends over the copy. At 32 sequences of 512 tokens
on Llama-3.1-8B the copies and the attention over them take 70 % of an NVFP4 step's kernel time
(H100, ``benchmarks/NOTES.md``, session 35). :func:`packed_gqa_sdpa` computes the same attention for a
single query token by folding the ``G`` query heads of a key/value head into the query-length axis
(``[B, H, 1, D]`` -> ``[B, H_kv, G, D]``), so SDPA reads each cached key once, as serving engines'
GQA kernels do. Prefill (more than one query token) and features SDPA cannot take go to
transformers' ``sdpa`` unchanged.

With ``flex=True`` a compiled decode step attends through FlexAttention instead: the model's mask
for one query token becomes a ``BlockMask``, and FlexAttention's split-KV decoding kernel skips the
cache blocks no query may see (a static cache's unfilled tail). The ``BlockMask`` is built once per
forward from ``sdpa``'s mask, eagerly: a graph break, invisible under CUDA-graph replay (Inductor on
torch 2.11 failed to compile the decoding template for an H100 with the mask built inside the same
graph). Per layer on Llama-3.1-8B heads at 512 of 640 cache positions: 19.6 / 19.0 / 37.5 µs
against packed SDPA's 27.8 / 28.9 / 53.7 at batch 1 / 8 / 32 (H100, ``benchmarks/decode_attention.py``,
session 37); whole compiled decode steps ran 2-5 % faster than with packed SDPA at batch 1, 8 and
32 (session 42), so ``quantkit bench`` attends this way when it compiles on CUDA. Inductor takes
that decoding template only for a static batch: a step compiled with a symbolic batch runs
FlexAttention's prefill template, slower than packed SDPA at batch 8 and 32 (docs/evaluation.md).
Eager steps and prefill keep the SDPA paths (FlexAttention runs only compiled).
"""
from __future__ import annotations

import torch
from torch import nn

from quantkit.nn.kv_cache import FP8_KV_PREFIX, register_fp8_kv

PACKED_GQA_SDPA = "quantkit_packed_gqa_sdpa"
PACKED_GQA_FLEX = "quantkit_packed_gqa_flex"


def packed_gqa_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, T, D]``, ``key``/``value``
    ``[B, H_kv, S, D]`` (``H = G·H_kv``, query head ``h`` reads key head ``h // G``),
    ``attention_mask`` boolean or additive ``[B|1, 1|H, T, S]`` or ``None``; returns ``([B, T, H, D],
    None)``, softmax(``q·kᵀ·scaling`` + mask)·v. At ``T = 1`` with one mask for all heads, each
    key/value head is attended by its ``G`` query heads at once, without copying the keys and
    values; otherwise transformers' ``sdpa`` computes it. Over a FlexAttention ``BlockMask``
    (:func:`decode_block_mask`; only models that ``sdpa`` serves get one, so no softcap) FlexAttention
    computes it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):  # decode_block_mask's BlockMask
        from torch.nn.attention import flex_attention

        out = flex_attention.flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    special = any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))
    if q_len != 1 or groups == 1 or per_head_mask or special or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    query = query.reshape(batch, heads // groups, groups, dim)  # [B, H_kv, G, D]: the mask broadcasts over G
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def decode_block_mask(**kwargs):
    """transformers' mask-interface signature (keyword arguments as ``create_causal_mask`` passes
    them): ``sdpa_mask``'s mask (boolean ``[B, 1, T, S]`` or ``None``), and inside ``torch.compile``
    for one query token the same mask as a FlexAttention ``BlockMask`` (:func:`_block_mask`)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**kwargs)
    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
    if mask is None or q_length != 1 or not torch.compiler.is_compiling():
        return mask
    allowed = (mask if mask.dtype == torch.bool else mask == 0)[:, 0, 0]
    return _block_mask(allowed.expand(kwargs["batch_size"], mask.shape[-1]))


@torch.compiler.disable
def _block_mask(allowed: torch.Tensor):
    """The FlexAttention ``BlockMask`` of one query token over ``allowed`` (boolean ``[B, S]``, True
    = attend), built eagerly (outside any compiled graph). Its ``mask_mod`` reads a copy of
    ``allowed``, this step's mask: the cache advances the offsets the mask came from in place before
    the attention runs."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = allowed.contiguous()
    batch, length = allowed.shape
    return create_block_mask(lambda b, h, q, kv: allowed[b, kv], batch, None, 1, length, device=allowed.device)


def _register() -> None:
    """Register :func:`packed_gqa_sdpa` with ``sdpa``'s mask, and with :func:`decode_block_mask`
    (the ``flex`` variant), with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
    AttentionMaskInterface.register(PACKED_GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    AttentionInterface.register(PACKED_GQA_FLEX, packed_gqa_sdpa)
    AttentionMaskInterface.register(PACKED_GQA_FLEX, decode_block_mask)


def use_packed_gqa_attention(model: nn.Module, flex: bool = False) -> bool:
    """Switch a transformers ``model`` whose attention runs as ``sdpa`` (also inside quantkit's FP8
    KV-cache wrapper) to :func:`packed_gqa_sdpa`, in place; the model computes the same function.
    With ``flex`` (compile the step for a static batch, docs/evaluation.md), compiled
    single-token steps attend through FlexAttention over a ``BlockMask`` (module docstring). Returns
    whether it switched (``False`` for other implementations: eager, flash, flex)."""
    current = getattr(model.config, "_attn_implementation", None)
    if current not in ("sdpa", FP8_KV_PREFIX + "sdpa"):
        return False
    _register()
    name = PACKED_GQA_FLEX if flex else PACKED_GQA_SDPA
    target = name if current == "sdpa" else register_fp8_kv(name)
    model.set_attn_implementation(target)
    return model.config._attn_implementation == target
