"""Scale-factor layouts kernels read, and their inverses.

Blackwell block-scaled MMAs read scale factors in 128×4 "atoms" (CUTLASS ``BlockScaledBasicChunk``):
for scales ``sf[R, C]`` (R = rows of M or N, C = K / block), padded with zeros to
``R' = ceil(R/128)·128`` and ``C' = ceil(C/4)·4``, the byte of row r, column j sits at

    (r // 128) · rk · 512 + (j // 4) · 512 + (r % 32) · 16 + ((r % 128) // 32) · 4 + (j % 4)

with ``rk = C' / 4``. Each 512-byte atom holds 128 rows × 4 columns.
"""
from __future__ import annotations

import torch


def _padded(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def to_blocked(sf: torch.Tensor) -> torch.Tensor:
    """Row-major scales ``[R, C]`` (any 1-byte dtype) -> flat swizzled ``[R'·C']`` (same dtype)."""
    rows, cols = sf.shape
    rp, cp = _padded(rows, cols)
    raw = sf.view(torch.uint8) if sf.element_size() == 1 else sf
    padded = torch.zeros(rp, cp, dtype=raw.dtype, device=sf.device)
    padded[:rows, :cols] = raw
    # [R'/128, 4, 32, C'/4, 4] (row = a·128 + b·32 + c, col = d·4 + e) -> [a, d, c, b, e]
    out = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    return out.view(sf.dtype) if raw is not sf else out


def from_blocked(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: flat swizzled scales -> row-major ``[rows, cols]``."""
    rp, cp = _padded(rows, cols)
    raw = flat.view(torch.uint8) if flat.element_size() == 1 else flat
    if raw.numel() != rp * cp:
        raise ValueError(f"swizzled scales hold {raw.numel()} bytes; [{rows}, {cols}] needs {rp * cp}")
    sf = raw.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)[:rows, :cols].contiguous()
    return sf.view(flat.dtype) if raw is not flat else sf

