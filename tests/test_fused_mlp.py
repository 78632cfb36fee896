"""`prorl_trl.rollout.fused_mlp`: the gated-MLP kernel against its torch reference.

Under Triton's CPU interpreter where Triton is installed (float32 and float16: Triton 3.6's interpreter multiplies
bf16 operands of `tl.dot` wrongly, so bf16 runs on CUDA only) and on CUDA: with LoRA on gate, up, both or neither,
ranks below a block, strided inputs, rows over one tile, reproducible launches and graph replays. Where the path sits
in the decode step: test_lora_decode (CPU) and test_rollout_engine_gpu (graphs).
"""

from __future__ import annotations


import pytest
import torch

from prorl_trl.rollout.decode_attention import triton_available
from prorl_trl.rollout.fused_mlp import LoraDelta, gated_activation_reference, is_silu, tile_layout


def test_reference_is_the_mlps_function():
    """SiLU(gate) * up with PEFT's additions, from the fused gate/up weight: equal to the projections called apart."""
    generator = torch.Generator().manual_seed(0)
    gate_proj, up_proj = torch.nn.Linear(24, 10, bias=False), torch.nn.Linear(24, 10, bias=False)
    x = torch.randn(4, 24, generator=generator)
    hidden, lora_up = torch.randn(4, 3, generator=generator), torch.randn(10, 3, generator=generator)
    with torch.no_grad():
        expected = torch.nn.functional.silu(gate_proj(x)) * (up_proj(x) + (hidden @ lora_up.T) * 0.5)
        weight = torch.cat([gate_proj.weight, up_proj.weight])
        ours = gated_activation_reference(x, weight, None, LoraDelta(hidden, lora_up, 0.5))
        torch.testing.assert_close(ours, expected)
    assert is_silu(torch.nn.SiLU()) and not is_silu(torch.nn.GELU())
    assert tile_layout(32, 4864) == (32, 32) and tile_layout(70, 100) == (64, 32) and tile_layout(1, 8)[0] == 16


def test_lora_precision_is_the_switch_for_16_bit_models_and_ieee_for_float32(monkeypatch):
    from prorl_trl.rollout import fused_mlp

    assert fused_mlp.lora_precision(torch.bfloat16) == "bf16x3" and fused_mlp.lora_precision(torch.float32) == "ieee"
    monkeypatch.setattr(fused_mlp, "LORA_PRECISION", "tf32x3")
    assert fused_mlp.lora_precision(torch.float16) == "tf32x3"
    monkeypatch.setattr(fused_mlp, "LORA_PRECISION", "tf32")  # one TF32 product: too coarse, refused at launch
    with pytest.raises(ValueError, match="none of"):
        fused_mlp.lora_precision(torch.bfloat16)


def check_kernel(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """The kernel against the reference on `device`; on CUDA also 20 graph replays, bit-identical. Under the CPU
    interpreter the LoRA products are TF32 x 3 (its bf16 conversions are wrong), on CUDA the default bf16 x 3."""
    from prorl_trl.rollout.fused_mlp_triton import launch_gated_activation

    generator = torch.Generator().manual_seed(0)
    precision = {"lora_precision": "tf32x3"} if device == "cpu" else {}
    cases = [(5, 40, 300, 8, 0), (64, 96, 64, 64, 64), (70, 33, 20, 0, 4), (32, 64, 256, 0, 0), (64, 4864, 896, 0, 64)]
    for dtype in dtypes:
        for rows, intermediate, depth, gate_rank, up_rank in cases:
            if device == "cpu" and intermediate > 100:
                continue  # the interpreter is slow; the model-sized case runs on CUDA
            x = torch.randn(rows, depth + 5, generator=generator).to(dtype)[:, 2 : 2 + depth].to(device)
            weight = (torch.randn(2 * intermediate, depth, generator=generator) * 0.1).to(dtype).to(device)
            hidden = torch.randn(rows, gate_rank + up_rank + 3, generator=generator).to(device)  # A products, strided

            def lora_up(rank):
                return (torch.randn(intermediate, rank, generator=generator) * 0.1).to(device)

            gate = LoraDelta(hidden[:, :gate_rank], lora_up(gate_rank), 2.0) if gate_rank else None
            up = LoraDelta(hidden[:, gate_rank : gate_rank + up_rank], lora_up(up_rank), 0.5) if up_rank else None
            layout = tile_layout(rows, intermediate)
            first = launch_gated_activation(x, weight, gate, up, layout, **precision)
            again = launch_gated_activation(x, weight, gate, up, layout, **precision)
            assert torch.equal(again, first), "not reproducible"
            want = gated_activation_reference(x, weight, gate, up)
            assert first.dtype == want.dtype == dtype and first.shape == want.shape
            if dtype == torch.float32:
                torch.testing.assert_close(first, want, atol=1e-4, rtol=1e-5)
            else:  # gate/up rounded to 16 bits in both: a summation-order difference can move one by an ulp
                torch.testing.assert_close(first.float(), want.float(), atol=0.05, rtol=2**-6)
            if device == "cuda":
                assert_graph_replays_equal(lambda: launch_gated_activation(x, weight, gate, up, layout), first)


def assert_graph_replays_equal(launch, first: torch.Tensor, replays: int = 20) -> None:
    """`launch()` captured into a CUDA graph: every replay writes exactly `first`."""
    static = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(launch())
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, first)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed (CPU torch); runs on the GPU machine")
def test_kernel_matches_reference_in_triton_interpreter():
    from test_rollout_engine import run_check_in_triton_interpreter

    run_check_in_triton_interpreter("test_fused_mlp", "check_kernel('cpu', (torch.float32, torch.float16))")


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
def test_kernel_matches_reference_on_cuda_and_replays_from_a_graph():
    check_kernel("cuda", (torch.bfloat16, torch.float16, torch.float32))


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")
@pytest.mark.parametrize("precision", ["bf16x3", "tf32x3", "ieee"])
def test_lora_deltas_keep_float32_precision_on_cuda(precision):
    """bf16 model, float32 r64 adapters on gate and up, 64 rows (the reset-4 shape), zero base weights so the outputs
    are the deltas alone: the kernel's outputs equal torch's (float32 cuBLAS products, TF32 off) except where a
    summation order moves a 16-bit rounding, with the products as three bf16 products of high and low parts
    (`LORA_PRECISION` "bf16x3", the default), three TF32 products or IEEE float32. One TF32 product (10 mantissa
    bits) would move about a tenth of them."""
    from prorl_trl.rollout.fused_mlp_triton import launch_gated_activation

    generator = torch.Generator().manual_seed(3)
    rows, intermediate, depth, rank = 64, 4864, 896, 64
    x = torch.randn(rows, depth, generator=generator).to("cuda", torch.bfloat16)
    weight = torch.zeros(2 * intermediate, depth, dtype=torch.bfloat16, device="cuda")
    gate, up = (LoraDelta(torch.randn(rows, rank, generator=generator).cuda(),
                          torch.randn(intermediate, rank, generator=generator).cuda() * 0.1, 2.0) for _ in range(2))  # fmt: skip
    assert not torch.backends.cuda.matmul.allow_tf32
    want = gated_activation_reference(x, weight, gate, up)
    got = launch_gated_activation(x, weight, gate, up, tile_layout(rows, intermediate), lora_precision=precision)
    differing = (got != want).float().mean().item()
    assert differing < 0.01, differing
    def tf32(t: torch.Tensor) -> torch.Tensor:  # float32 cut to TF32's 10 mantissa bits
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)

    one_tf32 = (((tf32(gate.hidden) @ tf32(gate.up).T) * 2.0).to(torch.bfloat16)
                != ((gate.hidden @ gate.up.T) * 2.0).to(torch.bfloat16)).float().mean().item()  # fmt: skip
    assert one_tf32 > 5 * max(differing, 1e-4), (one_tf32, differing)  # the test could tell a coarser product apart
