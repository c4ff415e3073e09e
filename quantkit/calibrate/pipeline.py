"""Sequential (layer-by-layer) calibration.

1. One cheap pass records, for every decoder layer, the keyword arguments the model gives it
   (masks, rotary embeddings: they differ between layer types) and the hidden states entering
   the first layer it calls. Layers are replaced by identities for that pass, so no layer runs. A
   layer the model does not call on the calibration data (Mllama's cross-attention layers on text)
   passes the hidden states on unchanged, as in the model, and its Linears stay unquantized:
   nothing calibrates them.
2. For each decoder layer in turn: move it to the device, run the calibration hidden states
   through it with observers on its Linear inputs, run the recipe's algorithms, swap its Linears
   for QuantLinears, compute its outputs (the next layer's inputs), and move it back. With an FP8
   KV cache (``Recipe.kv_cache``) the first run also records each attention module's largest key
   and value; the cache becomes FP8 once every layer is calibrated (the weights are calibrated
   with the cache in the model dtype, as ModelOpt and llm-compressor do: on Gemma-3-270M, turning
   it on per layer during calibration gave 1.0–1.7 % higher perplexity, docs/accuracy.md).

MoE blocks: fused experts are first split into per-expert Linears
(:func:`quantkit.nn.experts.linearize_experts`), and while a layer is calibrated every expert runs
on every calibration token (its observers see them all, even for an expert the router never
picks), while the block output keeps the router's top-k combination. The gate/up projections of
all experts of a block then see one input, recorded once (one Hessian per block, not 2·E).

Only one decoder layer and the hidden states are on the device at a time; hidden states go to
the offload device too when they do not fit ``max_device_bytes`` beside a layer. An algorithm that
``needs_float_targets`` (AutoRound with ``target="model"``) gets a second set: the float model's
hidden states, advanced through each float layer before it is quantized.

Under ``torch.distributed`` (``torchrun``, one rank per GPU) each rank runs its shard of the
calibration batches and the statistics are reduced over the ranks before each layer's algorithms
run (:mod:`quantkit.calibrate.distributed`), so every rank quantizes the model identically.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibrate.algorithms import LayerContext, build
from quantkit.calibrate.distributed import all_reduce_, all_reduce_sum, rank_device, shard
from quantkit.calibrate.observers import InputObserver
from quantkit.calibrate.recipe import Recipe
from quantkit.formats import get_format
from quantkit.nn.experts import calibrating_all_experts, linearize_experts, shared_input_groups
from quantkit.nn.kv_cache import attention_modules, enable_kv_cache, observe, scales_from_amax
from quantkit.nn.swap import (LayerResult, QuantizationReport, assign_formats, check_finite, fused_groups, plan_layers,
                              quantize_model, shared_weight_amax)


class CalibrationError(RuntimeError):
    """Calibration could not run as asked (model structure, memory budget)."""


@dataclass
class CalibrationInfo:
    """How a calibration run used memory: ``block_bytes`` (largest decoder layer), ``state_bytes``
    (hidden states), ``offloaded`` (hidden states kept on the offload device)."""

    layers: int
    block_bytes: int
    state_bytes: int
    offloaded: bool


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` holding the decoder layers: the longest list of Linear-bearing blocks
    not nested in another such list (MoE experts are lists inside the decoder layers), inside the
    language model where the model names it (``get_decoder()``: a vision tower may have more blocks)."""
    decoder = _decoder_name(model)
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) and name.startswith(decoder)
             and all(any(isinstance(m, nn.Linear) for m in block.modules()) for block in module)]
    outer = [(name, module) for name, module in lists
             if not any(name.startswith(f"{other}.") for other, _ in lists if other != name)]
    if not outer:
        raise CalibrationError("found no list of decoder layers (nn.ModuleList of blocks with Linear layers) in the model")
    return max(outer, key=lambda item: len(item[1]))


def _decoder_name(model: nn.Module) -> str:
    """``"NAME."`` of the module ``model.get_decoder()`` returns (the language model of a
    multimodal model), ``""`` (all of ``model``) where there is none or it is ``model`` itself."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return ""
    return next((f"{name}." for name, m in model.named_modules() if m is decoder and name), "")


def observed_inputs(layer: nn.Module, scope: str, names: list[str]) -> dict[str, str]:
    """For each Linear ``names`` (full names; ``scope`` + name in ``layer``), the Linear whose input
    observer records its input: itself, or the first of its group of MoE expert projections that
    share one input while all experts run (:func:`quantkit.nn.experts.shared_input_groups`)."""
    head = {}
    for group in shared_input_groups(layer):
        members = [scope + n for n in group if scope + n in names]
        head.update({n: members[0] for n in members})
    return {n: head.get(n, n) for n in names}


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _move_outside(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    inside = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) not in inside:
            module._apply(lambda t: t.to(device), recurse=False)


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _LastLayerReached(Exception):
    """Raised by the last layer's recorder: what follows the layers (final norm, LM head) need not run."""


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, layers: nn.ModuleList, batches: list[torch.Tensor]):
    """Run ``model`` with every layer replaced by an identity, up to the last layer; return, per
    batch, the hidden states entering the first layer it calls and, by layer index, the other
    arguments each layer it calls was called with: ``(positional, keyword)`` (Gemma 3n and 4 pass
    their per-layer inputs positionally)."""
    records: list[tuple[torch.Tensor, dict[int, dict]]] = []

    def recorder(i: int) -> Callable:
        def forward(hidden_states, *args, **kwargs):
            if not records[-1][1]:
                records[-1] = (hidden_states, {})
            records[-1][1][i] = (args, kwargs)
            if i == len(layers) - 1:
                raise _LastLayerReached
            return hidden_states
        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        for ids in batches:
            records.append((None, {}))
            try:
                model(input_ids=ids, use_cache=False)
            except _LastLayerReached:
                pass
    finally:
        for layer in layers:
            del layer.forward
    return records


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _check_token_ids(model: nn.Module, ids: torch.Tensor) -> None:
    """Raise :class:`CalibrationError` unless ``ids`` is an integer ``[num_samples, seq_len]`` tensor
    of token ids the model's input embedding holds."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise CalibrationError(f"calibration data must be token ids, an int64 [num_samples, seq_len] tensor "
                               f"(quantkit.calibrate.data.token_samples); got {getattr(ids, 'dtype', '')} {shape}")
    try:
        vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):  # not a Hugging Face model, or one without the hook
        vocab = None
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise CalibrationError(f"calibration token ids span [{int(ids.min())}, {int(ids.max())}], outside the model's "
                               f"vocabulary [0, {vocab}): tokenized with another model's tokenizer?")


@torch.no_grad()  # without it each layer's outputs would keep every earlier layer's activations alive
def quantize(model: nn.Module, recipe: Recipe | str = "nvfp4", calib_data: torch.Tensor | None = None, *,
             device: str | torch.device | None = None, batch_size: int = 8, max_device_bytes: int | None = None,
             offload_device: str | torch.device = "cpu",
             progress: Callable[[int, int], None] | None = None) -> QuantizationReport:
    """Calibrate ``model`` on ``calib_data`` (``int64 [num_samples, seq_len]`` token ids, see
    :func:`quantkit.calibrate.data.token_samples`) and swap its Linear layers for QuantLinears.

    Formats with only dynamic activations and RTN-only recipes need no data (``calib_data`` may be
    ``None``). ``device``: where each layer is calibrated (default: CUDA if present, else CPU; under
    ``torch.distributed``: ``cuda:{LOCAL_RANK}``). Under ``torch.distributed`` each rank calibrates
    on its shard of the ``batch_size`` batches (see :func:`quantkit.calibrate.distributed.shard`)
    and all ranks end with the same quantized model. ``max_device_bytes``: the memory one layer plus
    this rank's hidden states may take there.
    ``progress(done, total)`` is called after each layer. Returns the :class:`QuantizationReport`
    (with ``.calibration``: :class:`CalibrationInfo` when data was used)."""
    recipe = recipe if isinstance(recipe, Recipe) else Recipe(recipe)
    fmt = get_format(recipe.format)
    algos = build(list(recipe.algorithms), recipe.options)
    if not recipe.needs_data:
        return quantize_model(model, fmt.name, recipe.ignore, layer_formats=recipe.layer_formats)
    if calib_data is None:
        raise CalibrationError(f"recipe {recipe.format} with {'+'.join(a.name for a in algos)} needs calibration data")
    _check_token_ids(model, calib_data)
    check_finite(model)
    device = torch.device(device) if device else rank_device()
    linearize_experts(model)
    prefix, layers = find_decoder_layers(model)
    planned, skipped = plan_layers(model, fmt.name, recipe.ignore, recipe.layer_formats)
    formats = assign_formats(planned, fmt.name, recipe.layer_formats)

    _move_outside(model, layers, device)
    try:
        batches = [b.to(device) for b in shard(calib_data.split(batch_size))]
    except ValueError as err:
        raise CalibrationError(str(err)) from None
    records = capture_layer_inputs(model, layers, batches)
    if any(h is None for h, _ in records):
        raise CalibrationError("the model called none of its decoder layers on a calibration batch")
    block_bytes = max(_nbytes(layer) for layer in layers)
    float_targets = recipe.propagate == "quantized" and any(a.needs_float_targets for a in algos)
    state_bytes = (3 if float_targets else 2) * sum(h.numel() * h.element_size() for h, _ in records)
    offloaded = max_device_bytes is not None and block_bytes + state_bytes > max_device_bytes
    if offloaded:
        batch_bytes = max(h.numel() * h.element_size() for h, _ in records) * 2
        if block_bytes + batch_bytes > max_device_bytes:
            raise CalibrationError(f"one decoder layer ({block_bytes} bytes) and one batch of hidden states ({batch_bytes} "
                                   f"bytes) do not fit max_device_bytes={max_device_bytes}: lower --batch-size or raise the budget")
    state_device = torch.device(offload_device) if offloaded else device
    hidden = [h.to(state_device) for h, _ in records]
    float_hidden = list(hidden) if float_targets else None  # the float model's trajectory

    report = QuantizationReport(fmt.name, list(skipped))
    needs_hessian = any(a.needs_hessian for a in algos)
    kv_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # batches each layer ran on, over all ranks (so that every rank skips the same layers)
    calls = all_reduce_(torch.tensor([sum(i in kw for _, kw in records) for i in range(len(layers))]))
    total = int(all_reduce_sum(float(len(records))))
    for i, layer in enumerate(layers):
        scope = f"{prefix}.{i}."
        linears = {n: m for n, m in planned.items() if n.startswith(scope)}
        called = int(calls[i])
        if called < total:
            if called:
                raise CalibrationError(f"decoder layer {i} ran on {called} of {total} calibration batches: "
                                       "its inputs cannot be calibrated layer by layer")
            report.layers.extend(LayerResult(n, tuple(m.weight.shape), "its decoder layer does not run on the "
                                             "calibration data") for n, m in linears.items())
            if progress:
                progress(i + 1, len(layers))
            continue
        layer.to(device)

        def run_block(batches: list[int] | None = None, layer=layer, i=i, states=None) -> list[torch.Tensor]:
            states = hidden if states is None else states
            outs = []
            for b in range(len(states)) if batches is None else batches:
                args, kwargs = _to(records[b][1][i], device)
                outs.append(_hidden(layer(states[b].to(device), *args, **kwargs)).to(state_device))
            return outs

        with calibrating_all_experts(layer):
            targets = run_block(states=float_hidden) if float_hidden is not None else None
            observed = observed_inputs(layer, scope, list(linears))
            observers = {h: InputObserver(linears[h], hessian=needs_hessian) for h in dict.fromkeys(observed.values())}
            attentions = attention_modules(layer) if recipe.kv_cache else {}
            with observe(model, attentions) as kv_amax:
                float_out = run_block()
            stats = {h: o.finish() for h, o in observers.items()}
            if set(kv_amax) != set(attentions):
                raise CalibrationError(f"attention modules {sorted(set(attentions) - set(kv_amax))} of layer {i} "
                                       "never ran their attention function: no FP8 KV-cache scale for them")
            kv_cache.update({scope + n: scales_from_amax(kv_amax[n]) for n in attentions})
            ctx = LayerContext({n: get_format(formats[n]) for n in linears}, layer, linears, {n: stats[h] for n, h in observed.items()},
                               fused_groups(linears), shared_weight_amax(linears), run_block, targets)
            for algo in algos:
                algo.apply(ctx)
        input_scales = ctx.input_scales()
        rel = {n[len(scope):]: n for n in linears}
        ignore = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and scope + n not in linears]
        part = quantize_model(layer, fmt.name, ignore, layer_formats={r: formats[n] for r, n in rel.items()},
                              qweights={r: ctx.qweights[n] for r, n in rel.items()},
                              input_scales={r: input_scales[n] for r, n in rel.items() if n in input_scales})
        for res in part.quantized:
            res.name = rel[res.name]
            report.layers.append(res)
        hidden = run_block() if recipe.propagate == "quantized" else float_out
        float_hidden = targets
        layer.to(offload_device)
        if progress:
            progress(i + 1, len(layers))

    if kv_cache:
        enable_kv_cache(model, kv_cache)
    rest = {n for n in planned if not n.startswith(prefix + ".")}
    static = {n for n in rest if get_format(formats[n]).static_activation}
    report.layers.extend(LayerResult(n, tuple(planned[n].weight.shape), "outside the decoder layers: no calibrated "
                                     f"activation scale, which {formats[n]} needs") for n in sorted(static))
    rest -= static
    if rest:  # Linear layers outside the decoder blocks: round to nearest, no activation statistics
        outside = quantize_model(model, fmt.name, [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in rest],
                                 layer_formats=recipe.layer_formats)
        report.layers.extend(outside.quantized)
    _move_outside(model, layers, torch.device(offload_device))
    report.calibration = CalibrationInfo(len(layers), block_bytes, state_bytes, offloaded)
    return report
