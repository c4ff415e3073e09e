"""``quantkit`` command line: quantize, inspect, eval, bench."""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from quantkit.terminal import check_device, console, fail, wide

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Quantize Hugging Face models to NVFP4 / FP8 / MX, evaluate and benchmark them.")
FORMAT_HELP = "nvfp4 | nvfp4-4over6 | nvfp4-w4a16 | nvfp4-w4a8 | fp8-block | fp8-dynamic | fp8 | mxfp8 | mxfp4"


def _json_options(text: str | None) -> dict:
    """``--options``: the JSON object of per-algorithm parameters (``{}`` when not given)."""
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--options is not valid JSON ({err}): {text}") from None


def _progress(enabled: bool = True) -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False, disable=not enabled)


def _summary(report, seconds: float) -> Table:
    formats = report.formats
    what = report.format if len(formats) <= 1 else " + ".join(f"{f} ({count})" for f, count in formats.items())
    table = Table(title=f"{what}: {len(report.quantized)} layers quantized, {len(report.skipped)} skipped, {seconds:.1f} s")
    mixed = len(formats) > 1
    for col in ("layer", "shape", "SQNR dB", "MB before", "MB after", "note"):
        table.add_column(col, justify="left" if col in ("layer", "note") else "right", overflow="fold")
    for r in report.layers:
        sqnr = "" if r.sqnr_db is None else ("inf" if math.isinf(r.sqnr_db) else f"{r.sqnr_db:.1f}")
        table.add_row(r.name, "×".join(map(str, r.shape)), sqnr, f"{r.bytes_before / 1e6:.2f}" if r.bytes_before else "",
                      f"{r.bytes_after / 1e6:.2f}" if r.bytes_after else "", r.reason or (r.format if mixed else ""))
    before = sum(r.bytes_before for r in report.quantized)
    after = sum(r.bytes_after for r in report.quantized)
    table.add_row("[bold]total (quantized layers)", "", "", f"{before / 1e6:.1f}", f"{after / 1e6:.1f}", f"{before / max(after, 1):.2f}× smaller")
    return table


@app.command()
def quantize(
    model: Annotated[str, typer.Argument(help="'demo' (Gemma-3-270M, offline), a local HF model directory, or a hub id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output checkpoint directory (written atomically).")],
    format: Annotated[str, typer.Option("--format", "-f", help=FORMAT_HELP)] = "nvfp4",
    calib: Annotated[Optional[str], typer.Option(help="Calibration data: a .txt/.jsonl/.parquet file or directory, a hub dataset id (name[:config]); default: the embedded corpus.")] = None,
    samples: Annotated[Optional[int], typer.Option(min=1, help="Number of calibration sequences (default: 128 on a GPU, 16 on CPU).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=1, help="Tokens per calibration sequence (default: 512 on a GPU, 256 on CPU).")] = None,
    algo: Annotated[Optional[str], typer.Option(help="Algorithms joined by '+' (rtn or max, mse, gptq, awq, smoothquant, autoround), e.g. 'awq+gptq+mse', 'awq+mse+autoround'; default: the format's default recipe.")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(help="Glob or 're:' pattern of Linear names to keep in bf16 (repeatable); lm_head is always kept.")] = None,
    layer_format: Annotated[Optional[list[str]], typer.Option(help="PATTERN=FORMAT: the Linear layers matching the glob or 're:' pattern get FORMAT instead of --format (repeatable, first match wins), e.g. '*self_attn*=fp8-block'.")] = None,
    effective_bits: Annotated[Optional[float], typer.Option(min=1, help="Automatic mixed precision: give --fallback to the layers whose loss, measured on the calibration data, it recovers most per byte, within this many bits per weight on average.")] = None,
    fallback: Annotated[str, typer.Option(help="The wider format of --effective-bits.")] = "fp8-block",
    options: Annotated[Optional[str], typer.Option(help='Algorithm parameters as JSON, e.g. \'{"autoround": {"iters": 200}, "gptq": {"act_order": true}}\'.')] = None,
    export: Annotated[str, typer.Option(help="Checkpoint flavour: compressed-tensors | modelopt (both load in vLLM).")] = "compressed-tensors",
    kv_cache: Annotated[Optional[str], typer.Option(help="'fp8': also calibrate a static FP8 KV-cache scale per attention layer (vLLM: --kv-cache-dtype fp8).")] = None,
    device: Annotated[Optional[str], typer.Option(help="Where to calibrate: cuda | cpu (default: cuda if present).")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Calibration sequences per forward pass.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed for sampling calibration text.")] = 0,
) -> None:
    """Quantize MODEL and write a checkpoint vLLM loads.

    Example: quantkit quantize demo --format nvfp4 --out /tmp/q

    Data-parallel on the GPUs of one host (rank 0 writes the checkpoint):
    torchrun --nproc-per-node 2 -m quantkit.cli quantize MODEL --out /tmp/q
    """
    import torch
    import torch.distributed as dist

    from quantkit.calibrate import Recipe
    from quantkit.calibrate import quantize as run_quantize
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.distributed import init_from_env, is_main
    from quantkit.export import FLAVOURS, save
    from quantkit.export.io import check_output_dir
    from quantkit.formats import get_format
    from quantkit.models import load_model
    from quantkit.nn import QuantLinear

    check_device(device)
    start = time.time()
    parallel = init_from_env()  # under torchrun: one rank per GPU, each calibrates on its shard of the batches
    writer = is_main()  # rank 0 (or the only process) writes and prints
    try:
        recipe = Recipe.parse(format, algo, ignore, layer_format, kv_cache=kv_cache, options=_json_options(options))
        if effective_bits is not None:
            if layer_format:
                raise ValueError("--effective-bits chooses the layer formats itself: drop --layer-format")
            get_format(fallback)  # an unknown fallback format fails now
        if export not in FLAVOURS:
            raise ValueError(f"unknown export flavour {export!r}; valid: {', '.join(FLAVOURS)}")
        check_output_dir(out)  # an --out that save would refuse fails now, not after calibration
        if export == "modelopt":
            from quantkit.export.modelopt import tensor_specs

            for fmt in (recipe.format, *recipe.layer_formats.values(), *([fallback] if effective_bits is not None else [])):
                tensor_specs(fmt)  # a format ModelOpt lacks fails now, not after calibration
        with _progress(writer) as bars:
            task = bars.add_task(f"loading {model}", total=None)
            lm, tokenizer = load_model(model, device="cpu")
            if any(isinstance(m, QuantLinear) for m in lm.modules()):
                raise ValueError(f"{model} is already a quantized checkpoint: quantize its unquantized source model")
            source_bytes = next(lm.parameters()).element_size()
            on_gpu = device == "cuda" or (device is None and torch.cuda.is_available())
            if not on_gpu:
                lm = lm.float()  # bf16 matmuls are slow on CPUs; scales are computed in FP32 anyway
            bars.update(task, total=1, completed=1)
            ids = None
            samples = samples or (128 if on_gpu else 16)
            seq_len = seq_len or (512 if on_gpu else 256)
            if recipe.needs_data or effective_bits is not None:
                texts = load_texts(calib, tokenizer)
                context = getattr(lm.config, "max_position_embeddings", None)
                ids = token_samples(texts, tokenizer, num_samples=samples, seq_len=seq_len, seed=seed, max_length=context)
            if effective_bits is not None:
                from quantkit.calibrate.auto_formats import effective_bits as bits_of, search_layer_formats

                task = bars.add_task(f"choosing {fallback} layers within {effective_bits} bits per weight", total=None)
                chosen, _ = search_layer_formats(lm, ids, recipe, fallback, effective_bits, batch_size=batch_size, device=device)
                recipe = dataclasses.replace(recipe, layer_formats=chosen)
                bars.update(task, total=1, completed=1,
                            description=f"{len(chosen)} layers in {fallback}: {bits_of(lm, recipe.format, chosen, recipe.ignore):.2f} bits per weight")
            task = bars.add_task(f"calibrating {recipe.format} ({'+'.join(recipe.algorithms)})", total=None)
            report = run_quantize(lm, recipe, ids, device=device, batch_size=batch_size,
                                  progress=lambda done, total: bars.update(task, completed=done, total=total))
            bars.update(task, total=bars.tasks[task].total or 1, completed=bars.tasks[task].total or 1)
            if not report.quantized:
                reasons = sorted({r.reason for r in report.skipped})
                fail(f"no layer was quantized: all {len(report.skipped)} Linear layers were skipped ({'; '.join(reasons)})")
            for r in report.quantized:  # sizes against the checkpoint's own dtype, not the FP32 working copy
                r.bytes_before = math.prod(r.shape) * source_bytes
            if writer:
                task = bars.add_task(f"writing {out}", total=None)
                save(lm.to(torch.bfloat16), out, export=export, tokenizer=tokenizer)
                bars.update(task, total=1, completed=1)
    except typer.Exit:  # a RuntimeError too: fail() already said why
        raise
    except (ValueError, RuntimeError, OSError) as err:
        fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (main): save() has removed its partial directory
        console.print(f"[bold red]interrupted:[/] {out} was not written" + (" (the previous checkpoint there is kept)"
                      if out.exists() else ""), highlight=False)
        raise typer.Exit(130) from None
    finally:
        if parallel:
            dist.destroy_process_group()
    if not writer:
        return
    wide(console).print(_summary(report, time.time() - start))  # a log gets whole layer names
    console.print(f"wrote {out} ({export})")


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory written by quantkit (or llm-compressor / ModelOpt).")],
    check: Annotated[bool, typer.Option("--check", help="Also load every tensor (quantkit.load, on the CPU): names, shapes, dtypes and scales against the config.")] = False,
) -> None:
    """Print what a checkpoint holds: format, flavour, layers, tensor bytes (from the config and
    the safetensors headers; --check also loads it).

    Example: quantkit inspect /tmp/q --check
    """
    from quantkit.export import describe, load
    from quantkit.nn import QuantLinear

    try:
        info = describe(path)
        if check:
            with console.status(f"loading {path}"):
                model = load(path)
            info["check"] = f"loads: {sum(isinstance(m, QuantLinear) for m in model.modules())} QuantLinear layers"
    except (ValueError, OSError) as err:
        fail(str(err))
    table = Table(title=str(path))
    table.add_column("field")
    table.add_column("value")
    for key, value in info.items():
        table.add_row(str(key), str(value))
    Console().print(table)


def _register_eval_commands() -> None:
    try:
        from quantkit.eval.commands import bench_command, eval_command
    except ImportError:
        return
    app.command("eval")(eval_command)
    app.command("bench")(bench_command)


_register_eval_commands()


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds as Ctrl-C does: a checkpoint being written is removed


def main() -> None:  # pragma: no cover - console entry point
    signal.signal(signal.SIGTERM, _terminated)
    sys.exit(app())


if __name__ == "__main__":  # python -m quantkit.cli (torchrun -m quantkit.cli)
    main()
