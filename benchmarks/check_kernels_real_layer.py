"""Kernel path vs reference path on a real model's decoder layer (Gemma-3-270M, layer 6).

``--capture DIR`` (CPU, needs the demo extra): saves the weights of the layer's k/v/o projections
and the real bf16 inputs each one sees for 64 calibration tokens (``DIR/layer.safetensors``, ~2 MB:
small enough to travel to the GPU machine beside the CuTeDSL bundle).
``--check DIR`` (GPU): for each format, QuantLinear on CUDA (the kernel the dispatcher picks) vs the
CPU reference on those inputs: relative error and whether the output's argmax per row agrees.
"""
import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LAYER = 6
LINEARS = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
FORMATS = ("fp8-block", "nvfp4-w4a16", "nvfp4")


def capture(out: Path) -> None:
    from quantkit.calibrate.data import load_texts, token_samples
    from quantkit.models import load_model

    model, tok = load_model("demo")
    ids = token_samples(load_texts(None), tok, num_samples=1, seq_len=64)
    layer = model.model.layers[LAYER]
    tensors, hooks = {}, []
    for name, lin in layer.named_modules():
        if name in LINEARS:
            tensors[f"{name}.weight"] = lin.weight.detach().contiguous()
            hooks.append(lin.register_forward_pre_hook(lambda m, a, n=name: tensors.__setitem__(f"{n}.input", a[0][0].detach().clone())))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "layer.safetensors")
    print(f"saved {len(tensors)} tensors to {out}")


def check(src: Path) -> None:
    from quantkit import kernels
    from quantkit.nn import QuantLinear

    tensors = load_file(src / "layer.safetensors")
    names = sorted(k[: -len(".weight")] for k in tensors if k.endswith(".weight"))
    print(f"{'format':12s} {'linear':18s} {'backend':18s} {'rel err':>9s} {'argmax agree':>12s}")
    for fmt in FORMATS:
        for name in names:
            w, x = tensors[f"{name}.weight"], tensors[f"{name}.input"].to(torch.bfloat16)
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            q = QuantLinear.from_linear(lin, fmt)
            ref = q(x).float()
            qc = q.cuda()
            backend = kernels.select_backend(x.cuda(), qc.qweight, qc.epilogue)
            out = qc(x.cuda()).float().cpu()
            rel = ((out - ref).norm() / ref.norm()).item()
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"{fmt:12s} {name:18s} {backend.name if backend else 'reference':18s} {rel:9.2e} {agree:12.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--capture", type=Path)
    ap.add_argument("--check", type=Path)
    args = ap.parse_args()
    if args.capture:
        capture(args.capture)
    if args.check:
        check(args.check)
