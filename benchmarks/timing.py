"""Shared timing for the GPU benchmarks: median µs per call from CUDA-graph replays."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

L2_BYTES = 50 * 2**20  # Hopper's L2 (H100 / H200)


def copies_for(nbytes: int) -> int:
    """How many copies of an ``nbytes`` input to rotate over so replays read > 3x L2 (1-16)."""
    return max(1, min(16, -(-3 * L2_BYTES // max(nbytes, 1))))


def rotated(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and as many clones as :func:`copies_for` its bytes asks, to rotate a timed input over."""
    return [t] + [t.clone() for _ in range(copies_for(t.numel() * t.element_size()) - 1)]


def graph_median_us(fns: list[Callable[[], object]], reps: int = 15, warm_s: float = 0.05) -> float:
    """Median µs per call of ``fns`` (each called once per replay, e.g. one per rotated input copy),
    from ``reps`` CUDA-graph replays timed with events after a warm-up pass on a side stream and
    ``warm_s`` seconds of untimed replays: the GPU's clock drops while the host compiles a kernel
    in the warm-up pass, and a few replays alone would time the first contender on a slow clock."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture stream: compile, allocate workspaces
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    start = time.perf_counter()
    while True:
        graph.replay()
        torch.cuda.synchronize()
        if time.perf_counter() - start >= warm_s:
            break
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def interleaved_us(contenders: dict[object, list[Callable[[], object]]], rounds: int = 3, reps: int = 9,
                   on_error: Callable[[object], None] | None = None) -> dict[object, list[float]]:
    """Per contender, its :func:`graph_median_us` in each of ``rounds`` rounds that time every
    contender in turn (so a drifting clock affects all of them alike). With ``on_error``, a
    contender that raises is passed to it (inside the ``except``) and left out from then on."""
    times = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, fns in contenders.items():
            if label not in times:
                continue
            try:
                times[label].append(graph_median_us(fns, reps=reps))
            except Exception:
                if on_error is None:
                    raise
                on_error(label)
                del times[label]
    return times


def medians(times: dict[object, list[float]]) -> dict[object, float]:
    """The median of each contender's rounds from :func:`interleaved_us`."""
    return {label: statistics.median(t) for label, t in times.items()}
