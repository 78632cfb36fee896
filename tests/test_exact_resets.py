"""Hard resets on a bf16 base keep what each phase learned (`lora_reset_mode="frozen"`, the default), where a merge
into the base weights rounds it away (`"merge"`, kept for comparison).

A phase is given the delta a phase at a small learning rate leaves: the steepest rank-r step on a probe's loss (a
coherent direction, as training gives), scaled so that 99 % of its elements are under half a bf16 step of their
weight. The tiny model is 128 wide here: in the 64-wide one such a delta moves the logits less than bf16 evaluation
itself does, and nothing could be told apart. "Evaluation noise" is how far the bf16 model's log-probs are from the
same weights evaluated in float32. About 20 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from _prorl_helpers import lora, prompts_dataset, tiny_args
from transformers import AutoModelForCausalLM

from prorl_trl import PhaseConfig, ProRLTrainer
from prorl_trl.reset import frozen_layers, frozen_state_dict, lora_layers, merged_state_dict
from prorl_trl.tiny import build_tiny

PROBE = torch.arange(3, 40).reshape(1, -1)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
WIDE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def parity(completion_ids, **kwargs):
    return [float(ids[0] % 2) for ids in completion_ids]


def probe_logps(model) -> torch.Tensor:
    """Log-probs of the probe's next tokens, float32."""
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits.float()[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, PROBE[:, 1:, None])[..., 0]


def bf16_trainer(tmp_path, mode: str, **overrides) -> ProRLTrainer:
    model, tokenizer = build_tiny(seed=0, **WIDE)
    settings = dict(max_steps=1, lora_reset_mode=mode, save_merged_on_reset=False) | overrides
    args = tiny_args(tmp_path, **settings)
    return ProRLTrainer(
        model=model.to(torch.bfloat16),
        processing_class=tokenizer,
        reward_funcs=[parity],
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora(r=4, targets=TARGETS),
    )


def small_phase_delta(model) -> dict[str, torch.Tensor]:
    """Set every adapter to the steepest rank-r step on the probe's loss, 99 % of its elements under half a bf16 step
    of their weight (bf16 keeps 8 significant bits); returns each layer's delta (scale * B @ A) in float32."""
    layers = lora_layers(model)
    weights = [layer.base_layer.weight for _, layer in layers]
    for weight in weights:
        weight.requires_grad_(True)
    model.zero_grad()
    model(input_ids=PROBE, labels=PROBE).loss.backward()
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
            assert (deltas[name].abs() < half_step).float().mean() >= 0.99
    return deltas


def effect_kept(trainer) -> float:
    """1 - |policy after the reset - before| / |policy before - adapter off|, on the probe's log-probs."""
    model = trainer.model
    before = probe_logps(model)
    with model.disable_adapter():
        adapter_off = probe_logps(model)
    trainer.hard_reset(reason="test")
    return 1 - ((probe_logps(model) - before).norm() / (before - adapter_off).norm()).item()


@pytest.mark.parametrize("mode", ["frozen", "merge"])
def test_one_phase_below_half_a_bf16_step_survives_the_reset(tmp_path, mode):
    trainer = bf16_trainer(tmp_path, mode)
    small_phase_delta(trainer.model)
    before = probe_logps(trainer.model)
    kept = effect_kept(trainer)
    if mode == "frozen":
        assert kept == 1.0 and torch.equal(probe_logps(trainer.model), before)  # not one bit changed
        with trainer.model.disable_adapter():  # the KL reference (beta > 0) is the policy after the reset
            assert torch.equal(probe_logps(trainer.model), before)
        assert all(base.weight.dtype == torch.bfloat16 for _, base, _ in frozen_layers(trainer.model))
    else:
        assert kept < 0.10  # the merge rounds the phase away


def test_three_resets_match_a_float32_model_given_the_same_deltas(tmp_path):
    """After three phases and resets the bf16 policy is as close to a float32 model with the same base weights and
    the same deltas as bf16 evaluation allows; the merge is several times further off (the test can fail)."""
    results = {}
    for mode in ("frozen", "merge"):
        trainer = bf16_trainer(tmp_path / mode, mode)
        model = trainer.model
        with model.disable_adapter():
            start = probe_logps(model)
        exact, _ = build_tiny(seed=0, **WIDE)  # float32, with the bf16 base weights
        exact.load_state_dict({k: v.float() for k, v in merged_state_dict(model).items()})
        start_exact = probe_logps(exact)
        total: dict[str, torch.Tensor] = {}
        for _ in range(3):
            for name, delta in small_phase_delta(model).items():
                total[name] = total.get(name, 0) + delta
            trainer.hard_reset(reason="test")
        with torch.no_grad():
            modules = dict(exact.named_modules())
            for name, delta in total.items():
                modules[name.removeprefix("base_model.model.")].weight.add_(delta)
        noise = (start - start_exact).norm().item()
        learned = probe_logps(model) - start
        learned_exact = probe_logps(exact) - start_exact
        results[mode] = {
            "distance": (probe_logps(model) - probe_logps(exact)).norm().item() / noise,  # in evaluation noise
            "learned_error": ((learned - learned_exact).norm() / learned_exact.norm()).item(),  # share of the change
            "learned_error_in_noise": (learned - learned_exact).norm().item() / noise,
            "effect": learned_exact.norm().item() / noise,
        }
    assert results["frozen"]["effect"] > 3, results  # the three phases moved the log-probs past evaluation noise
    assert results["frozen"]["distance"] <= 1.5, results  # bf16 evaluation noise, nothing more
    assert results["frozen"]["learned_error_in_noise"] <= 1.5, results
    assert results["merge"]["distance"] >= 2.5 and results["merge"]["learned_error"] >= 0.8, results  # can fail


def test_a_trained_run_logs_that_its_resets_changed_nothing(tmp_path):
    """The trainer measures every reset on its latest completions (`prorl/reset_logp_change`, `reset_effect_lost`):
    0 for frozen factors, the merge's loss on a bf16 base; and `final/` loads with `from_pretrained` as the policy."""
    logged = {}
    for mode in ("frozen", "merge"):
        trainer = bf16_trainer(
            tmp_path / mode, mode, max_steps=-1, learning_rate=2e-4, phases=[PhaseConfig(max_steps=2)] * 3
        )
        trainer.train()
        entries = [e for e in trainer.prorl_log_history if "prorl/reset_logp_change" in e]
        logged[mode] = [(e["prorl/reset_logp_change"], e.get("prorl/reset_effect_lost")) for e in entries]
        assert len(entries) == trainer.prorl_resets == 2
        if mode == "frozen":
            policy = probe_logps(trainer.model)
            final = AutoModelForCausalLM.from_pretrained(tmp_path / mode / "run" / "final").eval()
            assert final.dtype == torch.float32  # auto: bf16 would have rounded the small deltas away
            exact = {k: v.float() for k, v in merged_state_dict(trainer.model, folded_dtype=torch.float32).items()}
            assert all(torch.equal(final.state_dict()[k], v) for k, v in exact.items())
            reference = build_tiny(seed=0, **WIDE)[0]
            reference.load_state_dict({k: v.float() for k, v in merged_state_dict(trainer.model).items()})
            noise = (probe_logps(reference.to(torch.bfloat16)) - probe_logps(reference.float())).norm()
            assert (probe_logps(final) - policy).norm() <= 1.5 * noise  # the policy, to bf16 evaluation noise
            assert frozen_state_dict(trainer.model)
    assert all(change == 0.0 and lost == 0.0 for change, lost in logged["frozen"]), logged
    assert all(change > 0 and lost > 0.3 for change, lost in logged["merge"]), logged


@pytest.mark.parametrize(
    "dtype, autocast", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True), (torch.float32, False)],
    ids=["bf16", "bf16+autocast", "fp32+autocast", "fp32"],
)
@torch.no_grad()
def test_every_reset_is_bitwise_a_no_op_however_the_forward_runs(dtype, autocast):
    """Each frozen part is computed as PEFT computed the adapter it was, in the same context: a bf16 base with float32
    adapters (one rounding after the float32 sum), under bf16 autocast (as accelerate runs a bf16 mixed-precision
    launch), or float32. Three resets in a row, each with a fresh adapter trained on top of the last."""
    from peft import get_peft_model

    from prorl_trl.reset import freeze_lora_delta, reinit_adapter

    model = get_peft_model(build_tiny(seed=0)[0].to(dtype), lora(r=4, targets=TARGETS)).eval()

    def logits():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=PROBE).logits

    for reset in range(3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(reset)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=1e-3)
        before = logits()
        freeze_lora_delta(model)
        reinit_adapter(model, seed=reset)
        assert torch.equal(logits(), before), f"reset {reset + 1} changed the outputs"
        with model.disable_adapter():
            assert torch.equal(logits(), before)  # the KL reference is the policy
