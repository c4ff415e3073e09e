"""Which half of a W+A format costs the accuracy on Gemma-3-270M: weights only, activations only, both.

The format's default recipe calibrates the model once. It is then evaluated three ways, with the
metrics of ``accuracy_gemma.py`` (WikiText-2 perplexity, first 10×512 tokens; LAMBADA, first 300 docs):

* **weights only**: the quantized weights, with the format's activation quantization switched off;
* **both**: the quantized model as shipped;
* **activations only**: the float model, with the format's activation quantize-dequantize applied to
  the inputs of the same linears, each call with its own tensor scale (the float model has no AWQ /
  SmoothQuant smoothing, so the calibrated static scales of the quantized model do not apply).

Run: ``python benchmarks/accuracy_attribution.py --format fp8-block --out results/X.json`` (CPU, ~12 min).
``--linears q_proj,k_proj,v_proj down_proj ...`` adds one "activations only" evaluation per group,
quantizing only the inputs of the linears whose names end with one of the group's suffixes; with
``--hadamard B`` those inputs are quantized in a rotated basis, ``H·qdq(H·x)`` for the orthonormal
B×B Sylvester-Hadamard ``H`` applied per block of B along K (exact in float: the layer would
multiply by ``W·H``), the estimate of what an online block rotation would recover.
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accuracy_gemma import lambada_accuracy, lambada_requests, perplexity, wikitext_windows  # noqa: E402


PARTS = ("weights only", "both", "activations only")


def main() -> None:
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.formats import get_format
    from quantkit.models import load_model
    from quantkit.nn.linear import QuantLinear

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="fp8-block")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS, help="evaluations to run (others are kept from --out)")
    p.add_argument("--linears", nargs="*", default=[], metavar="SUFFIXES",
                   help="comma-separated name suffixes per extra 'activations only' evaluation")
    p.add_argument("--hadamard", type=int, default=0, metavar="B", help="with --linears: rotate by B x B blocks")
    args = p.parse_args()
    torch.manual_seed(0)
    base, tokenizer = load_model("demo", dtype=torch.float32)
    windows, requests = wikitext_windows(tokenizer, 10, 512), lambada_requests(tokenizer, 300)
    calib = token_samples(load_texts(None, tokenizer), tokenizer, num_samples=16, seq_len=256)
    results = {k: v for k, v in json.loads(args.out.read_text()).items() if k != "format"} if args.out.exists() else {}

    def record(key: str, model) -> None:
        t = time.time()
        results[key] = {"ppl": perplexity(model, windows), "lambada": lambada_accuracy(model, requests),
                        "eval_s": time.time() - t}
        args.out.write_text(json.dumps({"format": args.format, **results}, indent=1))
        print(key, json.dumps(results[key]), flush=True)

    act = get_format(args.format).activation
    if act is None:
        raise SystemExit(f"{args.format} quantizes weights only")
    if args.parts:
        model = copy.deepcopy(base)
        with torch.no_grad():
            quantize(model, Recipe(args.format), calib, batch_size=8)
        names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    else:  # the decoder layers' linears, which quantize() swaps (the LM head stays in float)
        names = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    qdq = act.qdq
    quantize_input = lambda x: qdq(x).to(x.dtype)  # noqa: E731
    if args.hadamard:
        had = torch.ones(1, 1)
        while had.shape[0] < args.hadamard:
            had = torch.cat([torch.cat([had, had], 1), torch.cat([had, -had], 1)])
        had = had / had.shape[0] ** 0.5

        def quantize_input(x):
            blocks = lambda t: t.reshape(*t.shape[:-1], -1, had.shape[0])  # noqa: E731
            return (blocks(qdq((blocks(x) @ had).reshape(x.shape))) @ had).reshape(x.shape).to(x.dtype)
    for group in args.linears:
        suffixes = tuple(group.split(","))
        hooks = [base.get_submodule(n).register_forward_pre_hook(lambda m, a: (quantize_input(a[0]), *a[1:]))
                 for n in names if n.endswith(suffixes)]
        record(f"activations only{f' (hadamard {args.hadamard})' if args.hadamard else ''}: {group}", base)
        for hook in hooks:
            hook.remove()
    if "weights only" in args.parts:
        act.qdq = lambda x, input_scale=None: x
        try:
            record("weights only", model)
        finally:
            act.qdq = qdq
    if "both" in args.parts:
        record("both", model)
    if "activations only" in args.parts:
        for n in names:
            base.get_submodule(n).register_forward_pre_hook(lambda m, a: (qdq(a[0]).to(a[0].dtype), *a[1:]))
        record("activations only", base)


if __name__ == "__main__":
    main()
