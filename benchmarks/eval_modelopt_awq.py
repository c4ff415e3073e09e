"""Evaluate a ModelOpt ``NVFP4_AWQ`` checkpoint with benchmarks/accuracy_gemma.py --checkpoints.

quantkit.load reads ModelOpt ``NVFP4`` but not ``NVFP4_AWQ``, which is NVFP4 plus a per-input-channel
``pre_quant_scale`` on the layers whose AWQ scale ModelOpt's exporter could not fold into a preceding
norm (here o_proj and down_proj: Gemma3 is not in its PQS_FUSE_MODULE_MAPPING). This makes an
``NVFP4`` view of the checkpoint (the same tensors without the ``pre_quant_scale`` ones, quant_algo
NVFP4) and, in this process only, wraps quantkit.export.load to multiply each such layer's input by
its ``pre_quant_scale`` in a forward pre-hook, as ModelOpt's input quantizer does before it quantizes
(TensorQuantizer.forward: ``inputs = inputs * self.pre_quant_scale``). Then runs accuracy_gemma.main.

    python benchmarks/eval_modelopt_awq.py SRC VIEW LABEL OUT_JSON [accuracy_gemma.py options]

vLLM (0.34) does not load ``NVFP4_AWQ`` either (its ModelOpt config knows NVFP4, not NVFP4_AWQ).
"""
import json
import os
import runpy
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

src, view, label, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
view.mkdir(exist_ok=True)
for f in src.iterdir():
    if f.name not in ("model.safetensors", "config.json", "hf_quant_config.json") and not (view / f.name).exists():
        os.symlink(f, view / f.name)
sd = load_file(src / "model.safetensors")
pqs = {k.removesuffix(".pre_quant_scale"): sd.pop(k) for k in list(sd) if k.endswith(".pre_quant_scale")}
print(f"{len(pqs)} pre_quant_scale tensors:", sorted({k.split('.')[-1] for k in pqs}), flush=True)
if not (view / "model.safetensors").exists():
    save_file(sd, view / "model.safetensors", metadata={"format": "pt"})
del sd
for name, section in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
    cfg = json.loads((src / name).read_text())
    assert cfg[section]["quant_algo"] == "NVFP4_AWQ", cfg[section]
    cfg[section]["quant_algo"] = "NVFP4"
    (view / name).write_text(json.dumps(cfg, indent=2))

import quantkit.export as qe

_load = qe.load


def load(directory, **kwargs):
    model = _load(directory, **kwargs)
    if Path(directory).resolve() == view.resolve():
        modules = dict(model.named_modules())
        for name, scale in pqs.items():
            modules[name].register_forward_pre_hook(lambda m, args, s=scale: (args[0] * s, *args[1:]))
        print(f"applied {len(pqs)} pre_quant_scale hooks", flush=True)
    return model


qe.load = load
sys.argv = ["accuracy_gemma.py", "--no-bf16", "--formats", "--checkpoints", f"{label}={view}", "--out", out, *sys.argv[5:]]
runpy.run_path(str(Path(__file__).with_name("accuracy_gemma.py")), run_name="__main__")
