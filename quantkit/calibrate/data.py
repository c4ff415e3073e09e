"""Calibration sets: where the text comes from and how it becomes token batches.

A *source* is one of:

- ``None`` / ``"default"``: the embedded corpus shipped in ``quantkit/calibrate/corpus/`` (xz-compressed,
  works offline);
- a local ``.txt`` (blank-line separated passages), ``.jsonl`` / ``.json`` / ``.parquet`` file of
  records (each a string, or an object with a ``text``, ``content``, ``document`` or ``prompt``
  string or chat ``messages``; a ``.json`` file holds a list of them or ``{"data": [...]}``), or a
  directory of such files (suffixes in any case);
- a Hugging Face hub dataset id, optionally ``name:config`` (e.g. ``wikitext:wikitext-2-raw-v1``).
"""
from __future__ import annotations

import json
import lzma
import random
from importlib import resources
from pathlib import Path

import torch

CORPUS_PACKAGE = "quantkit.calibrate"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


class CalibrationDataError(ValueError):
    """The calibration data could not be found, read or turned into samples."""


TEXT_FIELDS = ("text", "content", "document", "prompt")


def _record_text(record, tokenizer) -> str | None:
    """The text of one record (module docstring); ``None`` if it has none."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("messages"), list) and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    for key in TEXT_FIELDS:
        if isinstance(record.get(key), str):
            return record[key]
    if isinstance(record.get("messages"), list):
        return "\n".join(str(m.get("content", "")) for m in record["messages"])
    return None


def _texts(records: list, tokenizer, where: str) -> list[str]:
    """The non-empty texts of ``records``; records that all lack one are an error naming their keys."""
    texts = [_record_text(r, tokenizer) for r in records]
    if records and all(t is None for t in texts):
        keys = sorted({k for r in records if isinstance(r, dict) for k in r})
        raise CalibrationDataError(f"{where}: no record has a text ({'keys: ' + ', '.join(keys) if keys else type(records[0]).__name__}); "
                                   f"quantkit reads strings, {'/'.join(TEXT_FIELDS)} fields or chat messages")
    return [t for t in texts if t and t.strip()]


def _read_file(path: Path, tokenizer) -> list[str]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return [p.strip() for p in path.read_text(encoding="utf-8-sig").split("\n\n") if p.strip()]
        if suffix == ".jsonl":
            records = []
            for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
                try:
                    records += [json.loads(line)] if line.strip() else []
                except json.JSONDecodeError as err:
                    raise CalibrationDataError(f"{path}: line {number} is not JSON ({err})") from None
        elif suffix == ".json":
            loaded = json.loads(path.read_text(encoding="utf-8-sig"))
            records = loaded if isinstance(loaded, list) else loaded.get("data", [loaded])
        else:
            import datasets

            records = list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CalibrationDataError(f"{path}: not UTF-8 {'text' if suffix == '.txt' else 'JSON'} ({err})") from None
    return _texts(records, tokenizer, str(path))


def _from_hub(spec: str, tokenizer) -> list[str]:
    import datasets

    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None)
    except Exception as err:  # offline, unknown id, gated, ...
        raise CalibrationDataError(f"cannot load dataset {spec!r} from the hub ({type(err).__name__}: {err}); "
                                   "pass a local .txt/.jsonl/.parquet file or omit --calib for the embedded corpus") from None
    split = next((s for s in ("train", "train_sft", "validation", "test") if s in ds), next(iter(ds)))
    return _texts(list(ds[split]), tokenizer, f"dataset {spec!r} ({split})")


def load_texts(source: str | Path | None = None, tokenizer=None) -> list[str]:
    """The non-empty text passages of ``source`` (see the module docstring for what it may be)."""
    if source in (None, "default"):
        corpus = resources.files(CORPUS_PACKAGE) / "corpus"  # xz-compressed text files
        return [t for f in sorted(corpus.iterdir(), key=lambda f: f.name) if f.name.endswith(".txt.xz")
                for t in lzma.decompress(f.read_bytes()).decode("utf-8").split("\n\n") if t.strip()]
    path = Path(source)
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.suffix.lower() in LOCAL_SUFFIXES and f.is_file())
        if not files:
            raise CalibrationDataError(f"directory {path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
        texts = [t for f in files for t in _read_file(f, tokenizer)]
    elif path.suffix.lower() in LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise CalibrationDataError(f"calibration file {path} does not exist")
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise CalibrationDataError(f"calibration file {path}: unsupported type (use {', '.join(LOCAL_SUFFIXES)})")
        texts = _read_file(path, tokenizer)
    else:
        texts = _from_hub(str(source), tokenizer)
    if not texts:
        raise CalibrationDataError(f"calibration data {source} is empty")
    return texts


def token_samples(texts: list[str], tokenizer, *, num_samples: int = 128, seq_len: int = 512, seed: int = 0,
                  max_length: int | None = None) -> torch.Tensor:
    """``int64 [num_samples, seq_len]`` windows of the concatenated token stream of ``texts``.

    Passages are shuffled with ``seed``, tokenized, joined with EOS and cut into consecutive
    non-overlapping windows (the stream repeats if it is shorter than ``num_samples·seq_len``).
    ``max_length``: the model's context; a longer ``seq_len`` is an error."""
    if max_length is not None and seq_len > max_length:
        raise CalibrationDataError(f"sequence length {seq_len} exceeds the model's context length {max_length}")
    if seq_len < 1 or num_samples < 1:
        raise CalibrationDataError(f"need seq_len >= 1 and num_samples >= 1, got {seq_len}, {num_samples}")
    order = list(texts)
    random.Random(seed).shuffle(order)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    need = num_samples * seq_len
    for text in order:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        if len(stream) >= need:
            break
    if not stream:
        raise CalibrationDataError("calibration texts produced no tokens")
    reps = -(-need // len(stream))
    ids = torch.tensor((stream * reps)[:need], dtype=torch.long).reshape(num_samples, seq_len)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and getattr(tokenizer, "add_bos_token", True):
        ids[:, 0] = bos
    return ids
