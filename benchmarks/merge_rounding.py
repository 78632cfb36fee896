"""How far a LoRA hard reset moves a bf16 model's outputs, and why: the delta the merge rounds away vs bf16's floor.

    python benchmarks/merge_rounding.py --out benchmarks/results/merge_rounding.md   # on the GPU if there is one
    python benchmarks/merge_rounding.py --smoke                                      # CPU, the tiny test model

scale_out.py's model (Qwen2-0.5B's width, 8 of its layers, untied head, random init) with scale_out's first LoRA
phase (r16/alpha32 on q,v), trained with AdamW at lr 1e-4 for a growing number of steps (next-token loss on fixed
random sequences), then reset as `ProRLTrainer.hard_reset` does (`merge_lora_in_place`, then B = 0). Per row: how far
the adapter moves the logits (on vs off), the reset's max |Δlogits| on the same batch, the share of the delta's norm
the merge rounded away (`prorl_trl.reset.MergeRounding`, what the trainer logs as `prorl/merge_delta_lost`), and the
bf16 spacing at the largest |logit| (one step of the logits' own resolution). The float32 rows are the control.
The floor columns evaluate the same trained model (adapter on, no reset) on the same batch two other valid ways:
row by row instead of as one batch, and with transformers' eager attention instead of SDPA: how far the logits move
when nothing about the function changes, only the order of its roundings.

What it shows: early on (scale_out's 3 steps) the delta is under half a bf16 step of most weights and the merge
rounds most of it away, so the reset moves the outputs by about the adapter's whole effect; later the merge keeps
almost all of it and the reset moves the logits by a few bf16 steps of their own, which no merge into bf16 storage
avoids: as far as switching the unchanged model to another attention implementation moves them. In float32 the reset
is exact to float32 rounding.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

STEPS = (3, 30, 300)
SMOKE_STEPS = (1, 3)


def bf16_spacing(value: float) -> float:
    """The distance from `value` to the next bf16 number away from zero (8 bits of mantissa)."""
    exponent = torch.frexp(torch.tensor(abs(value), dtype=torch.float32)).exponent.item()
    return 2.0 ** (exponent - 8)


def build(dtype: torch.dtype, device: str, smoke: bool):
    from peft import LoraConfig, get_peft_model
    from scale_out import small_config
    from transformers import Qwen2ForCausalLM

    from prorl_trl.tiny import build_tiny

    _, tokenizer = build_tiny(seed=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(small_config(tokenizer, smoke)).to(dtype=dtype, device=device)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, config), len(tokenizer)


def measure(dtype: torch.dtype, steps: int, device: str, smoke: bool) -> dict:
    from prorl_trl.reset import lora_layers, merge_lora_in_place

    model, vocab = build(dtype, device, smoke)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, vocab, (8, 32), generator=generator).to(device)
    probe = torch.randint(0, vocab, (2, 16), generator=generator).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        before = model(input_ids=probe).logits.float()
        row_by_row = torch.cat([model(input_ids=row[None]).logits.float() for row in probe])
        inner = model.get_base_model()
        attention = inner.config._attn_implementation
        inner.set_attn_implementation("eager")
        eager = model(input_ids=probe).logits.float()
        inner.set_attn_implementation(attention)
        with model.disable_adapter():
            without = model(input_ids=probe).logits.float()
        rounding = merge_lora_in_place(model)
        for _, layer in lora_layers(model):
            layer.lora_B["default"].weight.zero_()
        after = model(input_ids=probe).logits.float()
    largest = float(before.abs().max())
    moved = float((after - before).abs().max())
    return {
        "dtype": str(dtype).removeprefix("torch."), "steps": steps,
        "adapter_effect": float((before - without).abs().max()), "reset_dlogits": moved,
        "lost_percent": 100 * rounding.lost_fraction, "max_logit": largest,
        "spacing": bf16_spacing(largest), "in_steps": moved / bf16_spacing(largest),
        "floor_rows": float((row_by_row - before).abs().max()), "floor_eager": float((eager - before).abs().max()),
    }  # fmt: skip


def table(rows: list[dict], device: str) -> str:
    lines = [
        f"Device: {device} | date (UTC): {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M}",
        "",
        "| base dtype | AdamW steps (lr 1e-4) | adapter's effect, max abs dlogits | reset's max abs dlogits "
        "| merge rounded away (% of the delta's norm) | max abs logit | bf16 step there "
        "| reset's dlogits in bf16 steps | floor: row by row, max abs dlogits "
        "| floor: eager attention, max abs dlogits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['steps']} | {r['adapter_effect']:.3g} | {r['reset_dlogits']:.3g} | "
            f"{r['lost_percent']:.1f} | {r['max_logit']:.2f} | {r['spacing']:.4g} | {r['in_steps']:.1f} | "
            f"{r['floor_rows']:.3g} | {r['floor_eager']:.3g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny test model, fewer steps")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    steps = SMOKE_STEPS if args.smoke else STEPS
    rows = [measure(torch.bfloat16, n, device, args.smoke) for n in steps]
    rows += [measure(torch.float32, n, device, args.smoke) for n in steps[:1] + steps[-1:]]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    text = table(rows, name)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
