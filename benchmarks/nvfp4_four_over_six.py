"""NVFP4 W4A4 with "Four Over Six" activation block scales on Gemma-3-270M (CPU).

Four Over Six (Cook et al. 2025, arXiv 2512.02010): per 16-element block, quantize the block twice,
with the E4M3 block scale that maps the block maximum to 6 (the standard NVFP4 rule, which vLLM,
ModelOpt and torchao use) and with the one that maps it to 4, and keep the one with the lower
squared error. The E2M1 grid has no value between 4 and 6, so near-maximal values
lose less under the 4-scale. The stored bits are ordinary NVFP4; only the quantizer's choice of
block scale differs.

The format ``nvfp4-4over6`` applies the rule to weights (round to nearest) and activations; this
script isolates the activations: it switches the rule of ``nvfp4``'s activation quantizer only
(``NVFP4Activation.four_over_six``), so the weights are the default's. Each ``CAL:RUN`` pair
calibrates the default ``nvfp4`` recipe (awq+mse) with the activation rule ``CAL`` (it shapes AWQ's
search and the quantized propagation) and evaluates with ``RUN``, rules ``max6`` (standard) or
``46``. ``46:max6`` is a checkpoint calibrated with 4/6 as vLLM would serve it. Metrics as
``accuracy_gemma.py`` (WikiText-2 perplexity, first 10×512 tokens; LAMBADA).

``--headroom F`` calibrates the static activation tensor scale as ``F·amax/(6·448)`` (the paper's
advice for 4/6 is F = 1.5, so that the 4-scale of the block holding the maximum does not clamp at
448); with ``--after``, the model is calibrated at F = 1 and every calibrated ``input_scale`` is
multiplied by F afterwards (the same run-time scales, but AWQ's search and the quantized
propagation did not see them). ``--windows A-B`` scores WikiText-2 windows A to B−1 (held-out
text: ``10-30``).

Run: ``python benchmarks/nvfp4_four_over_six.py max6:max6 max6:46 46:max6 46:46 [--docs 5153]
[--headroom 1.5] [--windows 10-30] --out benchmarks/results/nvfp4_four_over_six_gemma.json``
(~5 min per pair at 300 docs).
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_gemma import (
    lambada_accuracy,
    lambada_requests,
    perplexity,
    wikitext_windows,
)

from quantkit.formats import get_format
from quantkit.formats.nvfp4 import tensor_scale_from_amax


def main() -> None:
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", metavar="CAL:RUN", help="activation rules (max6, 46) for calibration and evaluation")
    p.add_argument("--docs", type=int, default=300, help="LAMBADA documents")
    p.add_argument("--headroom", type=float, default=1.0, help="calibrated activation tensor scale × this")
    p.add_argument("--after", action="store_true", help="apply --headroom after calibration")
    p.add_argument("--windows", default="0-10", help="WikiText-2 windows A-B (512 tokens each, B exclusive)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    first, last = (int(v) for v in args.windows.split("-"))
    rules = {"max6": False, "46": True}
    for pair in args.pairs:
        if set(pair.split(":")) - set(rules) or pair.count(":") != 1:
            p.error(f"pair {pair!r}: expected CAL:RUN with rules {sorted(rules)}")
    torch.manual_seed(0)
    base, tokenizer = load_model("demo", dtype=torch.float32)
    windows, requests = wikitext_windows(tokenizer, last, 512)[first:], lambada_requests(tokenizer, args.docs)
    calib = token_samples(load_texts(None, tokenizer), tokenizer, num_samples=16, seq_len=256)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    activation = get_format("nvfp4").activation
    calib_headroom = 1.0 if args.after else args.headroom
    activation.input_scale_from_amax = lambda amax: tensor_scale_from_amax(amax * calib_headroom)
    variant = "".join([f" / tensor scale x{args.headroom:g}" if args.headroom != 1 else "",
                       " after calibration" if args.after else "",
                       f" / windows {first}-{last - 1}" if args.windows != "0-10" else ""])
    try:
        for pair in args.pairs:
            cal, run = pair.split(":")
            activation.four_over_six = rules[cal]
            model = copy.deepcopy(base)
            t = time.time()
            quantize(model, Recipe("nvfp4"), calib, batch_size=8)
            calib_s = time.time() - t
            activation.four_over_six = rules[run]
            if args.after:
                for layer in model.modules():
                    if getattr(layer, "input_scale", None) is not None:
                        layer.input_scale.mul_(args.headroom)
            key = f"calib {cal} / eval {run}{variant} / docs {len(requests)}"
            results[key] = {"ppl": perplexity(model, windows), "lambada": lambada_accuracy(model, requests),
                            "calib_s": calib_s, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
            args.out.write_text(json.dumps(results, indent=1))
            print(key, json.dumps(results[key]), flush=True)
    finally:
        activation.four_over_six = False
        del activation.input_scale_from_amax


if __name__ == "__main__":
    main()
