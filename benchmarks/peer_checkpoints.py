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
  ``mtq.quantize``, written by ``export_hf_checkpoint``. ModelOpt's NVFP4 fake quantization,
  which its AWQ and MSE / local-Hessian / 4-over-6 searches run, is a CUDA kernel (Triton); on a
  machine without CUDA it is replaced by the same function in plain torch
  (``_modelopt_nvfp4_fake_quant_in_torch``), ModelOpt's algorithms otherwise unchanged.
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


def _fp4_round_magnitude(a: torch.Tensor) -> torch.Tensor:
    """``|x| / scale`` to the nearest E2M1 magnitude, ties to even, saturating at 6: ModelOpt's
    ``fp4_round_magnitude`` (``kernels/quantization/common/nvfp4_quant.py``)."""
    w = torch.where
    return w(a <= 0.25, 0.0, w(a < 0.75, 0.5, w(a <= 1.25, 1.0, w(a < 1.75, 1.5, w(
        a <= 2.5, 2.0, w(a < 3.5, 3.0, w(a <= 5.0, 4.0, 6.0)))))))


def _fp4_fake_quant_block(x: torch.Tensor, global_amax: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """ModelOpt's dynamic NVFP4 fake quantization, the Triton ``fp4_fake_quant_block``
    (``kernels/quantization/gemm/fp4_kernel_hopper.py``) in torch: per block of 16 along the last
    axis (a partial last block zero-padded, as the kernel's tiles), scale = block amax / 6 in units
    of the global scale ``global_amax / (6 * 448)``, saturated at 448 and rounded to E4M3
    (``fp8_quantize_scale``); a dequantized scale below 1e-5 is replaced by 1, as the kernel does."""
    shape, dtype = x.shape, x.dtype
    x = x.reshape(-1, shape[-1]).float()
    x = torch.nn.functional.pad(x, (0, -shape[-1] % block_size))
    x = x.view(x.shape[0], -1, block_size)
    global_scale = global_amax.float() / (6.0 * 448.0)
    global_scale = torch.where(global_scale > 0.0, global_scale, 1e-12)
    x_abs = x.abs()
    block_max = x_abs.amax(dim=-1, keepdim=True)
    scale = (block_max / (6.0 * global_scale)).clamp(max=448.0)
    scale = scale.to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= 1e-5, scale, 1.0)
    y = _fp4_round_magnitude(x_abs / scale) * scale
    y = torch.where(x >= 0, y, -y)
    return y.view(y.shape[0], -1)[:, : shape[-1]].reshape(shape).to(dtype)


def _compute_fp4_scales(amax, global_amax=None, quantize_block_scales=True, fp8_max_for_normalization=448.0):
    """ModelOpt's ``compute_fp4_scales`` (``kernels/quantization/gemm/fp4_kernel.py``, pure torch,
    restated because that module imports Triton): amax / 6, rounded to E4M3 by ModelOpt's
    ``scaled_e4m3_impl`` under ``global_amax · (448 / fp8_max_for_normalization) / 6``."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl
    from modelopt.torch.quantization.utils import reduce_amax

    amax = amax.float()
    scale = amax / 6.0
    if quantize_block_scales:
        if global_amax is None:
            global_amax = reduce_amax(amax, axis=None, keepdims=False, squeeze_scalar=True)
        global_amax = global_amax.float()
        scale = scaled_e4m3_impl(scale, global_amax * (448.0 / fp8_max_for_normalization) / 6.0)
    return scale


def _static_blockwise_fp4_fake_quant(x, amax, global_amax=None, quantize_block_scales=True,
                                     fp8_max_for_normalization=448.0, out_dtype=None) -> torch.Tensor:
    """ModelOpt's static NVFP4 fake quantization, the Triton ``static_blockwise_fp4_fake_quant``
    (``kernels/quantization/gemm/fp4_kernel.py``; its kernel runs ``nvfp4_scalar_quant`` on each
    block) in torch: one given amax
    per block of ``x.numel() / amax.numel()`` consecutive elements; a zero block scale zeroes its
    block, a NaN or infinite one is replaced by 1."""
    blocks = amax.numel()
    if x.numel() % blocks != 0:
        raise ValueError(f"x.numel() ({x.numel()}) is not divisible by amax.numel() ({blocks})")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    scale = _compute_fp4_scales(amax, global_amax, quantize_block_scales, fp8_max_for_normalization)
    scale = scale.contiguous().view(blocks, 1).float()
    xb = x.contiguous().view(blocks, -1).float()
    zero_scale = scale == 0.0
    scale = torch.where(zero_scale | scale.isnan() | scale.isinf(), 1.0, scale)
    y = _fp4_round_magnitude(xb.abs() / scale) * scale
    y = torch.where(zero_scale, 0.0, torch.where(xb >= 0, y, -y))
    return y.to(out_dtype).view(x.shape)


def _modelopt_nvfp4_fake_quant_in_torch() -> None:
    """Replace ModelOpt's two CUDA-only NVFP4 fake-quantization (quantize-dequantize) kernels with
    the same functions in torch (above), so that its NVFP4 recipes calibrate on CPU; ModelOpt's
    algorithms (AWQ, the MSE / local-Hessian / 4-over-6 searches) are left as they are.

    ModelOpt (0.47) fake-quantizes NVFP4 in two places, both GPU-only:

    - dynamic blocks (``"type": "dynamic"``: NVFP4 activations, and the weights of the max and
      AWQ recipes): ``tensor_quant._dynamic_block_quantize_impl`` (the ``dynamic_block_quantize_op``
      that ``DynamicBlockQuantizationFunction`` calls) asserts a CUDA amax, then runs the Triton
      kernel ``fp4_fake_quant_block`` (what an H100 runs; without Triton, the CUDA extension's
      ``fused_amax_convert``): replaced by :func:`_fp4_fake_quant_block` for NVFP4 on CPU tensors;
    - static blocks (``"type": "static"``: the weights of the MSE, local-Hessian and 4-over-6
      recipes, whose searches quantize each candidate through it):
      ``StaticBlockwiseFP4FakeQuantFunction.forward`` requires Triton to run
      ``static_blockwise_fp4_fake_quant``: replaced by :func:`_static_blockwise_fp4_fake_quant`.

    Both equal ModelOpt's own torch NVFP4 (``NVFP4QTensor.quantize`` then ``dequantize``) to the
    bit, up to the sign of zeros (the kernels return -0.0 for small negatives), on random normal
    weights with outliers; they differ from it only where the Triton kernel does (a block whose
    E4M3 scale is below 1e-5 is zeroed, where ``NVFP4QTensor`` clamps the scale to 2^-9).
    """
    import modelopt.torch.quantization.tensor_quant as tq

    modelopt_op = tq.dynamic_block_quantize_op

    def dynamic_block_quantize_op(inputs, block_size, amax, num_bits, exponent_bits,
                                  scale_num_bits, scale_exponent_bits):
        nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4)
        if not nvfp4 or amax is None or inputs.is_cuda:
            return modelopt_op(inputs, block_size, amax, num_bits, exponent_bits,
                               scale_num_bits, scale_exponent_bits)
        if amax.numel() != 1:
            amax = amax.amax()
        return _fp4_fake_quant_block(inputs, amax)  # as ModelOpt calls the kernel: blocks of 16

    def static_forward(ctx, x, amax, global_amax=None, quantize_block_scales=True,
                       fp8_max_for_normalization=448.0, out_dtype=None, pass_through_bwd=False):
        tq._save_for_backward_if_needed(ctx, pass_through_bwd, x, amax)
        return _static_blockwise_fp4_fake_quant(x, amax, global_amax, quantize_block_scales,
                                                fp8_max_for_normalization, out_dtype)

    tq.dynamic_block_quantize_op = dynamic_block_quantize_op
    tq.StaticBlockwiseFP4FakeQuantFunction.forward = staticmethod(static_forward)


def modelopt(model, recipe: str, calib: torch.Tensor, out: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    if not torch.cuda.is_available():
        _modelopt_nvfp4_fake_quant_in_torch()

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
