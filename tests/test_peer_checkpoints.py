"""``benchmarks/peer_checkpoints.py`` runs ModelOpt's NVFP4 recipes on CPU by replacing its
GPU-only NVFP4 fake quantization with the same function in torch: checked here against ModelOpt's
own torch NVFP4 (``NVFP4QTensor.quantize`` then ``dequantize``), bit for bit up to the sign of
zeros, on weight-like tensors with outliers, through ModelOpt's own entry points."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import modelopt.torch.quantization.tensor_quant as tq
import peer_checkpoints as pc
from modelopt.torch.quantization.qtensor import NVFP4QTensor

pc._modelopt_nvfp4_fake_quant_in_torch()


def weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    idx = torch.randint(0, x.numel(), (x.numel() // 500,), generator=g)  # 0.2 % outliers, 10-80x
    x.view(-1)[idx] *= torch.empty(len(idx)).uniform_(10, 80, generator=g)
    return x * 0.02


def modelopt_qdq(x, global_amax, block_scale=None):
    scale_2 = global_amax.float() / (6.0 * 448.0) if block_scale is None else torch.tensor(1.0)
    q, s, s2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor=block_scale, weights_scaling_factor_2=scale_2)
    return q.dequantize(dtype=x.dtype, scale=s, double_scale=s2, block_sizes={-1: 16})


def same_up_to_zero_signs(a, b):
    differ = a.view(torch.int32) != b.view(torch.int32)
    return bool(((a[differ] == 0) & (b[differ] == 0)).all())


@pytest.mark.parametrize("shape", [(640, 2048), (8, 64, 640)])
@pytest.mark.parametrize("global_factor", [1.0, 0.5, 3.0])  # 0.5: block scales saturate at 448
def test_dynamic_nvfp4_fake_quant_equals_modelopts_torch_nvfp4(shape, global_factor):
    x = weights(shape, seed=len(shape))
    global_amax = x.abs().amax() * global_factor
    expect = modelopt_qdq(x, global_amax)
    assert same_up_to_zero_signs(pc._fp4_fake_quant_block(x, global_amax), expect)
    # through ModelOpt's own entry point, as its quantizers call it on CPU
    via = tq.dynamic_block_quant(x, 16, global_amax.reshape(1), None, (2, 1), (4, 3))
    assert same_up_to_zero_signs(via, expect)


@pytest.mark.parametrize("fp8_max", [448.0, 256.0])  # 256: the Four Over Six recipe's normalization
def test_static_nvfp4_fake_quant_equals_modelopts_torch_nvfp4(fp8_max):
    x = weights((1024, 256), seed=3).reshape(-1, 16)
    g = torch.Generator().manual_seed(4)
    amax = x.abs().amax(-1) * torch.empty(x.shape[0]).uniform_(0.4, 1.3, generator=g)  # search candidates
    global_amax = x.abs().amax(-1).max()
    got = tq.static_blockwise_fp4_fake_quant(x, amax, global_amax, True, fp8_max, x.dtype)
    scale = pc._compute_fp4_scales(amax, global_amax, True, fp8_max).view(-1, 1)
    assert same_up_to_zero_signs(got, modelopt_qdq(x, global_amax, block_scale=scale))


def test_tiny_blocks_are_zeroed_as_the_triton_kernel_does():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    x[:4] *= 1e-5  # dequantized E4M3 block scale below 1e-5
    ours = pc._fp4_fake_quant_block(x, x.abs().amax())
    expect = modelopt_qdq(x, x.abs().amax())
    assert (ours[:4] == 0).all() and (expect[:4] != 0).any()
    assert same_up_to_zero_signs(ours[4:], expect[4:])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7, 640), (64, 2048), (33, 1000), (128, 4096)])
@pytest.mark.parametrize("global_factor", [1.0, 0.25])  # 0.25: block scales saturate at 448
def test_torch_copy_equals_modelopts_triton_kernels_on_cuda(shape, global_factor):
    # float32 inputs, as the peer recipes calibrate here (on bfloat16 inputs some exact E2M1
    # rounding ties come out the other way in the Triton kernel: docs/accuracy.md)
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel import static_blockwise_fp4_fake_quant
    from modelopt.torch.kernels.quantization.gemm.fp4_kernel_hopper import fp4_fake_quant_block

    x = weights(shape, seed=5).cuda()
    global_amax = x.abs().amax() * global_factor
    assert same_up_to_zero_signs(pc._fp4_fake_quant_block(x, global_amax), fp4_fake_quant_block(x, global_amax))
    if x.numel() % 16 == 0:
        blocks = x.reshape(-1, 16)
        amax = blocks.abs().amax(-1) * torch.empty(blocks.shape[0], device="cuda").uniform_(0.4, 1.3)
        assert same_up_to_zero_signs(pc._static_blockwise_fp4_fake_quant(blocks, amax, global_amax),
                                     static_blockwise_fp4_fake_quant(blocks, amax, global_amax))
