"""Checkpoint files on disk: atomic directory writes, sharded safetensors, and a checked reader.

Safetensors only, never pickle. :func:`atomic_directory` builds a checkpoint in a hidden sibling
directory, fsyncs every file, and only then renames it into place: a save that fails or is
interrupted leaves either the previous directory untouched or no directory at all (at worst a
hidden ``.NAME.tmp-*`` sibling, which has no ``config.json`` until the very end of the save).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's "5GB": larger checkpoints are sharded with an index


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file and the problem."""


@contextmanager
def atomic_directory(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``out_dir``; on a clean exit move it to ``out_dir``.

    Every file written into it gets the permissions a new file gets under the process umask
    (safetensors writes its files owner-only, which would hide the weights from, say, a vLLM server
    run as another user) and is fsynced before the rename. An existing ``out_dir`` is replaced
    only where :func:`check_output_dir` allows it and the new checkpoint writes every file it
    holds: nothing but the previous checkpoint is ever deleted. On an exception the temporary
    directory is removed and ``out_dir`` is left as it was.
    """
    out = check_output_dir(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        mode = 0o666 & ~_umask()
        for path in tmp.rglob("*"):
            if path.is_file():
                path.chmod(mode)
                _fsync(path)
        _fsync(tmp)
        if out.exists() and (extra := sorted({p.name for p in out.iterdir()} - {p.name for p in tmp.iterdir()})):
            raise FileExistsError(f"{out} holds files the new checkpoint does not write ({', '.join(extra[:5])}); "
                                  "refusing to replace it: move them away or choose another output directory")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.model", "*.jinja", "merges.txt", "vocab.txt")  # what a save writes


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """The absolute path of ``out_dir`` if a checkpoint may be written there, else ``FileExistsError``
    naming why: it may be absent, an empty directory, or a quantized checkpoint (``quantization_config``
    in its ``config.json``) holding only checkpoint files (config, safetensors, tokenizer), which
    the new one replaces. Anything else (a file, the bf16 model being quantized, a folder with
    notes in it) is refused, as is a path below a file. Cheap: call it before the work."""
    out = Path(out_dir).absolute()
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FileExistsError(f"cannot write {out}: {parent} is a file, not a directory")
            break
    if not out.exists():
        return out
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is a file, not a checkpoint directory; refusing to replace it")
    entries = list(out.iterdir())
    if not entries:
        return out
    try:
        quantized = "quantization_config" in read_json(out / CONFIG)
    except CheckpointError:
        quantized = False
    if not quantized:
        raise FileExistsError(f"{out} exists and is not a quantized checkpoint directory; refusing to replace it")
    other = sorted(p.name for p in entries if p.is_dir() or not any(p.match(g) for g in _CHECKPOINT_FILES))
    if other:
        raise FileExistsError(f"{out} holds files besides a checkpoint ({', '.join(other[:5])}); refusing to "
                              "replace it: move them away or choose another output directory")
    return out


def _umask() -> int:
    """The process umask: from ``/proc/self/status`` where Linux has it, else by setting it and
    setting it back (for that instant another thread's new file would get 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is renamed aside first and removed after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    _fsync(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, obj: object) -> None:
    """Write ``obj`` as indented, key-sorted JSON."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; :class:`CheckpointError` if it is missing or not a JSON object."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def write_safetensors(tensors: Mapping[str, torch.Tensor], directory: Path,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as numbered shards of at most ``max_shard_bytes``
    (a single larger tensor gets a shard of its own) plus ``model.safetensors.index.json`` like
    Hugging Face does. Tensors must be contiguous CPU tensors sharing no storage. Returns the file names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / WEIGHTS, metadata={"format": "pt"})
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, directory / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(directory / INDEX, {"metadata": {"total_size": total},
                                   "weight_map": {t: f for f, shard in zip(names, shards) for t in shard}})
    return names + [INDEX]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry in a safetensors header: file, dtype (safetensors name, e.g. ``F8_E4M3``), shape, bytes."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > os.path.getsize(path) - 8:
                raise ValueError(f"header length {length} exceeds the file size")
            header = json.loads(f.read(length))
        return {name: TensorInfo(path.name, e["dtype"], tuple(e["shape"]), e["data_offsets"][1] - e["data_offsets"][0])
                for name, e in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as err:
        raise CheckpointError(f"{path}: not a valid safetensors file ({err})") from None


class CheckpointTensors:
    """The tensors of a checkpoint directory (``model.safetensors`` or an index of shards): header
    metadata up front, tensors read on demand by :meth:`take`, which checks dtype and shape and
    records what was read so that :meth:`untaken` can name tensors nothing asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        if (directory / INDEX).is_file():
            weight_map = read_json(directory / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{directory / INDEX}: missing or empty 'weight_map'")
            files = sorted(set(weight_map.values()))
        elif (directory / WEIGHTS).is_file():
            weight_map, files = None, [WEIGHTS]
        else:
            raise CheckpointError(f"{directory}: no {WEIGHTS} or {INDEX} (safetensors weights) found")
        self.info: dict[str, TensorInfo] = {}
        self._handles = {}
        for file in files:
            path = directory / file
            if not path.is_file():
                raise CheckpointError(f"{directory / INDEX}: shard {file} is missing")
            self.info.update(_read_header(path))
            try:
                self._handles[file] = safe_open(path, framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path}: not a valid safetensors file ({err})") from None
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.info or self.info[name].file != file:
                    raise CheckpointError(f"{directory / INDEX}: tensor {name!r} is not in {file}")
        self._taken: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.info

    def take(self, name: str, dtypes: tuple[torch.dtype, ...] = (), shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read tensor ``name``, checking its dtype is one of ``dtypes`` (any if empty) and its shape
        is ``shape`` (``()`` also accepts ``(1,)``: both spellings of a scalar occur in the wild)."""
        if name not in self.info:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        file = self.directory / self.info[name].file
        try:
            t = self._handles[self.info[name].file].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({err})") from None
        if dtypes and t.dtype not in dtypes:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, expected {want}")
        if shape is not None and tuple(t.shape) != shape and not (shape == () and tuple(t.shape) == (1,)):
            raise CheckpointError(f"{file}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        self._taken.add(name)
        return t

    def untaken(self) -> list[str]:
        """Names of the tensors no :meth:`take` has read."""
        return sorted(set(self.info) - self._taken)
