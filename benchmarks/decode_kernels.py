"""GPU time of one decoder layer's MLP and attention as the rollout engine runs them, per kernel choice.

For one layer of the Qwen2-0.5B architecture (hidden 896, 2 KV heads of 64, MLP 4,864), each path compiled as the
engine compiles its step and replayed from a CUDA graph, bf16 weights and float32 adapters:

1. The MLP (`lora_decode.gated_mlp` on transformers' `Qwen2MLP` with PEFT's LoRA layers injected where the shape
   adapts it, gate/up base weights fused as the engine fuses them) at the Initial phase (32 rows, r32 on q,k: no
   adapter in the MLP) and the seed's reset-4 shape (64 rows, r64 on all linear layers):
     unfused     `fused_mlp.FUSED_MLP = False`: one cuBLAS GEMM for gate/up, LoRA products, SiLU * up, down_proj
     fused_mlp   the default: gate/up GEMMs, their LoRA B products and SiLU * up as one Triton kernel where gate/up
                 carry adapters; where they carry none the engine keeps the unfused path, and the row is the kernel
                 called directly (the measurement behind that rule)
2. Attention (`decode_attention_triton`) at the Initial shape (32 rows, 14 query / 2 KV heads of 64, a 4,352-column
   cache, left padding up to 100) with 200, 2,000 and 4,096 decoded tokens, per `--attention-configs`
   (BLOCK_N:TARGET_PROGRAMS:NUM_WARPS:fixed|live; `live` = `decode_attention.LIVE_SPLITS`, the default), relative
   error vs the float32 reference.
Every MLP path's outputs are checked against the first row's of its shape (float32 rounding apart). Prints the tables.
(The fourth session's LoRA-product GEMM and base-projection kernels lost to inductor's reductions and cuBLAS here and
were removed: benchmarks/results/rollout_engine.md, fifth session.)

    python benchmarks/decode_kernels.py                      # one GPU
    python benchmarks/decode_kernels.py --smoke              # CPU, eager, no timing that means anything
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph_timing import replay_microseconds  # noqa: E402

from prorl_trl.rollout import fused_mlp, lora_decode  # noqa: E402
from prorl_trl.rollout.fused_weights import copy_members, stack_copies  # noqa: E402
from prorl_trl.rollout.lora_decode import base_linear  # noqa: E402

HIDDEN, MLP = 896, 4864  # Qwen2-0.5B
LAYERS = 24
SHAPES = {  # name: (rows, rank, targets)
    "initial 32 rows r32 q,k": (32, 32, ("q", "k")),
    "reset-4 64 rows r64 all-linear": (64, 64, ("q", "k", "v", "o", "gate", "up", "down")),
}


def gated_mlp_layer(rows: int, rank: int, targets: tuple[str, ...], device: torch.device):
    """transformers' `Qwen2MLP` in bf16 with PEFT LoRA layers (float32, B random) on its targeted projections, its
    gate/up base weights fused as the engine fuses them, and an input; returns `(mlp, fused, x)`."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=MLP, hidden_act="silu")
    mlp = Qwen2MLP(config).to(device=device, dtype=torch.bfloat16)
    adapted = [f"{name}_proj" for name in ("gate", "up", "down") if name in targets]
    if adapted:
        mlp = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=adapted), mlp)
        for name, parameter in mlp.named_parameters():
            if "lora_" in name:
                parameter.data = parameter.data.float()  # PEFT's adapters on a 16-bit base are float32
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.02)
    members = (base_linear(mlp.gate_proj), base_linear(mlp.up_proj))
    buffer = torch.empty(2 * MLP, HIDDEN, device=device, dtype=torch.bfloat16)  # as the engine's arena holds it
    fused = stack_copies(members, buffer, None)
    copy_members(fused)
    x = torch.randn(rows, 1, HIDDEN, device=device).to(torch.bfloat16)
    return mlp.eval(), fused, x


@contextlib.contextmanager
def fused_mlp_switch(on: bool):
    saved = fused_mlp.FUSED_MLP
    fused_mlp.FUSED_MLP = on
    try:
        yield
    finally:
        fused_mlp.FUSED_MLP = saved


def time_path(function, argument, replays: int, graphs: bool) -> tuple[float, list[torch.Tensor]]:
    """Microseconds per `function(argument)` (CUDA graph replays on a GPU; wall clock, eager, on CPU), its outputs."""
    if not graphs:
        begin = time.perf_counter()
        outputs = function(argument)
        return 1e6 * (time.perf_counter() - begin), outputs
    torch._dynamo.reset()  # switches are read when the function is traced
    compiled = torch.compile(function, dynamic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            compiled(argument)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = compiled(argument)
    return replay_microseconds(graph, replays), [output.clone() for output in outputs]


def max_difference(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs, reference, strict=True))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention-configs", default="64:512:4:fixed,64:512:4:live,32:512:4:live,128:512:4:live,"
                        "64:1024:4:live,64:512:8:live", help="Attention kernel settings to time, "
                        "BLOCK_N:TARGET_PROGRAMS:NUM_WARPS:fixed|live, comma-separated.")  # fmt: skip
    parser.add_argument("--replays", type=int, default=200, help="Graph replays per timing.")
    parser.add_argument("--smoke", action="store_true", help="CPU, eager: checks that the script runs (no timings).")
    args = parser.parse_args(argv)
    attention_configs = parse_attention_configs(args.attention_configs)
    graphs = not args.smoke
    if graphs and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke on CPU)")
    device = torch.device("cuda" if graphs else "cpu")
    name = torch.cuda.get_device_name() if graphs else "CPU (smoke)"
    print(f"{name}, torch {torch.__version__}: one layer, x {LAYERS} layers for a decode step")
    rows = []

    def report(table: str, shape: str, path: str, micros: float, outputs, reference) -> None:
        difference = max_difference(outputs, reference)
        rows.append(dict(table=table, shape=shape, path=path, us=micros, difference=difference))
        print(f"| {shape} | {path} | {micros:.1f} | {micros * LAYERS / 1000:.3f} | {difference:.1e} |")

    print("\n**The MLP** (`gated_mlp`)\n\n| shape | path | us per layer | ms per step (x24) "
          "| max abs diff vs first row |\n|---|---|---:|---:|---:|")  # fmt: skip
    with torch.no_grad():
        for shape, (batch, rank, targets) in SHAPES.items():
            mlp, fused, x = gated_mlp_layer(batch, rank, targets, device)

            def whole(argument, mlp=mlp, fused=fused):
                return [lora_decode.gated_mlp(mlp, argument, fused)]

            def kernel_alone(argument, mlp=mlp, fused=fused):  # the kernel where the engine would not take it
                rows = argument.reshape(-1, argument.shape[-1])
                return [mlp.down_proj(fused_mlp.gated_activation(rows, fused.weight)).view(argument.shape)]

            with fused_mlp_switch(False):
                micros, reference = time_path(whole, x, args.replays, graphs)
            report("mlp", shape, "unfused", micros, reference, reference)
            adapted = any(name in targets for name in ("gate", "up"))
            with fused_mlp_switch(True):
                micros, outputs = time_path(whole if adapted else kernel_alone, x, args.replays, graphs)
            report("mlp", shape, "fused_mlp" if adapted else "fused_mlp kernel (not taken)", micros, outputs, reference)

        print("\n**Attention** (32 rows, cache 4,352)\n")
        print("| decoded tokens | BLOCK_N:TARGET:WARPS:splits | keys a split | us per layer | ms per step (x24) "
              "| relative error vs float32 |\n|---:|---|---:|---:|---:|---:|")  # fmt: skip
        for decoded in (200, 2000, 4096):
            for config in attention_configs:
                micros, split, error = time_attention(config, decoded, args.replays, graphs, device)
                label = ":".join(map(str, config))
                rows.append(dict(table="attention", shape=str(decoded), path=label, layout=str(split), us=micros,
                                 difference=error))  # fmt: skip
                print(f"| {decoded} | {label} | {split} | {micros:.1f} | "
                      f"{micros * LAYERS / 1000:.3f} | {error:.1e} |")  # fmt: skip
    return rows


ATTENTION_SHAPE = dict(batch=32, kv_heads=2, groups=7, head_dim=64, cache_len=4352, prompt=256)


def time_attention(config, decoded: int, replays: int, graphs: bool, device) -> tuple[float, int, float]:
    """(microseconds per launch, keys a split, relative error vs the float32 reference) for one kernel setting."""
    from prorl_trl.rollout.decode_attention import gqa_decode_attention_reference, split_size

    block, target, warps, mode = config
    shape = ATTENTION_SHAPE
    generator = torch.Generator(device="cpu").manual_seed(0)
    batch, kv_heads, head_dim = shape["batch"], shape["kv_heads"], shape["head_dim"]
    query = torch.randn(batch, kv_heads * shape["groups"], 1, head_dim, generator=generator)
    keys, values = torch.randn(2, batch, kv_heads, shape["cache_len"], head_dim, generator=generator)
    query, keys, values = (t.to(device=device, dtype=torch.bfloat16) for t in (query, keys, values))
    start = torch.randint(0, 101, (batch,), generator=generator).to(device)  # left padding
    end = torch.tensor([shape["prompt"] + decoded - 1], device=device)
    split = split_size(batch, kv_heads, shape["cache_len"], target=target, block=block)
    reference = gqa_decode_attention_reference(query.float(), keys.float(), values.float(), start, end, 0.125)
    if graphs:
        from prorl_trl.rollout.decode_attention_triton import launch_gqa_decode

        def launch():
            return launch_gqa_decode(query, keys, values, start, end, 0.125, split, block, mode == "live", warps)

        launch()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = launch()
        micros = replay_microseconds(graph, replays)
    else:
        begin = time.perf_counter()
        output = gqa_decode_attention_reference(query, keys, values, start, end, 0.125)
        micros = 1e6 * (time.perf_counter() - begin)
    error = float((output.float() - reference).norm() / reference.norm())
    return micros, split, error


def parse_attention_configs(text: str) -> list[tuple[int, int, int, str]]:
    configs = []
    for item in text.split(","):
        parts = item.split(":")
        numbers_ok = len(parts) == 4 and all(part.isdigit() and int(part) > 0 for part in parts[:3])
        if not numbers_ok or parts[3] not in ("fixed", "live"):
            raise SystemExit(f"--attention-configs: {item!r} is not BLOCK_N:TARGET_PROGRAMS:NUM_WARPS:fixed|live")
        configs.append((int(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return configs


if __name__ == "__main__":
    main()
