"""Throughput of a model: prefill and decode tokens/s, and the time of its own GEMM shapes.

* prefill: one forward of ``[batch, seq]`` random tokens, no KV cache, logits of the last
  position only (what serving computes), tokens/s = batch * seq / time; on CUDA, forwards of at
  most ``prefill_graph_tokens`` tokens replay as captured CUDA graphs (vLLM captures its forwards
  up to 512 tokens by default), the others run from the host;
* decode: after a ``context``-token prefill into a static KV cache, one new token per sequence
  per step (greedy, fed back), tokens/s = batch / time per step; on CUDA each step is a captured
  CUDA graph (falls back to eager, with the reason, where capture fails); with ``compile`` the
  prefill forwards and the steps run through ``torch.compile`` (Inductor fuses the model's
  elementwise ops; the quantized GEMMs stay opaque custom ops), as gpt-fast and vLLM run them;
  with ``fuse`` the q/k/v and gate/up projections of both models run as one GEMM each
  (:func:`quantkit.fuse_projections`), as serving engines run them; grouped-query attention over
  the cache runs without copying it per query head (:func:`quantkit.nn.use_packed_gqa_attention`),
  for both models, as serving engines' GQA kernels run it;
* GEMMs: each linear layer of decoder layer 0 and ``lm_head`` called on ``[M, K]`` bf16 inputs:
  ``nn.Linear`` for bf16, ``QuantLinear`` (activation quantization included) for quantized models;
  on CUDA each call is a captured CUDA graph, so the time is the kernels' (host launch excluded;
  eager calls, host time included, where capture fails).

Times are medians over ``iters`` runs after ``warmup`` runs; CUDA times come from CUDA events,
each run starting with a flushed L2.
:func:`random_init_model` builds a model from a shipped or given HF config with random bf16
weights, directly on the device, so the speed of real architectures is measured with no download.
"""
from __future__ import annotations

import inspect
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    StaticCache,
)

from quantkit.eval.perplexity import model_device
from quantkit.nn.attention import use_packed_gqa_attention
from quantkit.nn.fuse import fuse_projections
from quantkit.nn.swap import quantize_model

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class BenchSettings:
    """What to measure: prefill ``(batch, seq)`` shapes, decode batch sizes after a ``context``-token
    prompt for ``decode_steps`` timed steps, GEMM row counts ``gemm_m``, and warm-up / timed runs."""

    prefill_shapes: tuple[tuple[int, int], ...] = ((1, 512), (1, 2048), (8, 2048), (32, 2048))
    decode_batches: tuple[int, ...] = (1, 8, 32)
    context: int = 512
    decode_steps: int = 64
    gemm_m: tuple[int, ...] = (1, 16, 128, 2048, 8192)
    warmup: int = 3
    iters: int = 10
    cuda_graphs: bool = True
    compile: str | Callable | None = None  # a torch.compile backend ("inductor", or a backend function)
    fuse: bool = False  # q/k/v and gate/up as one GEMM each (quantkit.fuse_projections), in place
    flex_attention: bool | None = None  # decode steps attend through FlexAttention; None: when compiled on CUDA
    prefill_graph_tokens: int = 0  # prefill forwards of at most this many tokens replay as CUDA graphs

    def uses_flex(self, device: torch.device | str) -> bool:
        """Whether compiled decode steps on ``device`` attend through FlexAttention: ``flex_attention``
        where set, else whenever the steps are compiled on CUDA, where FlexAttention's decoding
        kernel beat packed SDPA at batch 1, 8 and 32 (Llama-3.1-8B, H100, sessions 39 and 42)."""
        if self.flex_attention is not None:
            return self.flex_attention
        return self.compile is not None and torch.device(device).type == "cuda"


@dataclass(frozen=True)
class PrefillResult:
    """Prefill of ``batch`` sequences of ``seq`` tokens: seconds per forward, tokens/s, whether the
    forward was timed as a CUDA graph replay, and why not where its capture failed."""

    batch: int
    seq: int
    seconds: float
    tokens_per_s: float
    cuda_graph: bool = False
    note: str | None = None


@dataclass(frozen=True)
class DecodeResult:
    """Decode at ``batch`` sequences after a ``context``-token prompt: seconds per step, tokens/s,
    whether steps ran as a CUDA graph, and why not where capture failed."""

    batch: int
    context: int
    seconds_per_step: float
    tokens_per_s: float
    cuda_graph: bool
    note: str | None = None


@dataclass(frozen=True)
class GemmResult:
    """One linear layer (``layer`` names it inside decoder layer 0, or ``lm_head``) on ``[m, k]``
    inputs giving ``[m, n]``: seconds per call and TFLOP/s (``2 m n k`` FLOPs), whether the call
    was timed as a CUDA graph replay."""

    layer: str
    n: int
    k: int
    m: int
    seconds: float
    tflops: float
    cuda_graph: bool = False


@dataclass(frozen=True)
class ModelBench:
    """Everything measured for one model."""

    model: str
    prefill: list[PrefillResult]
    decode: list[DecodeResult]
    gemms: list[GemmResult]


def shipped_configs() -> list[str]:
    """Names of the configs shipped in ``quantkit/eval/configs`` (``llama-3.1-8b``, ...)."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.json"))


def load_config(name_or_path: str) -> PretrainedConfig:
    """The HF config of a shipped name (see :func:`shipped_configs`) or of a ``config.json`` path
    (or a directory holding one)."""
    path = Path(name_or_path)
    if not path.exists():
        path = CONFIG_DIR / f"{name_or_path}.json"
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"no config {name_or_path!r}: give a config.json path or one of {', '.join(shipped_configs())}"
        )
    values = json.loads(path.read_text())
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{path} has no model_type: not a Hugging Face config.json")
    return AutoConfig.for_model(values.pop("model_type"), **values)


def random_init_model(
    config: PretrainedConfig, *, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
    format: str = "bf16",
) -> PreTrainedModel:
    """A causal LM of architecture ``config`` with random weights (seeded), created directly on
    ``device`` in ``dtype``, in eval mode; quantized round-to-nearest to ``format`` unless it is
    ``"bf16"`` (:func:`quantkit.quantize_model`)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if format != "bf16":
        quantize_model(model, format=format)
    return model.eval()


Log = Callable[[str], None]


def _silent(line: str) -> None:
    """The default ``log``: progress lines go nowhere."""


_L2_FLUSH_BYTES = 256 * 2**20  # more than any current GPU's L2 (H200: 60 MB)


def time_call(fn: Callable[[], object], *, warmup: int, iters: int, device: torch.device,
              warm_s: float = 0.0) -> float:
    """Median seconds of one ``fn()`` call over ``iters`` timed calls after ``warmup`` untimed ones
    and, on CUDA, ``warm_s`` seconds of further untimed ones (µs-scale calls: the GPU's clock is
    still low after the host compiled or prepared something). On CUDA each timed call starts with
    a cold L2 (a 256 MiB buffer is zeroed before it), so small quantized weights are not timed from
    cache; host launch overhead is included."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda" and warm_s > 0:
        torch.cuda.synchronize(device)
        start_s = time.perf_counter()
        while time.perf_counter() - start_s < warm_s:
            fn()
            torch.cuda.synchronize(device)
    times: list[float] = []
    if device.type == "cuda":
        flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def _random_tokens(model: PreTrainedModel, batch: int, seq: int) -> torch.Tensor:
    """Uniform random token ids [batch, seq] (int64) on the model's device."""
    return torch.randint(0, model.config.get_text_config().vocab_size, (batch, seq), device=model_device(model))


@torch.inference_mode()
def bench_prefill(model: PreTrainedModel, settings: BenchSettings, log: Log = _silent) -> list[PrefillResult]:
    """Prefill throughput at each of ``settings.prefill_shapes`` (through ``torch.compile`` with
    ``settings.compile``: one compiled model for all shapes, recompiled once with dynamic shapes;
    as CUDA graph replays up to ``settings.prefill_graph_tokens`` tokens); ``log`` gets one line
    per measurement."""
    device = model_device(model)
    if settings.compile:
        torch.compiler.reset()  # each model compiles afresh: models of other formats fail the guards
    forward = torch.compile(model, backend=settings.compile) if settings.compile else model
    results = []
    for batch, seq in settings.prefill_shapes:
        ids = _random_tokens(model, batch, seq)
        call, graph, note = prefill_call(lambda: forward(input_ids=ids, use_cache=False, logits_to_keep=1),
                                         batch * seq, settings, device)
        seconds = time_call(call, warmup=settings.warmup, iters=settings.iters, device=device)
        results.append(PrefillResult(batch, seq, seconds, batch * seq / seconds, graph, note))
        log(f"prefill {batch}x{seq}: {results[-1].tokens_per_s:,.0f} tokens/s" + (" (CUDA graph)" if graph else ""))
    return results


def prefill_call(forward: Callable[[], object], tokens: int, settings: BenchSettings, device: torch.device
                 ) -> tuple[Callable[[], object], bool, str | None]:
    """What :func:`bench_prefill` times for a forward of ``tokens`` tokens: ``(call, graph, note)``,
    the replay of ``forward`` captured as a CUDA graph on CUDA up to ``settings.prefill_graph_tokens``
    tokens, else ``forward`` itself, with the first line of the error where capture failed."""
    if device.type != "cuda" or tokens > settings.prefill_graph_tokens:
        return forward, False, None
    return replay_or(forward, settings.warmup, "host-launched forwards")


def replay_or(call: Callable[[], object], warmup: int, fallback: str) -> tuple[Callable[[], object], bool, str | None]:
    """``(run, graph, note)``: the replay of ``call`` captured as a CUDA graph after ``warmup``
    runs (:func:`capture_graph`), or where capture fails ``call`` itself, with a note naming the
    ``fallback`` and the first line of the error."""
    try:
        return capture_graph(call, warmup).replay, True, None
    except RuntimeError as error:
        return call, False, f"CUDA graph capture failed, {fallback}: {str(error).splitlines()[0][:160]}"


def _cache_kwarg(model: PreTrainedModel) -> str:
    """The name the model's forward gives its KV cache argument (``cache`` from transformers 5.2x,
    ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def capture_graph(step: Callable[[], None], warmup: int) -> torch.cuda.CUDAGraph:
    """``step`` run ``warmup`` times on a side stream, then captured as a CUDA graph (not run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def greedy_decoder(
    model: PreTrainedModel, prompt: torch.Tensor, max_cache_len: int, compile_backend: str | Callable | None = None
) -> tuple[Callable[[], None], torch.Tensor]:
    """Prefill ``prompt`` [B, T] (int64) into a static KV cache of ``max_cache_len`` positions and
    return ``(step, tokens)``: ``tokens`` [B, 1] starts as the greedy token after the prompt, and
    each ``step()`` feeds it and overwrites it in place with the next greedy token. Every tensor
    ``step`` touches stays put, so it can be captured as a CUDA graph (call under
    ``torch.inference_mode()``). ``compile_backend``: run the steps (not the prefill) through
    ``torch.compile`` with this backend, specialized to this batch size (``dynamic=False``, as serving
    engines capture one CUDA graph per batch size): a step compiled for one batch and then called
    with another would be recompiled with a symbolic batch, and Inductor lowers FlexAttention with a
    symbolic batch to its prefill template instead of its split-KV decoding one."""
    cache_arg = {_cache_kwarg(model): StaticCache(config=model.config, max_cache_len=max_cache_len)}
    logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_arg).logits
    tokens = logits[:, -1].argmax(-1, keepdim=True)

    def forward() -> torch.Tensor:
        logits = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **cache_arg).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    run = torch.compile(forward, backend=compile_backend, dynamic=False) if compile_backend else forward

    def step() -> None:
        tokens.copy_(run())

    return step, tokens


@torch.inference_mode()
def bench_decode(model: PreTrainedModel, settings: BenchSettings, log: Log = _silent) -> list[DecodeResult]:
    """Decode throughput at each of ``settings.decode_batches``; ``log`` gets one line per measurement."""
    device = model_device(model)
    results = []
    for batch in settings.decode_batches:
        if settings.compile:  # one static graph per batch size, none left over to count
            torch.compiler.reset()  # against dynamo's recompile limit (8), past which steps run eager
        max_len = settings.context + 2 * settings.warmup + settings.decode_steps + 1  # capture may fail after its warm-up
        step, _ = greedy_decoder(model, _random_tokens(model, batch, settings.context), max_len, settings.compile)
        run, graph, note = step, False, None
        if device.type == "cuda" and settings.cuda_graphs:
            # warm-up steps run inside capture_graph; a captured step advances the cache on replay only
            run, graph, note = replay_or(step, settings.warmup, "eager steps")
        if not graph:
            for _ in range(settings.warmup):
                step()
        steps = settings.decode_steps
        seconds = time_call(lambda: [run() for _ in range(steps)], warmup=0, iters=1, device=device) / steps
        results.append(DecodeResult(batch, settings.context, seconds, batch / seconds, graph, note))
        log(f"decode batch {batch}: {results[-1].tokens_per_s:,.1f} tokens/s")
    return results


def layer0_linears(model: PreTrainedModel) -> dict[str, torch.nn.Module]:
    """The linear layers (any leaf module with ``in_features`` and ``out_features``) of decoder
    layer 0 and ``lm_head``, by name relative to the layer (``self_attn.q_proj``, ..., ``lm_head``)."""
    linears: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
            continue
        if ".layers.0." in name:
            linears[name.split(".layers.0.", 1)[1]] = module
        elif name.split(".")[-1] == "lm_head":
            linears["lm_head"] = module
    return linears


@torch.inference_mode()
def bench_gemms(model: PreTrainedModel, settings: BenchSettings, log: Log = _silent) -> list[GemmResult]:
    """Time each of :func:`layer0_linears` on ``[M, K]`` bf16 inputs for M in ``settings.gemm_m``
    (CUDA-graph replays on CUDA with ``settings.cuda_graphs``, else eager calls); ``log`` gets one
    line per layer."""
    device = model_device(model)
    results = []
    for name, module in layer0_linears(model).items():
        n, k = module.out_features, module.in_features
        for m in settings.gemm_m:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            call, graph = (lambda: module(x)), False
            if device.type == "cuda" and settings.cuda_graphs:  # replays time the kernels, not the host's launch path
                call, graph, _ = replay_or(call, settings.warmup, "eager calls")
            seconds = time_call(call, warmup=settings.warmup, iters=settings.iters, device=device, warm_s=0.05)
            results.append(GemmResult(name, n, k, m, seconds, 2 * m * n * k / seconds / 1e12, graph))
        log(f"GEMMs of {name} ({n}x{k}) timed")
    return results


def bench_model(model: PreTrainedModel, name: str, settings: BenchSettings, log: Log = _silent) -> ModelBench:
    """Prefill, decode and GEMM measurements of ``model``, reported under ``name``, after
    :func:`quantkit.nn.use_packed_gqa_attention` (FlexAttention's decoding kernel where
    ``settings.uses_flex``; and with ``settings.fuse`` :func:`quantkit.fuse_projections`), both
    in place; ``log`` gets a line per measurement as it finishes."""
    use_packed_gqa_attention(model, flex=settings.uses_flex(model_device(model)))
    if settings.fuse:
        fuse_projections(model)
    return ModelBench(
        model=name,
        prefill=bench_prefill(model, settings, log),
        decode=bench_decode(model, settings, log),
        gemms=bench_gemms(model, settings, log),
    )
