"""NVFP4 W4A4 with "Four Over Six" activation block scales on Gemma-3-270M (CPU).

Four Over Six (Cook et al. 2025, arXiv 2512.02010): per 16-element block, quantize the block twice,
with the E4M3 block scale that maps the block maximum to 6 (the standard NVFP4 rule, which vLLM,
ModelOpt and torchao use) and with the one that maps it to 4, and keep the one with the lower
squared error. The E2M1 grid has no value between 4 and 6, so near-maximal values
lose less under the 4-scale. The stored bits are ordinary NVFP4; only the quantizer's choice of
block scale differs.

Each ``CAL:RUN`` pair calibrates the default ``nvfp4`` recipe (awq+mse) with the activation rule
``CAL`` (it shapes AWQ's search and the quantized propagation) and evaluates with ``RUN``, rules
``max6`` (standard) or ``46``. ``46:max6`` is a checkpoint calibrated with 4/6 as vLLM would serve
it. Metrics as ``accuracy_gemma.py`` (WikiText-2 perplexity, first 10×512 tokens; LAMBADA).

Run: ``python benchmarks/nvfp4_four_over_six.py max6:max6 max6:46 46:max6 46:46 [--docs 5153]
--out benchmarks/results/nvfp4_four_over_six_gemma.json`` (~5 min per pair at 300 docs).
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

from quantkit.formats import nvfp4
from quantkit.formats.codecs import E4M3_MAX


def qdq_four_over_six(self, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 ``[..., K]``: ``x`` quantized to NVFP4 and back, each 16-block under the lower-error of
    the block scales ``amax/6`` and ``amax/4`` (E4M3, over the same FP32 tensor scale)."""
    ts = nvfp4.tensor_scale_from_amax(x.float().abs().amax()) if input_scale is None else input_scale.float()
    blocks = nvfp4._blocks(x)
    amax = blocks.abs().amax(-1)
    candidates = []
    for top in (6.0, 4.0):
        scale = ((amax / torch.full_like(amax, top)) / ts).clamp(nvfp4._E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
        candidates.append(nvfp4.dequantize_codes(nvfp4.quantize_values(x, scale, ts), scale, ts).reshape(blocks.shape))
    err6, err4 = ((c - blocks).pow(2).sum(-1, keepdim=True) for c in candidates)
    return torch.where(err4 < err6, candidates[1], candidates[0]).reshape(x.shape)


def main() -> None:
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", metavar="CAL:RUN", help="activation rules (max6, 46) for calibration and evaluation")
    p.add_argument("--docs", type=int, default=300, help="LAMBADA documents")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rules = {"max6": nvfp4.NVFP4Activation.qdq, "46": qdq_four_over_six}
    for pair in args.pairs:
        if set(pair.split(":")) - set(rules) or pair.count(":") != 1:
            p.error(f"pair {pair!r}: expected CAL:RUN with rules {sorted(rules)}")
    torch.manual_seed(0)
    base, tokenizer = load_model("demo", dtype=torch.float32)
    windows, requests = wikitext_windows(tokenizer, 10, 512), lambada_requests(tokenizer, args.docs)
    calib = token_samples(load_texts(None, tokenizer), tokenizer, num_samples=16, seq_len=256)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    try:
        for pair in args.pairs:
            cal, run = pair.split(":")
            nvfp4.NVFP4Activation.qdq = rules[cal]
            model = copy.deepcopy(base)
            t = time.time()
            quantize(model, Recipe("nvfp4"), calib, batch_size=8)
            calib_s = time.time() - t
            nvfp4.NVFP4Activation.qdq = rules[run]
            key = f"calib {cal} / eval {run} / docs {len(requests)}"
            results[key] = {"ppl": perplexity(model, windows), "lambada": lambada_accuracy(model, requests),
                            "calib_s": calib_s, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
            args.out.write_text(json.dumps(results, indent=1))
            print(key, json.dumps(results[key]), flush=True)
    finally:
        nvfp4.NVFP4Activation.qdq = rules["max6"]


if __name__ == "__main__":
    main()
