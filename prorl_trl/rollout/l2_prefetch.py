"""Pull a layer's weights into the GPU's L2 cache on a side stream while the decode step's small kernels run.

Why: at 32 rows a decode step is ~290 kernels, most bound by latency rather than bandwidth (attention's split
kernel, norms, rotary, the small q/k/v and o GEMMs), so HBM idles through most of a layer; then the gate/up and down
GEMMs (17 and 9 MB a layer at Qwen2-0.5B) run with too few tiles to reach HBM's bandwidth at 32 rows (cuBLAS at
2.4 and 1.1 TB/s on an H200, benchmarks/results/rollout_engine.md). Prefetched, those GEMMs read L2 instead.

How: at a layer's start the step forks a side stream (an event recorded on the step's stream, waited on by the side
stream: inside a CUDA-graph capture that makes a parallel branch of the graph) and launches a few programs there that
issue PTX `prefetch.global.L2::evict_last` over the weights' bytes: no data comes back to the SMs and nothing is
written, so the result of the step cannot change. The end of the step joins the side stream back (a capture must).

Switches (read when a step is traced, so part of the engine's capture key): `PREFETCH_MLP` (the layer's gate/up and
down weights at its start), `PREFETCH_NEXT_ATTENTION` (the next layer's q/k/v and o weights at this layer's MLP).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .decode_attention import triton_available

PREFETCH_MLP = False
PREFETCH_NEXT_ATTENTION = False
PROGRAMS = 16  # side-stream programs per prefetch: few, so the step's own kernels keep nearly every SM
LINE_BYTES = 128  # an L2 line

_pending: list[torch.cuda.Event] = []  # side-stream work not yet joined (each prefetch's end)
_streams: dict[torch.device, torch.cuda.Stream] = {}


def enabled() -> bool:
    return PREFETCH_MLP or PREFETCH_NEXT_ATTENTION


def prefetchable(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a prefetch can cover: CUDA, contiguous (their bytes one range), non-empty; none without Triton."""
    if not triton_available():
        return []
    return [tensor for tensor in tensors if tensor.is_cuda and tensor.is_contiguous() and tensor.numel() > 0]


def prefetch(tensors: Sequence[torch.Tensor], order: torch.Tensor | None) -> None:
    """Start pulling `tensors` into L2 on the side stream (nothing where none is prefetchable or `order` is None).

    `order`: a one-element tensor the op declares it writes (it writes nothing), so `torch.compile` keeps every
    prefetch and the join in program order instead of dropping an op without outputs."""
    tensors = prefetchable(tensors)
    if tensors and order is not None:
        torch.ops.prorl_rollout.l2_prefetch(tensors, order)


def join(order: torch.Tensor | None) -> None:
    """Make the current stream wait for every prefetch started since the last join."""
    if order is not None and order.is_cuda:
        torch.ops.prorl_rollout.l2_prefetch_join(order)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


@torch.library.custom_op("prorl_rollout::l2_prefetch", mutates_args=("order",))
def _prefetch_op(tensors: list[torch.Tensor], order: torch.Tensor) -> None:
    """Opaque to torch.compile; its event wait, launches and event record are recorded into the CUDA graph."""
    from .l2_prefetch_triton import launch_prefetch

    current = torch.cuda.current_stream(order.device)
    side = _side_stream(order.device)
    fork = torch.cuda.Event()
    fork.record(current)
    side.wait_event(fork)
    with torch.cuda.stream(side):
        for tensor in tensors:
            launch_prefetch(tensor, PROGRAMS, LINE_BYTES)
    done = torch.cuda.Event()
    done.record(side)
    _pending.append(done)


@_prefetch_op.register_fake
def _(tensors, order):
    return None


@torch.library.custom_op("prorl_rollout::l2_prefetch_join", mutates_args=("order",))
def _join_op(order: torch.Tensor) -> None:
    current = torch.cuda.current_stream(order.device)
    while _pending:
        current.wait_event(_pending.pop())


@_join_op.register_fake
def _(order):
    return None
