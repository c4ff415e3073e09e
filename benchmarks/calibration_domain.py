"""Does the calibration text's domain carry over to other text? Gemma-3-270M on CPU, float32.

Calibrates a fresh copy of the demo model with one recipe on ``--calib`` (``embedded``: the
shipped corpus, else a local file, e.g. WikiText-2 *valid*), then measures perplexity on text of a
third domain: 20 windows of 512 tokens of LAMBADA passages (novels), docs 1000 onwards (disjoint
from the 300 docs of the LAMBADA accuracy metric in ``accuracy_gemma.py``). Appends one JSON line
per run to ``--out``. Run: ``python benchmarks/calibration_domain.py FORMAT ALGOS --calib SRC``
(``FORMAT bf16`` for the unquantized row).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from accuracy_gemma import DATA, bos_windows, perplexity  # noqa: E402  (benchmarks/accuracy_gemma.py)


def lambada_text_windows(tokenizer, windows: int = 20, seq_len: int = 512, first_doc: int = 1000) -> torch.Tensor:
    """int64 ``[windows, seq_len + 1]``: BOS and consecutive windows of LAMBADA passages from ``first_doc``."""
    ids: list[int] = []
    with open(DATA / "lambada_openai" / "lambada_test.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= first_doc:
                ids += tokenizer(json.loads(line)["text"] + "\n\n", add_special_tokens=False).input_ids
                if len(ids) >= windows * seq_len:
                    break
    return bos_windows(ids, windows, seq_len, tokenizer.bos_token_id)


def main() -> None:
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.calibrate.pipeline import quantize
    from quantkit.calibrate.recipe import Recipe
    from quantkit.models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("format")
    p.add_argument("algos", nargs="?", default="")
    p.add_argument("--calib", default="embedded")
    p.add_argument("--out", type=Path, default=Path("calibration_domain.jsonl"))
    args = p.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model("demo", dtype=torch.float32)
    windows = lambada_text_windows(tokenizer)
    row = {"format": args.format, "algos": args.algos, "calib": args.calib, "calib_s": None}
    if args.format != "bf16":
        source = None if args.calib == "embedded" else args.calib
        calib = token_samples(load_texts(source, tokenizer), tokenizer, num_samples=16, seq_len=256)
        t = time.time()
        with torch.no_grad():
            quantize(model, Recipe.parse(args.format, args.algos), calib, batch_size=8)
        row["calib_s"] = time.time() - t
    row["lambada_text_ppl"] = perplexity(model, windows)
    print(json.dumps(row), flush=True)
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
