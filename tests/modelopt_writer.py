"""Write checkpoints with NVIDIA ModelOpt itself, for ``test_modelopt_checkpoints.py``.

Run in a subprocess (``mtq.quantize`` registers its quantized module classes process-wide)::

    python modelopt_writer.py OUT

For each ModelOpt config of :data:`CONFIGS`: a tiny random Llama (Qwen3-MoE for the ``moe``
cases) in bf16, calibrated with ModelOpt's ``mtq.quantize`` on random tokens, written by its
``export_hf_checkpoint`` to ``OUT/<case>``, with the bf16 model's logits on :data:`TEST_IDS`
before quantization in ``OUT/<case>.reference.safetensors``.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

# case -> (ModelOpt config, or configs joined by "+" whose quantizer lists add up, architecture)
CONFIGS = {
    "fp8": ("FP8_DEFAULT_CFG", "llama"),
    "fp8-dynamic": ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "llama"),
    "fp8-block": ("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "llama"),
    "mxfp8": ("MXFP8_DEFAULT_CFG", "llama"),
    "nvfp4": ("NVFP4_DEFAULT_CFG", "llama"),
    "nvfp4-w4a16": ("W4A16_NVFP4_CFG", "llama"),
    "nvfp4-moe": ("NVFP4_DEFAULT_CFG", "qwen3_moe"),
    "fp8-kv": ("FP8_DEFAULT_CFG+FP8_KV_CFG", "llama"),  # as ModelOpt's hf_ptq.py adds a KV-cache config
}
VOCAB = 256
TEST_IDS = torch.arange(2 * 32).reshape(2, 32) * 7 % VOCAB


def tiny_model(arch: str) -> transformers.PreTrainedModel:
    common = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64}
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=512, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=512, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, **common))
    model.config.architectures = [type(model).__name__]  # export_hf_checkpoint reads it
    return model.to(torch.bfloat16).eval()


CALIB_IDS = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))


def calibrate(model: transformers.PreTrainedModel) -> None:
    """ModelOpt's ``forward_loop``: one batch of 4 × 32 random tokens."""
    model(CALIB_IDS)


def main(out: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    warnings.filterwarnings("ignore")
    for case, (config, arch) in CONFIGS.items():
        torch.manual_seed(0)
        model = tiny_model(arch)
        with torch.no_grad():
            save_file({"logits": model(TEST_IDS).logits.contiguous()}, out / f"{case}.reference.safetensors")
        first, *more = (getattr(mtq, name) for name in config.split("+"))
        merged = {**first, "quant_cfg": [entry for cfg in (first, *more) for entry in cfg["quant_cfg"]]}
        model = mtq.quantize(model, merged, calibrate)
        export_hf_checkpoint(model, export_dir=out / case)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
