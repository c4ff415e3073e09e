"""Accuracy cost of the W4A8 rounding against exact W4A16 on Gemma-3-270M (the ``demo`` model):
WikiText-2 perplexity, CPU, float32, through the reference path (``benchmarks/notes/w4a8_format.md``).

Rows: bf16 (unquantized weights), ``nvfp4-w4a16`` and ``nvfp4-w4a8``, both RTN (identical
weights). Windows as in ``accuracy_gemma.py`` (``--windows`` x ``--seq-len`` tokens after a BOS),
``--batch`` windows per forward. ``nvfp4-w4a8`` is run with the W4A8 function in every layer,
whatever the crossover rule says for its M and N' (``formats.w4a8.use_w4a8`` patched to true: the
prefill worst case; forward hooks count the calls and the script asserts it).
``--split`` adds two ablations of that W4A8 function (``formats.w4a8`` functions patched for the
run): E4M3 weight re-rounding with exact activations, and FP8 per-token activations with exact
NVFP4 weights.

    OMP_NUM_THREADS=1 python benchmarks/w4a8_accuracy.py --out w4a8_accuracy.json
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy_gemma import wikitext_windows  # noqa: E402  (benchmarks/accuracy_gemma.py)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int) -> float:
    """exp of the mean next-token NLL over every token after each window's BOS, ``batch`` windows
    per forward."""
    nll = 0.0
    for b in range(0, windows.shape[0], batch):
        ids = windows[b:b + batch]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    return math.exp(nll / (windows.shape[0] * (windows.shape[1] - 1)))


def count_paths(model) -> tuple[dict[str, int], list]:
    """Forward hooks counting the QuantLinear calls that compute the W4A8 function (an
    ``nvfp4-w4a8`` layer with ``use_w4a8(M, N')``) and the others."""
    from quantkit.formats.w4a8 import use_w4a8
    from quantkit.nn import QuantLinear

    counts = {"w4a8": 0, "w4a16": 0}

    def hook(module, args):
        m = args[0].numel() // args[0].shape[-1]
        w4a8_path = module.format == "nvfp4-w4a8" and use_w4a8(m, module.out_features)
        counts["w4a8" if w4a8_path else "w4a16"] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, QuantLinear)]
    return counts, handles


def exact_weight(packed: torch.Tensor, scale: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """FP32 ``e2m1 · s_b · 2^-c_n`` without the E4M3 rounding (stand-in for ``w4a8.weight_to_fp8``)."""
    from quantkit.formats.codecs import e2m1_decode, unpack_nibbles

    n = packed.shape[0]
    vals = e2m1_decode(unpack_nibbles(packed)).reshape(n, -1, 16)
    return (vals * torch.ldexp(scale.float(), -exponents.float()[:, None])[..., None]).reshape(n, -1)


def exact_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, 1)``: no activation quantization (stand-in for ``w4a8.quantize_activation``)."""
    return x.float(), torch.ones(x.shape[0], device=x.device)


def main() -> None:
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="windows per forward (M = batch x (seq_len + 1))")
    p.add_argument("--split", action="store_true", help="also the weight-only and activation-only ablations")
    p.add_argument("--out", type=Path, default=Path("w4a8_accuracy.json"))
    args = p.parse_args()

    base, tokenizer = load_model("demo", dtype=torch.float32)
    windows = wikitext_windows(tokenizer, args.windows, args.seq_len)
    results = {"setup": {"windows": args.windows, "seq_len": args.seq_len, "batch": args.batch,
                         "tokens_per_forward": args.batch * (args.seq_len + 1), "threads": torch.get_num_threads()}}

    def record(key: str, model, batch: int) -> None:
        counts, handles = count_paths(model)
        t = time.time()
        results[key] = {"ppl": perplexity(model, windows, batch), "batch": batch, "calls": dict(counts),
                        "eval_s": round(time.time() - t, 1)}
        for h in handles:
            h.remove()
        args.out.write_text(json.dumps(results, indent=1))
        print(key, json.dumps(results[key]), flush=True)

    record("bf16", base, args.batch)
    models = {}
    for fmt in ("nvfp4-w4a16", "nvfp4-w4a8"):
        models[fmt] = copy.deepcopy(base)
        quantize(models[fmt], Recipe.parse(fmt, "rtn"), None)  # RTN: no calibration data
    sd16, sd8 = models["nvfp4-w4a16"].state_dict(), models["nvfp4-w4a8"].state_dict()
    assert sd16.keys() == sd8.keys() and all(torch.equal(sd16[k], sd8[k]) for k in sd16), "weights differ"
    record("nvfp4-w4a16", models["nvfp4-w4a16"], args.batch)
    from quantkit.formats import w4a8
    from quantkit.nn import QuantLinear

    with mock.patch.object(w4a8, "use_w4a8", lambda m, n: True):  # W4A8 in every layer
        record("nvfp4-w4a8", models["nvfp4-w4a8"], args.batch)
        assert results["nvfp4-w4a8"]["calls"]["w4a16"] == 0
        if args.split:
            for key, name, fn in (("w4a8 weights only", "quantize_activation", exact_activation),
                                  ("w4a8 activations only", "weight_to_fp8", exact_weight)):
                for m in models["nvfp4-w4a8"].modules():
                    if isinstance(m, QuantLinear):
                        m.qweight.layouts.pop("w4a8", None)  # the cached E4M3 weight
                with mock.patch.object(w4a8, name, fn):
                    record(key, models["nvfp4-w4a8"], args.batch)
    print("\n| model | tokens per forward | Linear calls W4A8 / W4A16 | WikiText-2 ppl |\n|---|---|---|---|")
    for key, row in results.items():
        if key != "setup":
            tokens = row["batch"] * (args.seq_len + 1)
            print(f"| {key} | {tokens} | {row['calls']['w4a8']} / {row['calls']['w4a16']} | {row['ppl']:.3f} |")


if __name__ == "__main__":
    main()
