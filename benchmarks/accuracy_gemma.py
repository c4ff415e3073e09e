"""Accuracy of each calibration algorithm on Gemma-3-270M (the ``demo`` model), on CPU in float32:
the table of ``docs/accuracy.md``.

Metrics, computed here directly (no lm-eval):

- WikiText-2 perplexity: ``wiki.test.raw`` tokenized as one stream (no BOS), cut into the first
  ``--windows`` non-overlapping windows of ``--seq-len`` tokens; each window is prefixed with
  BOS and all its tokens are scored; ``ppl = exp(mean NLL)`` over ``windows·seq_len`` tokens.
- LAMBADA (OpenAI) accuracy: the first ``--docs`` records of ``lambada_test.jsonl``; context =
  the text up to its last space, target = " " + last word, tokenized as lm-eval does (whole text
  minus the context's tokens, BOS first); a doc is correct when the greedy prediction of every
  target token is right (lm-eval ``lambada_openai`` ``acc``).

Each quantized row calibrates a fresh float32 copy with ``quantkit.calibrate.quantize`` on
``--calib-samples × --calib-len`` tokens of ``--calib`` (default: the embedded corpus, what
``quantkit quantize`` uses; each layer fed the quantized model's activations, or with
``--propagate float`` the float model's) and times it. Results go to ``--out`` (JSON, one entry per row,
rows already there are skipped: the run can be resumed) and the Markdown table to stdout.

``--checkpoints LABEL=DIR`` evaluates saved checkpoints instead (read by ``quantkit.load`` in
float32; the row key is ``<format>|LABEL``), e.g. those ``peer_checkpoints.py`` writes with
ModelOpt's or llm-compressor's own recipes from the calibration tokens ``--calib-dump`` saves;
``--vllm-stacking`` evaluates per-tensor fp8 ones as vLLM serves them (``stack_fp8_scales_as_vllm``).
``--device cuda`` calibrates and evaluates on the GPU (the QuantLinears in their float32 reference
path, as on CPU); ``QUANTKIT_DATA`` points at another copy of ``../shared/data``.

    python benchmarks/accuracy_gemma.py --formats nvfp4 fp8-block --algos rtn mse gptq awq smoothquant default
    python benchmarks/accuracy_gemma.py --out benchmarks/results/accuracy_gemma_nvfp4.json --table
    python benchmarks/accuracy_gemma.py --calib-dump /tmp/calib.safetensors
    python benchmarks/accuracy_gemma.py --formats --checkpoints modelopt:NVFP4_DEFAULT_CFG=/tmp/mo-nvfp4
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

DATA = Path(os.environ.get("QUANTKIT_DATA", "/work/shared/data"))  # WikiText-2 and LAMBADA (../shared/data)


def wikitext_windows(tokenizer, windows: int, seq_len: int) -> torch.Tensor:
    """int64 ``[windows, seq_len + 1]``: BOS followed by consecutive ``seq_len``-token windows of
    the WikiText-2 test stream."""
    text = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    need = windows * seq_len
    ids: list[int] = []
    for chunk in text.split("\n \n"):  # tokenizing the whole 1.3 MB at once is slow; articles suffice
        ids += tokenizer(chunk + "\n \n", add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
    return bos_windows(ids, windows, seq_len, tokenizer.bos_token_id)


def bos_windows(ids: list[int], windows: int, seq_len: int, bos: int) -> torch.Tensor:
    """int64 ``[windows, seq_len + 1]``: BOS followed by consecutive ``seq_len``-token windows of ``ids``."""
    stream = torch.tensor(ids[:windows * seq_len]).reshape(windows, seq_len)
    return torch.cat([torch.full((windows, 1), bos), stream], 1)


def lambada_requests(tokenizer, docs: int) -> list[tuple[list[int], int]]:
    """Per doc, ``(token ids of context + target, number of target tokens)``."""
    requests = []
    with open(DATA / "lambada_openai" / "lambada_test.jsonl", encoding="utf-8") as f:
        for line, _ in zip(f, range(docs)):
            text = json.loads(line)["text"]
            context = text.rsplit(" ", 1)[0]
            whole, ctx = tokenizer(text).input_ids, tokenizer(context).input_ids
            requests.append((whole, len(whole) - len(ctx)))
    return requests


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp of the mean next-token NLL over every token after the BOS of each window."""
    nll = 0.0
    for w in windows:
        w = w.to(model.device)
        logits = model(input_ids=w[None], use_cache=False).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
    return math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))


@torch.no_grad()
def lambada_accuracy(model, requests: list[tuple[list[int], int]], batch_size: int = 32) -> float:
    """Fraction of docs whose every target token is the argmax prediction. Docs run in batches of
    similar length, right-padded: a causal model's logits at real positions ignore later padding."""
    correct = 0
    order = sorted(requests, key=lambda r: len(r[0]))
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        width = len(batch[-1][0])
        ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in batch], device=model.device)
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        for row, (r, n) in enumerate(batch):
            logits = model.lm_head(hidden[row, len(r) - n - 1:len(r) - 1])  # softcapping keeps the argmax
            correct += bool((logits.argmax(-1).cpu() == torch.tensor(r[-n:])).all())
    return correct / len(requests)


def main() -> None:
    from quantkit.calibrate.auto_formats import effective_bits, search_layer_formats
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.export import describe, load
    from quantkit.kernels import use_reference
    from quantkit.models import load_model
    from quantkit.nn import calibrate_kv_cache
    from quantkit.nn.swap import assign_formats

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="*", default=["nvfp4", "nvfp4-w4a16", "fp8-block", "mxfp8"])
    p.add_argument("--algos", nargs="+", default=["rtn", "mse", "gptq", "awq", "smoothquant", "default"],
                   help="recipes ('awq+gptq+mse'); 'default' = the format's DEFAULT_ALGORITHMS")
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--docs", type=int, default=300, help="LAMBADA docs (0: perplexity only)")
    p.add_argument("--calib", default=None, help="calibration source (quantkit.calibrate.data); default: embedded corpus")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--calib-seed", type=int, default=0, help="shuffle of the calibration passages (token_samples)")
    p.add_argument("--options", default="{}", help='JSON per-algorithm options, e.g. {"mse": {"weighted": true}}')
    p.add_argument("--propagate", default="quantized", choices=["quantized", "float"],
                   help="inputs of each decoder layer during calibration (quantkit.calibrate.recipe.Recipe)")
    p.add_argument("--kv-cache", default=None, choices=["fp8"], help="also an FP8 KV cache (Recipe.kv_cache)")
    p.add_argument("--layer-format", nargs="*", default=[], metavar="PATTERN=FORMAT",
                   help="mixed precision (Recipe.layer_formats); name the rows with --tag")
    p.add_argument("--effective-bits", type=float, default=None,
                   help="automatic mixed precision (quantkit.calibrate.auto_formats) with --fallback; name the rows with --tag")
    p.add_argument("--fallback", default="fp8-block", help="the wider format of --effective-bits")
    p.add_argument("--kv-cache-after", action="store_true",
                   help="with --kv-cache: calibrate the weights without it, then add it (quantkit.nn.calibrate_kv_cache)")
    p.add_argument("--device", default="cpu", help="where to calibrate and evaluate (e.g. cuda; the QuantLinears "
                   "run their float32 reference path there too)")
    p.add_argument("--degrid", action="store_true",
                   help="evaluate on the demo model moved off its GGUF grid (degrid); use a separate --out")
    p.add_argument("--tag", default="", help="suffix of the result keys (option variants)")
    p.add_argument("--no-bf16", action="store_true", help="skip the unquantized row")
    p.add_argument("--checkpoints", nargs="*", default=[], metavar="LABEL=DIR", help="saved checkpoints to evaluate")
    p.add_argument("--vllm-stacking", action="store_true",
                   help="per-tensor fp8 checkpoints: re-round stacked projections to one scale, as vLLM serves them")
    p.add_argument("--calib-dump", type=Path, help="write the calibration tokens ({'ids': [samples, len]}) and exit")
    p.add_argument("--out", type=Path, default=Path("accuracy_gemma.json"))
    p.add_argument("--table", action="store_true", help="print the Markdown table of --out and exit")
    args = p.parse_args()
    if args.table:
        print(markdown(json.loads(args.out.read_text())))
        return
    torch.manual_seed(0)

    base, tokenizer = load_model("demo", dtype=torch.float32)
    if args.degrid:
        degrid(base)
    windows = wikitext_windows(tokenizer, args.windows, args.seq_len)
    requests = lambada_requests(tokenizer, args.docs)
    calib = token_samples(load_texts(args.calib, tokenizer), tokenizer, num_samples=args.calib_samples, seq_len=args.calib_len,
                          seed=args.calib_seed)
    if args.calib_dump:
        save_file({"ids": calib.contiguous()}, args.calib_dump)
        return
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    setup = {"windows": args.windows, "seq_len": args.seq_len, "docs": args.docs, "calib": args.calib or "embedded corpus",
             "calib_tokens": calib.numel(), "calib_seed": args.calib_seed, "threads": torch.get_num_threads(), "propagate": args.propagate,
             # the CPU kernels' vector ISA: AVX2 and AVX-512 round float32 sums differently, which flips
             # calibration choices (docs/accuracy.md, footnote 13); ATEN_CPU_CAPABILITY selects it
             "cpu_capability": torch.backends.cpu.get_cpu_capability(), "degrid": args.degrid,
             **({"device": torch.cuda.get_device_name(args.device)} if args.device.startswith("cuda") else {})}

    def record(key: str, model, calib_s: float | None, recipe: str, **extra) -> None:
        t = time.time()
        model.to(args.device)
        with use_reference():  # the float32 function of every format, as on CPU (the GPU kernels compute in bf16)
            row = {"recipe": recipe, "ppl": perplexity(model, windows),
                   "lambada": lambada_accuracy(model, requests) if requests else None,
                   "calib_s": calib_s, "eval_s": time.time() - t, **setup, **extra}
        model.to("cpu")
        results[key] = row
        args.out.write_text(json.dumps(results, indent=1))
        print(key, json.dumps(row), flush=True)

    if not args.no_bf16 and "bf16" not in results:
        record("bf16", base, None, "")
    options = json.loads(args.options)
    for fmt in args.formats:
        for algo in args.algos:
            key = f"{fmt}|{algo}{args.tag}"
            if key in results:
                continue
            extra = {"options": options, "propagate": args.propagate,
                     "kv_cache": None if args.kv_cache_after else args.kv_cache}
            recipe = Recipe.parse(fmt, None if algo == "default" else algo, layer_formats=args.layer_format, **extra)
            model = copy.deepcopy(base)
            t = time.time()
            if args.effective_bits is not None:
                chosen, _ = search_layer_formats(model, calib, recipe, args.fallback, args.effective_bits, device=args.device)
                recipe = dataclasses.replace(recipe, layer_formats=chosen)
            linears = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
            bits = effective_bits(base, fmt, assign_formats(linears, fmt, recipe.layer_formats))
            with torch.no_grad():
                quantize(model, recipe, calib, batch_size=8, device=args.device)
                if args.kv_cache and args.kv_cache_after:
                    calibrate_kv_cache(model.to(args.device), calib.to(args.device))
            record(key, model, time.time() - t, "+".join(recipe.algorithms), bits=bits, layer_formats=recipe.layer_formats)
            del model
    for label, directory in (c.split("=", 1) for c in args.checkpoints):
        fmt = describe(directory)["format"]
        key = f"{fmt}|{label}{'@vllm-stacked' if args.vllm_stacking else ''}{args.tag}"
        if key not in results:
            seconds = Path(directory, "calibration_seconds.txt")
            model = load(directory, dtype=torch.float32)
            if args.vllm_stacking and fmt == "fp8":
                stack_fp8_scales_as_vllm(model)
            record(key, model, float(seconds.read_text()) if seconds.exists() else None, label)
    print(markdown(results))


def degrid(model, seed: int = 0) -> None:
    """Move every decoder-layer Linear weight off the GGUF grid the demo model was dequantized from.

    Each 32-element block along K of a Q4_K / Q5_K / Q6_K tensor holds a few evenly spaced values
    (``d·q − m``). Each weight gets uniform noise of ± half its block's step (the smallest gap
    between the block's distinct values), the error the GGUF rounding made: the result is a
    plausible continuous-valued model, on which recipes can be compared without the grid's help."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in name:
                blocks = m.weight.view(-1, 32)
                ordered = blocks.sort(-1).values
                gaps = ordered[:, 1:] - ordered[:, :-1]
                step = torch.where(gaps > 0, gaps, torch.inf).amin(-1, keepdim=True).nan_to_num(0.0, posinf=0.0)
                blocks += (torch.rand(blocks.shape, generator=g) - 0.5) * step


def stack_fp8_scales_as_vllm(model) -> None:
    """What vLLM serves from a per-tensor ``fp8`` checkpoint whose stacked projections (q/k/v,
    gate/up) have separate weight scales: each member dequantized and re-rounded to E4M3 under the
    group's largest scale (vLLM's ``requantize_with_max_scale``; round to nearest even, saturating).
    A no-op where the members already share one scale, as quantkit writes them."""
    from quantkit.nn import QuantLinear
    from quantkit.nn.swap import fused_groups

    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    with torch.no_grad():
        for group in fused_groups(layers):
            members = [layers[n] for n in group]
            largest = max(m.weight_scale.item() for m in members)
            for m in members:
                w = m.weight.float() * m.weight_scale.float() / largest
                m.weight.copy_(w.clamp(-448, 448).to(torch.float8_e4m3fn))
                m.weight_scale.fill_(largest)


def markdown(results: dict) -> str:
    """The results as a Markdown table (ppl, LAMBADA %, calibration seconds; relative to bf16)."""
    ref = results.get("bf16")
    lines = ["| format | algorithms | WikiText-2 ppl | Δ ppl | LAMBADA acc | % of bf16 | calibration (s) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, r in results.items():
        fmt, _, algo = key.partition("|")
        name = f"default ({r['recipe']})" if algo.startswith("default") else algo
        d_ppl = f"{100 * (r['ppl'] / ref['ppl'] - 1):+.1f}%" if ref and key != "bf16" else ""
        has_acc = r["lambada"] is not None
        acc = f"{100 * r['lambada']:.1f}" if has_acc else ""
        rel = f"{100 * r['lambada'] / ref['lambada']:.1f}%" if has_acc and ref and key != "bf16" else ""
        calib = f"{r['calib_s']:.0f}" if r["calib_s"] is not None else ""
        lines.append(f"| {fmt} | {name} | {r['ppl']:.3f} | {d_ppl} | {acc} | {rel} | {calib} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
