"""Data-parallel calibration over ``torch.distributed`` ranks (one rank per GPU, started by ``torchrun``).

Every rank holds the whole model and calibrates every decoder layer, but runs only its shard of the
calibration batches through it. Before a layer's algorithms run, the observers' statistics are
all-reduced (:mod:`quantkit.calibrate.observers`), and algorithms that measure an output error on
the layer's outputs sum it over ranks (:func:`all_reduce_sum`), so every rank chooses the same
scales and quantized weights. Without an initialized process group (or with one rank) every
function here is the identity and calibration is the single-process one.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when none is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on the rank that writes files and prints (rank 0, or the only process)."""
    return world()[0] == 0


def init_from_env() -> bool:
    """Initialize the default process group from ``torchrun``'s environment (``WORLD_SIZE`` > 1):
    NCCL with ``cuda:{LOCAL_RANK}`` as the current device when CUDA is present, else gloo. Returns
    True when this process is one of several ranks; does nothing in a single-process run."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(rank_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def rank_device() -> torch.device:
    """Where this rank calibrates: ``cuda:{LOCAL_RANK}`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def shard(batches: Sequence[T]) -> list[T]:
    """This rank's calibration batches: every ``world_size``-th one from ``rank`` on (all of them in
    a single-process run). Raises ``ValueError`` when some rank would get none."""
    rank, size = world()
    if len(batches) < size:
        raise ValueError(f"{len(batches)} calibration batches cannot feed {size} ranks: "
                         "use more samples or a smaller --batch-size")
    return list(batches[rank::size])


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over the ranks in place (``op``: ``"sum"`` or ``"max"``) and return it.
    The collective runs on a copy on the rank's device when the backend cannot use the tensor's
    (gloo needs CPU tensors, NCCL CUDA ones)."""
    if world()[1] == 1:
        return tensor
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if tensor.device == device:
        dist.all_reduce(tensor, reduce_op)
    else:
        moved = tensor.to(device)
        dist.all_reduce(moved, reduce_op)
        tensor.copy_(moved)
    return tensor


def all_reduce_sum(value: float) -> float:
    """The sum of a Python float over the ranks (in float64); ``value`` itself in a single-process run."""
    if world()[1] == 1:
        return value
    return all_reduce_(torch.tensor([value], dtype=torch.float64)).item()
