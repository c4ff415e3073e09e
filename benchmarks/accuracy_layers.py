"""How a format's perplexity loss on Gemma-3-270M splits over its decoder layers (leave one out).

The format's default recipe calibrates the model once (16 x 256 tokens of the embedded corpus,
calibration sample ``--calib-seed``). Then, for each decoder layer in turn, that one layer is put
back in float (the whole layer, so its AWQ smoothing, folded into its own norms and projections,
goes with it) and WikiText-2 perplexity is measured as in ``accuracy_gemma.py`` (first 10 x 512
tokens). A layer's recovery is ``ppl(quantized) - ppl(layer i in float)``; if the recoveries
sum to the whole loss, the layers' errors add up independently.

    python benchmarks/accuracy_layers.py --format nvfp4-w4a16 --out benchmarks/results/X.json   # CPU, ~7 min
"""
import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy_gemma import perplexity, wikitext_windows


def main() -> None:
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.models import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="nvfp4-w4a16")
    p.add_argument("--calib-seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    base, tokenizer = load_model("demo", dtype=torch.float32)
    windows = wikitext_windows(tokenizer, 10, 512)
    calib = token_samples(load_texts(None, tokenizer), tokenizer, num_samples=16, seq_len=256, seed=args.calib_seed)
    model = copy.deepcopy(base)
    with torch.no_grad():
        quantize(model, Recipe(args.format), calib, batch_size=8)
    result = {"format": args.format, "calib_seed": args.calib_seed, "bf16": perplexity(base, windows),
              "quantized": perplexity(model, windows), "layer_in_float": []}
    print(json.dumps(result), flush=True)
    layers = model.model.layers
    for i in range(len(layers)):
        quantized_layer, layers[i] = layers[i], base.model.layers[i]
        result["layer_in_float"].append(perplexity(model, windows))
        layers[i] = quantized_layer
        print(i, result["layer_in_float"][-1], flush=True)
        args.out.write_text(json.dumps(result, indent=1))
    recovery = [result["quantized"] - ppl for ppl in result["layer_in_float"]]
    print(f"loss {result['quantized'] - result['bf16']:.3f}, sum of the layers' recoveries {sum(recovery):.3f}, "
          f"largest {max(recovery):.3f} (layer {recovery.index(max(recovery))})")


if __name__ == "__main__":
    main()
