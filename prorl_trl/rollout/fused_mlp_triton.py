"""Triton kernel of `fused_mlp.gated_activation` (imported only where Triton is installed).

One program per `(BLOCK_M rows, BLOCK_N columns)` tile of the `(rows, intermediate)` output: it accumulates the gate
and the up GEMM for its columns over the whole input width (`K` in `BLOCK_K` slices; 16-bit weights on tensor cores
with float32 accumulation, float32 weights in IEEE float32), rounds each to the weights' dtype (what the base GEMM
returns), adds each LoRA delta `(hidden @ B.T) * scaling` in float32 and rounds again (PEFT), and stores
`SiLU(gate) * up` computed in float32. Each weight element is read once a launch (per row tile).

The deltas' float32 products (`lora_dot`, `fused_mlp.LORA_PRECISION`): IEEE float32 (CUDA cores) for float32
models; for 16-bit models three bf16 tensor-core products of each operand's high and low bf16 parts ("bf16x3", ~16
mantissa bits) or three TF32 products ("tf32x3", ~21 bits), whose error is far below the 16-bit rounding the sum then
goes through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def lora_dot(a, b, PRECISION: tl.constexpr):
    """`a @ b` of float32 tiles in float32: "bf16x3" as three bf16 tensor-core products of the operands' high parts
    (rounded to bf16) and low parts (the remainders, rounded), the small terms first; else `tl.dot` at `PRECISION`
    ("tf32x3", "ieee")."""
    if PRECISION == "bf16x3":
        a_high = a.to(tl.bfloat16)
        a_low = (a - a_high.to(tl.float32)).to(tl.bfloat16)
        b_high = b.to(tl.bfloat16)
        b_low = (b - b_high.to(tl.float32)).to(tl.bfloat16)
        product = tl.dot(a_low, b_high)
        product = tl.dot(a_high, b_low, product)
        return tl.dot(a_high, b_high, product)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _add_lora(base, Hidden, Up, rows, cols, M, N, stride_h, scaling, RANK: tl.constexpr, BLOCK_R: tl.constexpr,
              PRECISION: tl.constexpr):  # fmt: skip
    ranks = tl.arange(0, BLOCK_R)
    hidden = tl.load(Hidden + rows[:, None] * stride_h + ranks[None, :],
                     mask=(rows < M)[:, None] & (ranks < RANK)[None, :], other=0.0)  # fmt: skip
    up_mask = (cols < N)[:, None] & (ranks < RANK)[None, :]
    up = tl.load(Up + cols[:, None] * RANK + ranks[None, :], mask=up_mask, other=0.0)
    delta = lora_dot(hidden, tl.trans(up), PRECISION) * scaling
    return (base.to(tl.float32) + delta).to(base.dtype)


@triton.jit
def _gated_kernel(
    X, W, GateHidden, GateUp, UpHidden, UpUp, Out,
    M, stride_xm, stride_gh, stride_uh, gate_scaling, up_scaling,
    N: tl.constexpr, K: tl.constexpr, GATE_RANK: tl.constexpr, UP_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATE_BLOCK_R: tl.constexpr, UP_BLOCK_R: tl.constexpr, IEEE: tl.constexpr, LORA_PRECISION: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offsets = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + offsets
        live = ks < K
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None] & live[None, :], other=0.0)
        w_mask = (cols < N)[:, None] & live[None, :]
        w_gate = tl.load(W + cols[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(W + (N + cols)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
        if IEEE:
            gate += tl.dot(x, tl.trans(w_gate), input_precision="ieee")
            up += tl.dot(x, tl.trans(w_up), input_precision="ieee")
        else:
            gate += tl.dot(x, tl.trans(w_gate))
            up += tl.dot(x, tl.trans(w_up))
    gate = gate.to(Out.dtype.element_ty)  # the base GEMM's output
    up = up.to(Out.dtype.element_ty)
    if GATE_RANK > 0:
        gate = _add_lora(gate, GateHidden, GateUp, rows, cols, M, N, stride_gh, gate_scaling, GATE_RANK, GATE_BLOCK_R,
                         LORA_PRECISION)  # fmt: skip
    if UP_RANK > 0:
        up = _add_lora(up, UpHidden, UpUp, rows, cols, M, N, stride_uh, up_scaling, UP_RANK, UP_BLOCK_R, LORA_PRECISION)
    gate = gate.to(tl.float32)
    activated = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(Out + rows[:, None] * N + cols[None, :], activated.to(Out.dtype.element_ty), mask=inside)


def _rank_block(delta) -> tuple[int, int]:
    if delta is None:
        return 0, 16
    rank = delta.up.shape[1]
    return rank, max(16, triton.next_power_of_2(rank))


def launch_gated_activation(
    x: torch.Tensor, weight: torch.Tensor, gate, up, layout: tuple[int, int], block_k: int = 128, num_warps: int = 4,
    num_stages: int = 3, lora_precision: str = "bf16x3",
) -> torch.Tensor:
    """`x (rows, in)` with unit stride along `in`; `weight (2 x intermediate, in)` contiguous, gate rows first; LoRA
    `hidden (rows, rank)` float32 with unit stride along `rank`, `up (intermediate, rank)` float32 contiguous (each a
    `fused_mlp.LoraDelta`, or None). `lora_precision`: the deltas' products where `x` is 16-bit ("bf16x3", "tf32x3"
    or "ieee"; `lora_dot`); IEEE float32 for float32 `x` always."""
    rows, depth = x.shape
    intermediate = weight.shape[0] // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    gate, up = (
        None if d is None
        else d._replace(hidden=d.hidden if d.hidden.stride(1) == 1 else d.hidden.contiguous(), up=d.up.contiguous(),
                        scaling=float(d.scaling))
        for d in (gate, up)
    )  # fmt: skip
    (gate_rank, gate_block), (up_rank, up_block) = _rank_block(gate), _rank_block(up)
    block_m, block_n = layout
    out = torch.empty(rows, intermediate, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(intermediate, block_n), triton.cdiv(rows, block_m))
    _gated_kernel[grid](
        x, weight,
        gate.hidden if gate else out, gate.up if gate else out, up.hidden if up else out, up.up if up else out, out,
        rows, x.stride(0), gate.hidden.stride(0) if gate else 0, up.hidden.stride(0) if up else 0,
        gate.scaling if gate else 0.0, up.scaling if up else 0.0,
        N=intermediate, K=depth, GATE_RANK=gate_rank, UP_RANK=up_rank,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(depth))),
        GATE_BLOCK_R=gate_block, UP_BLOCK_R=up_block, IEEE=x.dtype == torch.float32,
        LORA_PRECISION=lora_precision if x.dtype != torch.float32 else "ieee",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
