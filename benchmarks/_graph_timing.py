"""Timing a captured CUDA graph, shared by the kernel benchmarks."""

from __future__ import annotations

import torch


def replay_microseconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay of `graph`, after one untimed replay, between CUDA events."""
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * begin.elapsed_time(end) / replays
