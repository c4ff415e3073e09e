"""Load checkpoints with vLLM's own model loader on CPU and run its quantized linear layers.

Run by ``test_vllm_serving.py`` in a subprocess whose ``PYTHONPATH`` holds vLLM's Python sources
(see ``vllm_env.py``)::

    python vllm_driver.py JOBS.json
    # JOBS: [{"checkpoint": DIR, "inputs": FILE, "outputs": FILE, "dump": [MODULE, ...],
    #         "moe_backend": "emulation" (NVFP4 experts) or "triton" (FP8 experts)}, ...]

For each job vLLM parses ``config.json``, picks its quantization scheme per layer, creates its
parameters and fills them through its weight loaders (q/k/v and gate/up stacked, MoE experts
stacked into ``w13_*`` / ``w2_*``, as it serves them). Each entry of ``inputs`` (a vLLM module
name -> ``[T, K]`` bf16) is fed to that module after vLLM's per-layer
``process_weights_after_loading``; ``outputs`` gets ``[T, N]`` per module, and ``MODULE:PARAM``
for every parameter of those modules and of the ``dump`` modules as loaded (before the
post-processing). Prints one line ``RESULT {json}`` per job: the checkpoint, the quantization
config class, the scheme class per layer, the parameters no checkpoint tensor filled, and per
module the error its forward raised, if any; or ``refused``: the error vLLM raised while building
or loading the model.

No vLLM kernel library exists on CPU. The run uses vLLM's own emulation kernels where vLLM has
them (NVFP4 W4A4; MXFP8, whose emulation leaves activations unquantized) and, for NVFP4
weight-only layers, whose registry has no emulation, vLLM's NVFP4 weight dequantization
(``dequantize_to_dtype``) followed by a matmul. Where vLLM selects only GPU kernels (FP8 blocks,
MXFP4, static FP8 activations, MoE experts) the layer is built and loaded, and its forward
reported as an error. Settings only a CPU run needs: the target device is forced to CPU, the CPU
platform's requirement of triton-cpu is lifted, and MoE layers use vLLM's NVFP4 emulation or
Triton (FP8, MXFP8) experts with their device checks lifted (they are built and loaded, never run).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_TARGET_DEVICE"] = "cpu"

import torch
from safetensors.torch import load_file, save_file
from vllm.platforms import PlatformEnum
from vllm.platforms.cpu import CpuPlatform

CpuPlatform.check_and_update_config = classmethod(lambda cls, config: None)

import vllm.model_executor.kernels.linear as kernels
import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_mxfp4 as ct_mxfp4
import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 as ct_nvfp4
import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8 as ct_fp8
from vllm.config import (
    KernelConfig,
    LoadConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import (
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.model_executor.kernels.linear.mxfp8.emulation import (
    EmulationMxfp8LinearKernel,
)
from vllm.model_executor.kernels.linear.nvfp4.emulation import (
    EmulationNvFp4LinearKernel,
)
from vllm.model_executor.layers.fused_moe.experts.mxfp8_native_moe import (
    Mxfp8NativeTritonExperts,
)
from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
    Nvfp4QuantizationEmulationTritonExperts,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model


class WeightOnlyNvFp4Emulation(EmulationNvFp4LinearKernel):
    """vLLM's NVFP4 weight dequantization, then a bf16 matmul (activations unquantized)."""

    def apply_weights(self, layer, x, bias=None):
        w = dequantize_to_dtype(layer.weight.data.view(torch.uint8), layer.weight_scale.data,
                                layer.weight_global_scale, x.dtype, 16, swizzle=False)
        y = x @ w.t()
        return y if bias is None else y + bias


def nvfp4_kernel(use_a16: bool = False):
    kernel = WeightOnlyNvFp4Emulation if use_a16 else EmulationNvFp4LinearKernel
    return kernel(kernels.NvFp4LinearLayerConfig())


class NoCpuKernel:
    """Stands in where vLLM selects only GPU kernels: loading runs, the forward raises."""

    def __init__(self, reason: str):
        self.reason = reason

    def process_weights_after_loading(self, layer) -> None:
        pass

    def input_quant_key(self):
        return None

    def apply_weights(self, layer, x, bias=None):
        raise NotImplementedError(self.reason)


def or_no_cpu_kernel(select):
    def selected(*args, **kwargs):
        try:
            return select(*args, **kwargs)
        except ValueError as e:
            return NoCpuKernel(str(e).splitlines()[0])
    return selected


kernels._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CPU] = [EmulationMxfp8LinearKernel]
ct_nvfp4.init_nvfp4_linear_kernel = modelopt.init_nvfp4_linear_kernel = nvfp4_kernel
# vLLM's NVFP4 MoE emulation runs Triton kernels: let it build on CPU, so the experts load.
Nvfp4QuantizationEmulationTritonExperts._supports_current_device = staticmethod(lambda: True)
# FP8 MoE: vLLM's Triton experts, with their device and scheme checks lifted for the same purpose.
TritonExperts._supports_current_device = staticmethod(lambda: True)
TritonExperts._supports_quant_scheme = staticmethod(lambda *args, **kwargs: True)
Mxfp8NativeTritonExperts._supports_current_device = staticmethod(lambda: True)  # MXFP8 MoE: likewise
ct_mxfp4.init_mxfp4_linear_kernel = or_no_cpu_kernel(ct_mxfp4.init_mxfp4_linear_kernel)
ct_fp8.init_fp8_linear_kernel = or_no_cpu_kernel(ct_fp8.init_fp8_linear_kernel)
modelopt.init_fp8_linear_kernel = or_no_cpu_kernel(modelopt.init_fp8_linear_kernel)


def serve(path: str, inputs_file: str, outputs_file: str, dump: list[str], moe_backend: str) -> dict:
    """Load ``path`` with vLLM, run the modules named in ``inputs_file``, write their parameters and
    those of the modules in ``dump``; the result line's dict."""
    model_config = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(),
                        kernel_config=KernelConfig(moe_backend=moe_backend))
    result = {"quant_config": type(config.quant_config).__name__, "errors": {}}
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{outputs_file}.rendezvous")
        if model_parallel_is_initialized():  # the groups depend on the model (MoE: expert parallel)
            destroy_model_parallel()
        initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            model = initialize_model(vllm_config=config)
        result["schemes"] = {n: type(getattr(m, "scheme", m.quant_method)).__name__
                             for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None}
        loader = DefaultModelLoader(config.load_config)  # its file discovery: index, shards
        loaded = model.load_weights(loader.get_all_weights(model_config, model))
        result["unloaded"] = sorted(set(dict(model.named_parameters())) - set(loaded))
        inputs = load_file(inputs_file)
        outputs = {f"{name}:{param}": value.detach().clone() for name in dict.fromkeys([*inputs, *dump])
                   for param, value in model.get_submodule(name).named_parameters(recurse=False)}
        with torch.no_grad():
            for name, x in inputs.items():
                module = model.get_submodule(name)
                try:  # what vLLM's process_weights_after_loading does per layer, then the layer
                    module.quant_method.process_weights_after_loading(module)
                    # vLLM's lm_head is applied by its logits processor, not called
                    y = module.quant_method.apply(module, x) if isinstance(module, ParallelLMHead) else module(x)
                except Exception as e:  # noqa: BLE001 - reported: vLLM has no CPU code for it
                    result["errors"][name] = f"{type(e).__name__}: {e}"
                    continue
                outputs[name] = (y[0] if isinstance(y, tuple) else y).contiguous()
        save_file(outputs, outputs_file)
    return result


def main(jobs_file: str) -> None:
    for job in json.loads(Path(jobs_file).read_text()):
        try:
            result = serve(job["checkpoint"], job["inputs"], job["outputs"], job.get("dump", []),
                           job.get("moe_backend", "emulation"))
        except Exception as e:  # noqa: BLE001 - reported: vLLM refused the checkpoint
            result = {"refused": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps({"checkpoint": job["checkpoint"], **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
