"""MXFP4 with a per-block, error-chosen E8M0 exponent (session 18; a measurement, not a format).

Each 32-block keeps the OCP floor exponent ``e`` or takes ``e + 1``, whichever reconstructs the
block with the lower squared error (the MX analogue of Four Over Six), for weights and dynamic
activations alike, by replacing ``MXElement.scales`` for E2M1 elements; then runs
``benchmarks/accuracy_gemma.py`` with the remaining arguments:

    python benchmarks/mxfp4_exponent_choice.py floor  --no-bf16 --formats mxfp4 --algos rtn --tag @floor  --out R.json
    python benchmarks/mxfp4_exponent_choice.py choose --no-bf16 --formats mxfp4 --algos rtn --tag @choose --out R.json
"""
import runpy
import sys
from pathlib import Path

import torch

from quantkit.formats import mx
from quantkit.formats.codecs import e8m0_from_amax


def chosen_scales(self: mx.MXElement, x: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes ``[..., K/32]``: per block the OCP exponent or the next one up, by squared error."""
    floor = e8m0_from_amax(mx._blocks(x).abs().amax(-1), self.max, self.round_up)
    if self.bits != 4:
        return floor
    up = (floor.int() + (floor < 254).int()).to(torch.uint8)
    blocks = mx._blocks(x)

    def error(scale):
        return (mx._blocks(self.decode(self.encode(x, scale), scale)) - blocks).pow(2).sum(-1)

    return torch.where(error(up) < error(floor), up, floor)


if __name__ == "__main__":
    if sys.argv.pop(1) == "choose":
        mx.MXElement.scales = chosen_scales
    script = Path(__file__).with_name("accuracy_gemma.py")
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")
