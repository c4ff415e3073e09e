"""A plain streaming read in Triton: what direct vector loads (no shared-memory ring) get out of a
buffer's bytes, as a floor for the decode GEMVs (``gemm_nvfp4.py --floors``). Needs a GPU and Triton."""
import torch
import triton
import triton.language as tl

# (int32 words per load step, steps per program, warps): 16-64 KB per program, 4 or 8 warps
VARIANTS = ((2048, 4, 4), (2048, 16, 4), (4096, 4, 8), (4096, 16, 8), (8192, 8, 8), (1024, 32, 4))


@triton.jit
def _xor_read(src, out, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """``out[pid]`` = XOR of the ``BLOCK * STEPS`` int32 words from ``pid * BLOCK * STEPS`` (so no
    load can be dropped); 16-byte vector loads, one contiguous run per program."""
    pid = tl.program_id(0)
    offs = pid * BLOCK * STEPS + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for _ in range(STEPS):
        acc ^= tl.load(src + offs, mask=offs < n, other=0)
        offs += BLOCK
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def reader(buf: torch.Tensor, block: int, steps: int, warps: int):
    """A no-argument callable that reads every byte of ``buf`` (a multiple of 4 bytes) once."""
    words = buf.view(torch.int32).reshape(-1)
    grid = (triton.cdiv(words.numel(), block * steps),)
    out = torch.empty(grid[0], dtype=torch.int32, device=buf.device)
    return lambda: _xor_read[grid](words, out, words.numel(), BLOCK=block, STEPS=steps, num_warps=warps)
