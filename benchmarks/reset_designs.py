"""Which hard reset keeps a phase's learning on a bf16 base? Four designs side by side, on the CPU, in ~1 minute.

    python benchmarks/reset_designs.py              # the table in benchmarks/results/exact_resets.md
    python benchmarks/reset_designs.py --smoke      # a few seconds (tests/test_benchmark_reset_designs.py)

Designs (issue 27), each run through the same three phases on the same bf16 model:
  merge (round to nearest)  W <- bf16(W + delta): today's merge (`lora_reset_mode: merge`)
  stochastic rounding       W <- bf16 rounded up or down at random, in proportion (unbiased, noisy)
  float32 master            M <- M + delta in float32, W <- bf16(M): what verl's FSDP actor and DeepSpeed keep
  frozen factors            the adapter kept beside W (`lora_reset_mode: frozen`, prorl_trl.reset.frozen)
A phase gives every LoRA layer (r4 on q,k,v,o) the steepest rank-r step on a probe's loss, scaled so that 99 % of its
elements are under half a bf16 step of their weight: what a phase at the recipes' learning rates leaves (most of its
delta under half a step, ../shared/notes/low-precision-resets.md). The model is the tiny Qwen2 at width 128 (at 64
such a delta moves the log-probs less than bf16 evaluation itself does). Per design: the share of each phase's effect on the
probe's log-probs that its reset kept (1 - |after - before| / |before - adapter off|), and after three resets the
distance from a float32 model with the same base weights and the sum of the same deltas, in units of bf16 evaluation
noise (how far the unchanged bf16 model is from itself evaluated in float32), with the share of the learned change
that is off.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from prorl_trl.reset import (  # noqa: E402
    freeze_lora_delta,
    lora_layers,
    merge_lora_in_place,
    merged_state_dict,
    reinit_adapter,
)
from prorl_trl.tiny import build_tiny  # noqa: E402

DESIGNS = ("merge (round to nearest)", "stochastic rounding", "float32 master", "frozen factors")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def log_probs(model, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float()[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, probe[:, 1:, None])[..., 0]


def phase_delta(model, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """Set every adapter to the steepest rank-r step on the probe's loss, 99 % of its elements under half a bf16 step
    of their weight; return each layer's delta (float32)."""
    layers = lora_layers(model)
    weights = [layer.base_layer.weight for _, layer in layers]
    for weight in weights:
        weight.requires_grad_(True)
    model.zero_grad()
    model(input_ids=probe, labels=probe).loss.backward()
    deltas = {}
    with torch.no_grad():
        for (name, layer), weight in zip(layers, weights):
            gradient, weight.grad = weight.grad.float(), None
            weight.requires_grad_(False)
            rank, scaling = layer.r["default"], layer.scaling["default"]
            left, values, right = torch.linalg.svd(gradient, full_matrices=False)
            step = -(left[:, :rank] * values[:rank]) @ right[:rank]
            half_step = weight.float().abs().clamp_min(1e-3) / 256
            size = torch.quantile((half_step / step.abs().clamp_min(1e-12)).flatten(), 0.005)
            layer.lora_A["default"].weight.copy_(right[:rank])
            layer.lora_B["default"].weight.copy_(-(left[:, :rank] * values[:rank]) * size / scaling)
            deltas[name] = (layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float()) * scaling
    return deltas


def stochastic_bf16(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """bf16 rounding up or down at random, with the probability of each in proportion to the distance (unbiased)."""
    bits = values.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536: keep the upper 16 bits


@torch.no_grad()
def reset(design: str, model, deltas: dict[str, torch.Tensor], masters: dict, generator: torch.Generator, seed: int):
    if design == "frozen factors":
        freeze_lora_delta(model)
    elif design == "merge (round to nearest)":
        merge_lora_in_place(model)
    else:
        for name, layer in lora_layers(model):
            weight = layer.base_layer.weight
            if design == "float32 master":
                masters[name] = masters.get(name, weight.float()) + deltas[name]
                weight.copy_(masters[name].to(torch.bfloat16))
            else:
                weight.copy_(stochastic_bf16(weight.float() + deltas[name], generator))
    reinit_adapter(model, seed=seed)


def run(design: str, width: int, phases: int, probe: torch.Tensor) -> dict:
    config = dict(hidden_size=width, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    base = build_tiny(seed=0, **config)[0].to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).eval()
    exact = build_tiny(seed=0, **config)[0]  # float32, with the bf16 base weights
    exact.load_state_dict({k: v.float() for k, v in merged_state_dict(model).items()})
    with model.disable_adapter():
        start = log_probs(model, probe)
    start_exact = log_probs(exact, probe)
    total, masters, kept = {}, {}, []
    generator = torch.Generator().manual_seed(0)
    for phase in range(phases):
        deltas = phase_delta(model, probe)
        for name, delta in deltas.items():
            total[name] = total.get(name, 0) + delta
        before = log_probs(model, probe)
        with model.disable_adapter():
            adapter_off = log_probs(model, probe)
        reset(design, model, deltas, masters, generator, seed=phase)
        kept.append(1 - ((log_probs(model, probe) - before).norm() / (before - adapter_off).norm()).item())
    with torch.no_grad():
        modules = dict(exact.named_modules())
        for name, delta in total.items():
            modules[name.removeprefix("base_model.model.")].weight.add_(delta)
    noise = (start - start_exact).norm().item()
    final, final_exact = log_probs(model, probe), log_probs(exact, probe)
    learned, learned_exact = final - start, final_exact - start_exact
    return {
        "design": design,
        "kept": kept,
        "distance_in_noise": (final - final_exact).norm().item() / noise,
        "learned_change_off": ((learned - learned_exact).norm() / learned_exact.norm()).item(),
        "effect_in_noise": learned_exact.norm().item() / noise,
    }


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        f"CPU ({meta['threads']} threads), {meta['date']}, torch {meta['torch']}: tiny Qwen2 width {meta['width']}, "
        "bf16, "
        f"LoRA r4 on q,k,v,o, {meta['phases']} phases, each delta 99 % under half a bf16 step; the learned change is "
        f"{rows[0]['effect_in_noise']:.1f}x bf16 evaluation noise",
        "",
        "| reset design | phase effect kept at each reset | distance from float32 after the resets (x noise) | "
        "learned change off |",
        "| --- | --- | ---: | ---: |",
    ]
    for row in rows:
        kept = ", ".join(f"{100 * k:.0f} %" for k in row["kept"])
        off = 100 * row["learned_change_off"]
        lines.append(f"| {row['design']} | {kept} | {row['distance_in_noise']:.2f} | {off:.0f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="width 64, 2 phases: checks the script runs")
    parser.add_argument("--phases", type=int, default=3)
    options = parser.parse_args(argv)
    width, phases = (64, 2) if options.smoke else (128, options.phases)
    probe = torch.arange(3, 40).reshape(1, -1)
    rows = [run(design, width, phases, probe) for design in DESIGNS]
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "width": width, "phases": phases,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}  # fmt: skip
    print(render(rows, meta))
    return rows


if __name__ == "__main__":
    main()
