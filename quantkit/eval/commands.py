"""The ``quantkit eval`` and ``quantkit bench`` commands (registered by :mod:`quantkit.cli`).

Plain functions with typer-annotated parameters; importing this module stays cheap (torch,
lm-eval, transformers and matplotlib load only when a command runs).
"""
from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from quantkit.terminal import check_device, console, fail


def _csv(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated list."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _default_device(device: str | None) -> str:
    import torch

    check_device(device)
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _free(device: str) -> None:
    """Return the memory of models dropped by the caller."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _run_meta(device: str, **settings: Any) -> dict[str, Any]:
    """What a report records about its run: settings, device, library versions, date."""
    import torch

    versions = {}
    for package in ("torch", "transformers", "lm_eval"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu"
    return {
        **{key: value for key, value in settings.items() if value is not None},
        "device": f"{device} ({name})",
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _launch_warning(device: str) -> str | None:
    """On a CUDA ``device`` without apache-tvm-ffi, why prefill will measure slow; else ``None``."""
    from quantkit.kernels.cache import NO_TVM_FFI, tvm_ffi_available

    return NO_TVM_FFI if device.startswith("cuda") and not tvm_ffi_available() else None


def _load_model(source: str, device: str) -> tuple[Any, Any]:
    """``quantkit.models.load_model``; a model that cannot be loaded ends the command with its reason."""
    from quantkit.export import CheckpointError
    from quantkit.models import ModelLoadError, load_model

    try:
        return load_model(source, device=device)
    except (ModelLoadError, CheckpointError) as error:
        fail(str(error))


def _loader(source: str, fmt: str | None, device: str) -> Callable[[], tuple[Any, Any]]:
    """A function returning ``(model, tokenizer)`` of ``source`` on ``device``, quantized in memory
    (RTN) to ``fmt`` when one is given."""

    def load():
        model, tokenizer = _load_model(source, device)
        if fmt is not None:
            import quantkit

            quantkit.quantize_model(model, format=fmt)
        return model, tokenizer

    return load


def _formats(text: str, *, allow_bf16: bool = False) -> list[str]:
    """The comma-separated format names of ``text``, each a known format (or ``bf16`` where
    allowed); an unknown one ends the command with the valid names."""
    from quantkit.formats import get_format

    names = _csv(text)
    for name in names:
        if not (allow_bf16 and name == "bf16"):
            try:
                get_format(name)
            except ValueError as error:
                fail(str(error))
    return names


def _positive(text: str, option: str, what: str = "a positive integer") -> int:
    """``text`` as an int >= 1; otherwise a usage error naming ``option`` (exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise typer.BadParameter(f"expected {what}, got {text!r}", param_hint=option)
    return value


def _limits(text: str | None) -> int | dict[str, int] | None:
    """``--limit``: ``"500"`` -> 500; ``"lambada_openai=500,wikitext=10"`` -> a mapping by task."""
    if text is None or "=" not in text:
        return None if text is None else _positive(text, "--limit", "N or TASK=N,...")
    items = [item.partition("=") for item in _csv(text)]
    return {task.strip(): _positive(n, "--limit", "N or TASK=N,...") for task, _, n in items}


def eval_command(
    target: Annotated[str, typer.Argument(help="Model to evaluate: a quantkit checkpoint dir, an HF dir, a hub id or 'demo'.")],
    baseline: Annotated[Optional[str], typer.Option("--baseline", "-b", help="Model to compare against (same kinds as TARGET). Default: TARGET itself when --format is given, else none.")] = None,
    formats: Annotated[Optional[str], typer.Option("--format", "-f", help="Quantize TARGET in memory (RTN, no calibration) to each of these comma-separated formats, e.g. nvfp4,fp8-block,mxfp8, and evaluate each.")] = None,
    tasks: Annotated[str, typer.Option("--tasks", "-t", help="Comma-separated lm-eval task names, plus 'wikitext2_ppl' (GPTQ-style token perplexity).")] = "lambada_openai,wikitext",
    limit: Annotated[Optional[str], typer.Option(help="Evaluate only the first N documents of each task (windows for wikitext2_ppl): N, or TASK=N,... per task.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per forward pass.")] = 8,
    device: Annotated[Optional[str], typer.Option(help="cuda | cpu (default: cuda if present).")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Directory holding lambada_test.jsonl / wiki.test.raw (any depth): run lambada_openai, wikitext and wikitext2_ppl offline.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for eval.md, eval.json, eval_recovery.png.")] = Path("eval-results"),
    check_kernels: Annotated[bool, typer.Option("--check-kernels", help="Instead of tasks: run a few batches through the GPU kernels and the reference path and report logit error and top-1 agreement.")] = False,
    seq_len: Annotated[int, typer.Option(min=2, help="Window length of wikitext2_ppl, and of --check-kernels batches (capped at 512).")] = 2048,
    max_length: Annotated[Optional[int], typer.Option(help="Context lm-eval gives the model (default: the model config's).")] = None,
) -> None:
    """Accuracy of TARGET (and of a baseline) on lm-eval tasks and WikiText-2 perplexity.

    Runs through the same QuantLinear path users get. Per task metric: value, baseline, delta,
    recovery %, stderr.

    Examples:

      quantkit eval ./llama-nvfp4 --baseline meta-llama/Llama-3.1-8B

      quantkit eval demo --format nvfp4,fp8-block,mxfp8 --data-dir ../shared/data --limit lambada_openai=500,wikitext=10

      quantkit eval ./llama-nvfp4 --check-kernels
    """
    from quantkit.eval.perplexity import PERPLEXITY_TASK, perplexity_scores
    from quantkit.eval.report import write_eval_report

    device = _default_device(device)
    fmts = _formats(formats) if formats else []
    candidates = [(fmt, _loader(target, fmt, device)) for fmt in fmts] or [(target, _loader(target, None, device))]
    meta = _run_meta(device, target=target, formats=formats, tasks=None if check_kernels else tasks, limit=limit,
                     batch_size=batch_size, data_dir=str(data_dir) if data_dir else None, max_length=max_length)
    started = time.perf_counter()
    if check_kernels:
        from quantkit.eval.kernel_check import check_batches, check_kernels as run_check

        if not device.startswith("cuda"):
            console.print("note: off CUDA, QuantLinear runs the reference path both times (no GPU kernel), so the "
                          "error is 0 by construction", highlight=False)

        checks = []
        for name, load in candidates:
            with console.status(f"kernel check: {name}"):
                model, tokenizer = load()
                batches = check_batches(tokenizer, data_dir, n_batches=4, batch_size=batch_size, seq_len=min(seq_len, 512))
                checks.append(run_check(model, batches, name=name))
            del model
            _free(device)
        meta["elapsed_s"] = round(time.perf_counter() - started, 1)
        write_eval_report(out, [], None, checks, meta)
        return

    task_list = _csv(tasks)
    limits = _limits(limit)
    harness_tasks = [task for task in task_list if task != PERPLEXITY_TASK]
    if harness_tasks and importlib.util.find_spec("lm_eval") is None:  # an extra
        fail(f"tasks {', '.join(harness_tasks)} need lm-eval: pip install 'quantkit[eval]' "
              f"({PERPLEXITY_TASK} runs without it)")
    if harness_tasks:
        from quantkit.eval.accuracy import evaluate_tasks, unknown_tasks

        if unknown := unknown_tasks(harness_tasks):
            fail(f"unknown task(s) {', '.join(unknown)}: not lm-eval task, group or tag names "
                 f"(lm-eval --tasks list), nor {PERPLEXITY_TASK}")
    base_source = baseline or (target if fmts else None)
    base_name = "bf16" if base_source == target else base_source

    def score(name: str, load: Callable[[], tuple[Any, Any]]):
        console.print(f"[bold]evaluating {escape(name)}[/] on {escape(', '.join(task_list))}")
        model, tokenizer = load()
        try:
            if harness_tasks:
                result = evaluate_tasks(model, tokenizer, task_list, name=name, data_dir=data_dir, limit=limits,
                                        batch_size=batch_size, max_length=max_length, seq_len=seq_len)
            else:
                windows = limits.get(PERPLEXITY_TASK) if isinstance(limits, dict) else limits
                result = perplexity_scores(model, tokenizer, name=name, data_dir=data_dir, seq_len=seq_len,
                                           batch_size=batch_size, max_windows=windows)
        except (ConnectionError, FileNotFoundError) as error:  # offline hub, or a data file not found
            fail(f"cannot read the data of {', '.join(task_list)}: {error}. Offline, --data-dir DIR holding "
                  "lambada_test.jsonl and wiki.test.raw (any depth) runs lambada_openai, wikitext and "
                  f"{PERPLEXITY_TASK} from local files.")
        del model
        _free(device)
        return result

    base_scores = score(base_name, _loader(base_source, None, device)) if base_source else None
    scores = [score(name, load) for name, load in candidates]
    meta["baseline"] = base_source
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    for path in write_eval_report(out, scores, base_scores, [], meta):
        console.print(f"wrote {path}")


def _shapes(text: str, option: str) -> tuple[tuple[int, int], ...]:
    """``"1x512,8x2048"`` -> ``((1, 512), (8, 2048))``."""
    pairs = [item.lower().partition("x") for item in _csv(text)]
    return tuple((_positive(b, option, "BATCHxSEQ"), _positive(s, option, "BATCHxSEQ")) for b, _, s in pairs)


def _ints(text: str, option: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> ``(1, 8, 32)``."""
    return tuple(_positive(item, option) for item in _csv(text))


_BENCH_SHAPE_DEFAULTS = ("1x512,1x2048,8x2048,32x2048", "1,8,32", "1,16,128,2048,8192")


def bench_command(
    target: Annotated[str, typer.Argument(help="With --random-init: comma-separated formats to quantize the random model to ('bf16' = unquantized). Otherwise a model: quantkit checkpoint dir, HF dir, hub id or 'demo'.")],
    baseline: Annotated[str, typer.Option(help="'bf16': the same architecture with random bf16 weights (speed does not depend on weight values); 'none': no baseline.")] = "bf16",
    random_init: Annotated[Optional[str], typer.Option(help="Build the model from a config with random weights, on the device, no download: a shipped name (llama-3.1-8b, qwen3-8b, tiny-llama) or a config.json path.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cuda | cpu (default: cuda if present).")] = None,
    prefill: Annotated[str, typer.Option(help="Prefill shapes BATCHxSEQ, comma-separated.")] = _BENCH_SHAPE_DEFAULTS[0],
    decode_batches: Annotated[str, typer.Option(help="Decode batch sizes, comma-separated.")] = _BENCH_SHAPE_DEFAULTS[1],
    context: Annotated[int, typer.Option(min=1, help="Prompt tokens before the timed decode steps.")] = 512,
    decode_steps: Annotated[int, typer.Option(min=1, help="Timed decode steps per batch size.")] = 64,
    gemm_m: Annotated[str, typer.Option(help="Rows M of the per-layer GEMM timings, comma-separated.")] = _BENCH_SHAPE_DEFAULTS[2],
    warmup: Annotated[int, typer.Option(min=0, help="Untimed runs before each measurement.")] = 3,
    iters: Annotated[int, typer.Option(min=1, help="Timed runs per measurement (median reported).")] = 10,
    cuda_graphs: Annotated[bool, typer.Option(help="Capture decode steps as CUDA graphs (on CUDA).")] = True,
    compile_model: Annotated[bool, typer.Option("--compile", help="Run prefill forwards and decode steps (before capture) through torch.compile (Inductor), for both models.")] = False,
    fuse: Annotated[bool, typer.Option("--fuse", help="Run q/k/v and gate/up as one GEMM each (quantkit.fuse_projections), for both models.")] = False,
    flex_attention: Annotated[Optional[bool], typer.Option("--flex-attention/--no-flex-attention", help="Compiled decode steps attend through FlexAttention's split-KV decoding kernel, skipping unfilled cache blocks (both models), or through packed SDPA. Default: FlexAttention with --compile on CUDA, where it measured faster at batch 1, 8 and 32; each batch size compiles its own static graph (docs/evaluation.md).", show_default=False)] = None,
    prefill_graph_tokens: Annotated[int, typer.Option(min=0, help="On CUDA: prefill forwards of at most this many tokens (batch x seq) replay as captured CUDA graphs, as vLLM runs batches up to 512 tokens (0: none).")] = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for bench.md, bench.json, bench_throughput.png.")] = Path("bench-results"),
) -> None:
    """Prefill and decode tokens/s and per-layer GEMM times of TARGET against bf16, in one run.

    Examples:

      quantkit bench nvfp4,fp8-block --random-init llama-3.1-8b

      quantkit bench ./qwen3-8b-nvfp4

      quantkit bench nvfp4 --random-init tiny-llama --device cpu --prefill 1x64 --decode-batches 1 --gemm-m 16
    """
    from quantkit.eval.bench import BenchSettings, bench_model, load_config, random_init_model
    from quantkit.eval.report import write_bench_report

    if baseline not in ("bf16", "none"):
        raise typer.BadParameter("must be 'bf16' or 'none'", param_hint="--baseline")
    if flex_attention and not compile_model:
        raise typer.BadParameter("FlexAttention runs only compiled: add --compile", param_hint="--flex-attention")
    device = _default_device(device)
    if flex_attention and not device.startswith("cuda"):
        raise typer.BadParameter(
            "needs a CUDA device (Inductor's CPU FlexAttention template fails on the bf16 step: unsupported epilogue)",
            param_hint="--flex-attention")
    settings = BenchSettings(
        prefill_shapes=_shapes(prefill, "--prefill"), decode_batches=_ints(decode_batches, "--decode-batches"),
        context=context, decode_steps=decode_steps, gemm_m=_ints(gemm_m, "--gemm-m"), warmup=warmup, iters=iters,
        cuda_graphs=cuda_graphs, compile="inductor" if compile_model else None, fuse=fuse,
        flex_attention=flex_attention, prefill_graph_tokens=prefill_graph_tokens,
    )
    meta = _run_meta(device, target=target, random_init=random_init, baseline=baseline,
                     **{**asdict(settings), "flex_attention": settings.uses_flex(device)})
    if warning := _launch_warning(device):
        meta["warning"] = warning
        console.print(f"warning: {warning}", highlight=False)

    if random_init:
        try:
            config = load_config(random_init)
        except (FileNotFoundError, ValueError) as error:  # no such config, or not a config (JSON errors included)
            fail(f"--random-init {random_init}: {error}")

        targets = [(fmt, lambda fmt=fmt: random_init_model(config, device=device, format=fmt))
                   for fmt in _formats(target, allow_bf16=True)]
    else:
        config = None

        def load_target():
            nonlocal config
            model = _load_model(target, device)[0]
            config = model.config
            return model

        targets = [(target, load_target)]

    defaults = [flag for flag, value, default in zip(("--prefill", "--decode-batches", "--gemm-m"),
                                                     (prefill, decode_batches, gemm_m), _BENCH_SHAPE_DEFAULTS)
                if value == default]
    if device == "cpu" and defaults:
        console.print(f"note: the defaults of {', '.join(defaults)} are sized for a GPU and take a long time on a "
                      "CPU; try e.g. --prefill 1x64 --decode-batches 1 --gemm-m 16", highlight=False)

    def measure(name: str, make):
        with console.status(f"bench {name}"):
            model = make()
            result = bench_model(model, name, settings, log=lambda line: console.print(escape(f"{name}: {line}"), highlight=False))
        del model
        _free(device)
        return result

    benches = [measure(name, make) for name, make in targets]
    base = measure("bf16", lambda: random_init_model(config, device=device)) if baseline == "bf16" else None
    for path in write_bench_report(out, benches, base, meta):
        console.print(f"wrote {path}")
