"""Quantize a model with a peer toolkit's own recipe and write its checkpoint, for
``accuracy_gemma.py --checkpoints`` to evaluate beside quantkit's recipes.

Runs in the peer's environment (only the peer and transformers are imported). ModelOpt installs
beside quantkit (``nvidia-modelopt``, a test dependency); llm-compressor pins transformers ≤ 5.17
and compressed-tensors 0.19, so it gets its own virtualenv:
``python -m venv /tmp/lcenv && /tmp/lcenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1``.

    python benchmarks/peer_checkpoints.py modelopt NVFP4_DEFAULT_CFG --model DIR --calib calib.safetensors --out OUT
    /tmp/lcenv/bin/python benchmarks/peer_checkpoints.py llmcompressor awq:NVFP4 --model DIR --calib ... --out OUT

``--calib`` holds ``ids`` ``[samples, seq_len]``, the calibration tokens ``accuracy_gemma.py
--calib-dump`` writes (the same samples quantkit calibrates on). The model is calibrated in
float32 and written with the peer's exporter (unquantized tensors in float32), lm_head left
unquantized as in quantkit's default:

- ``modelopt CONFIG``: ``modelopt.torch.quantization.CONFIG`` (e.g. ``NVFP4_DEFAULT_CFG``,
  ``W4A16_NVFP4_CFG``, ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``, ``MXFP8_DEFAULT_CFG``) through
  ``mtq.quantize``, written by ``export_hf_checkpoint``. On CPU ModelOpt runs only its max
  calibration: its NVFP4 fake quantization, which AWQ and its MSE searches run, needs CUDA.
- ``llmcompressor [awq:|gptq:]SCHEME``: llm-compressor's ``oneshot`` with a
  ``QuantizationModifier`` (round to nearest, its min-max observers), ``AWQModifier`` or
  ``GPTQModifier`` for the compressed-tensors preset ``SCHEME`` (``NVFP4``, ``NVFP4A16``,
  ``FP8_BLOCK``, ``MXFP8``), ``ignore=["lm_head"]``, saved compressed by ``save_pretrained``. On
  CPU its pinning of cached activations (for host-to-GPU copies) is made a no-op: AWQ fails on it.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def modelopt(model, recipe: str, calib: torch.Tensor, out: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    def forward_loop(m) -> None:
        for batch in calib.split(8):
            m(batch)

    mtq.quantize(model, getattr(mtq, recipe), forward_loop)
    export_hf_checkpoint(model, export_dir=out)


def llmcompressor(model, recipe: str, calib: torch.Tensor, out: Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.cuda.is_available():  # AWQ pins its cached activations for host-to-GPU copies
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None

    algo, _, scheme = recipe.rpartition(":")
    modifier = {"": QuantizationModifier, "awq": AWQModifier, "gptq": GPTQModifier}[algo]
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    oneshot(model=model, dataset=data, recipe=modifier(targets="Linear", scheme=scheme, ignore=["lm_head"]),
            max_seq_length=calib.shape[1], num_calibration_samples=calib.shape[0])
    model.save_pretrained(out, save_compressed=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peer", choices=["modelopt", "llmcompressor"])
    p.add_argument("recipe")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    p.add_argument("--calib", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    calib = load_file(args.calib)["ids"]
    t = time.time()
    {"modelopt": modelopt, "llmcompressor": llmcompressor}[args.peer](model, args.recipe, calib, args.out)
    AutoTokenizer.from_pretrained(args.model).save_pretrained(args.out)
    (args.out / "calibration_seconds.txt").write_text(f"{time.time() - t:.1f}\n")
    print(f"{args.peer} {args.recipe}: {args.out} ({time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
