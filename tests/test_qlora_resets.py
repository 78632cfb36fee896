"""Hard resets on a QLoRA base: the tiny model loaded in bitsandbytes 4-bit (nf4, bf16 compute) and 8-bit, trained
by a real `ProRLTrainer` for two phases with a hard reset between them (`lora_reset_mode="frozen"`, the default).

Checked per base: the reset changes no output bit (the probe's logits, the reference's, and the trainer's own measure
`prorl/reset_logp_change`), also for an adapter as large as the base layer's output (the mechanics alone); it never
writes the quantised weights (codes and scales bitwise as loaded, through the whole run) and keeps the delta as
frozen factors on the bitsandbytes layers; `lora_reset_mode="merge"` is refused; `final/` is a plain model (no
`quantization_config`) whose log-probs are the trained policy's to within the quantised model's own evaluation noise:
how far the quantised model is, before training, from the same (dequantised) weights evaluated in float32. A run
resumed from a checkpoint after the reset, on a freshly loaded quantised base, ends with the uninterrupted run's
weights (4-bit).

bitsandbytes' CPU backend runs both layer kinds (no GPU needed); `keep_cpu_layout` turns off the one CPU-only repacking
that breaks training after an eval-mode forward. 15-40 s on 2 cores.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _prorl_helpers import lora, prompts_dataset, tiny_args
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from prorl_trl import PhaseConfig, ProRLTrainer
from prorl_trl.reset import (
    ResetNotSupportedError,
    freeze_lora_delta,
    frozen_layers,
    frozen_state_dict,
    lora_layers,
    merged_state_dict,
    reinit_adapter,
)

pytest.importorskip("bitsandbytes")

PROBE = torch.arange(3, 40).reshape(1, -1)
QUANTISATIONS = {
    "4bit": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "8bit": dict(load_in_8bit=True),
}
STEPS = (2, 2)  # phase 0, phase 1: the resume starts from phase 1's first checkpoint, after the reset


def parity(completion_ids, **kwargs):
    return [float(ids[0] % 2) for ids in completion_ids]


def keep_cpu_layout(model) -> None:
    """Keep bitsandbytes' 4-bit weights in their storage layout on the CPU.

    On a CPU with AVX512-BF16, `Linear4bit.forward` repacks its weight in place for a CPU inference kernel at the
    first eval-mode forward without grad (`packing_format_for_cpu`; the reset probe and these tests run such
    forwards). A training forward after that goes through that kernel, which has no autograd: it fails on a layer
    with a bias ("a view of a leaf Variable that requires grad is being used in an in-place operation") and gives
    no input gradient on the others. GPUs never repack; switched off here so the test is the same on every CPU.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def load_quantised(path, bits: str):
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(**QUANTISATIONS[bits]), device_map="cpu", dtype=torch.bfloat16
    )
    keep_cpu_layout(model)
    return model


def probe_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


def probe_logps(model) -> torch.Tensor:
    """Log-probs of the probe's next tokens, float32."""
    logits = probe_logits(model)[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, PROBE[:, 1:, None])[..., 0]


def quantised_storage(model) -> dict[str, torch.Tensor]:
    """Every bitsandbytes layer's stored codes and scales (4-bit: packed codes, absmax; 8-bit: int8 rows, row scales;
    `Linear8bitLt` moves its scales from the weight into `state` at its first forward)."""
    storage = {}
    for name, module in model.named_modules():
        if not type(module).__module__.startswith("bitsandbytes"):  # PEFT's wrappers show their base layer's weight
            continue
        weight = module.weight
        kind = type(weight).__name__
        if kind == "Params4bit":
            storage[f"{name}.codes"] = weight.data.clone()
            storage[f"{name}.absmax"] = weight.quant_state.absmax.clone()
        elif kind == "Int8Params":
            scales = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
            storage[f"{name}.codes"] = weight.data.clone()
            storage[f"{name}.scales"] = scales.clone()
    return storage


def same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[key], right[key]) for key in left)


class RecordingTrainer(ProRLTrainer):
    """A ProRLTrainer that keeps, around each hard reset, the probe's logits (the policy before and after, and the
    reference after: the adapter disabled) and the quantised storage."""

    def hard_reset(self, *args, **kwargs):
        record = {"before": probe_logits(self.model), "storage_before": quantised_storage(self.model)}
        super().hard_reset(*args, **kwargs)
        with self.model.disable_adapter():
            record["reference_after"] = probe_logits(self.model)
        record |= {"after": probe_logits(self.model), "storage_after": quantised_storage(self.model)}
        self.reset_records = [*getattr(self, "reset_records", []), record]


def qlora_trainer(path, output_dir, bits: str, trainer_class=ProRLTrainer, **overrides) -> ProRLTrainer:
    settings = dict(
        max_steps=-1,
        learning_rate=5e-2,
        phases=[PhaseConfig(max_steps=steps) for steps in STEPS],
        save_merged_on_reset=False,
        save_strategy="steps",
        save_steps=1,
        seed=0,
    )
    args = tiny_args(output_dir, **(settings | overrides))
    torch.manual_seed(0)
    return trainer_class(
        model=load_quantised(path, bits),
        processing_class=AutoTokenizer.from_pretrained(path),
        reward_funcs=[parity],
        args=args,
        train_dataset=prompts_dataset(),
        peft_config=lora(r=4),
    )


@pytest.fixture(scope="module", params=list(QUANTISATIONS))
def run(request, tiny_dir, tmp_path_factory):
    """One uninterrupted run per base, with what the tests compare it to: the policy and its dense copy before
    training, the storage as loaded."""
    bits = request.param
    root = tmp_path_factory.mktemp(f"qlora-{bits}")
    trainer = qlora_trainer(tiny_dir, root, bits, trainer_class=RecordingTrainer)
    start = {
        "logits": probe_logits(trainer.model),
        "policy": probe_logps(trainer.model),
        "dense": merged_state_dict(trainer.model),  # the dequantised weights, as a merged save writes them
        "storage": quantised_storage(trainer.model),
    }
    trainer.train()
    return {"bits": bits, "trainer": trainer, "root": root, "start": start, "tiny_dir": tiny_dir}


def test_the_reset_changes_no_output_bit(run):
    trainer = run["trainer"]
    [record] = trainer.reset_records
    assert not torch.equal(record["before"], run["start"]["logits"])  # phase 0 moved the policy
    assert torch.equal(record["after"], record["before"])
    assert torch.equal(record["reference_after"], record["before"])  # the KL reference is the policy at the reset
    logged = [e["prorl/reset_logp_change"] for e in trainer.prorl_log_history if "prorl/reset_logp_change" in e]
    assert logged == [0.0]


def test_the_quantised_weights_are_never_written(run):
    trainer = run["trainer"]
    [record] = trainer.reset_records
    assert same(record["storage_before"], run["start"]["storage"])
    assert same(record["storage_after"], run["start"]["storage"])
    assert same(quantised_storage(trainer.model), run["start"]["storage"])  # and not by phase 1 either
    layers = frozen_layers(trainer.model)
    assert [name for name, _, _ in layers] == [
        f"model.layers.{i}.self_attn.{proj}" for i in range(2) for proj in ("q_proj", "v_proj")
    ]
    kind = {"4bit": "Params4bit", "8bit": "Int8Params"}[run["bits"]]
    assert all(type(base.weight).__name__ == kind for _, base, _ in layers)
    assert all(frozen.rank == 4 and frozen.parts[0][1].abs().sum() > 0 for _, _, frozen in layers)


def test_final_is_a_plain_model_equal_to_the_policy_within_evaluation_noise(run):
    """`final/` and the trained QLoRA policy are two bf16 evaluations of one function (the dequantised base plus
    every delta). Each is about as far from that function evaluated in float32 as the quantised model was from its
    float32 self before training (the noise; measured 0.5-1.2 x the noise each and 1.0-1.5 x apart, where training
    moved the policy by 90-200 x). A wrong dequantisation or a missing delta would be off by far more."""
    final_dir = run["root"] / "run" / "final"
    config = json.loads((final_dir / "config.json").read_text())
    assert "quantization_config" not in config
    final = AutoModelForCausalLM.from_pretrained(final_dir).eval()
    assert all(type(p) is torch.nn.Parameter and p.dtype.is_floating_point for p in final.parameters())

    def exact(weights) -> torch.Tensor:  # the weights' function, evaluated in float32
        model = AutoModelForCausalLM.from_pretrained(run["tiny_dir"], dtype=torch.float32).eval()
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        return probe_logps(model)

    noise = (run["start"]["policy"] - exact(run["start"]["dense"])).norm()
    trained = exact(merged_state_dict(run["trainer"].model, folded_dtype=torch.float32))
    policy, saved = probe_logps(run["trainer"].model), probe_logps(final)
    assert noise > 0 and (policy - run["start"]["policy"]).norm() > 20 * noise  # training moved it past the noise
    assert (policy - trained).norm() <= 3 * noise and (saved - trained).norm() <= 3 * noise
    assert (saved - policy).norm() <= 4 * noise


@pytest.mark.parametrize("bits", list(QUANTISATIONS))
def test_freezing_a_delta_as_large_as_the_base_changes_no_output_bit(tiny_dir, bits):
    """The reset's mechanics alone, on an adapter that moves the logits by a third of their size (a long phase): the
    rounding of each layer's sum then decides many output bits, where in the short runs above it decides few. The
    adapter is bf16, as GRPOTrainer makes a QLoRA adapter."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(load_quantised(tiny_dir, bits), lora(r=4))
        with torch.no_grad():
            for _, layer in lora_layers(model):
                for factor in (layer.lora_A["default"], layer.lora_B["default"]):
                    factor.weight.data = factor.weight.data.to(torch.bfloat16)
                layer.lora_B["default"].weight.normal_(std=0.05)
    before = probe_logits(model)
    with model.disable_adapter():
        assert (before - probe_logits(model)).norm() > 0.2 * before.norm()
    freeze_lora_delta(model)
    reinit_adapter(model, seed=0)
    assert torch.equal(probe_logits(model), before)
    with model.disable_adapter():  # the reference (beta > 0) is the policy at the reset
        assert torch.equal(probe_logits(model), before)


@pytest.mark.parametrize("bits", list(QUANTISATIONS))
def test_merge_resets_are_refused_on_a_quantised_base(tiny_dir, tmp_path, bits):
    with pytest.raises(ResetNotSupportedError, match="lora_reset_mode: frozen"):
        qlora_trainer(tiny_dir, tmp_path, bits, lora_reset_mode="merge")


@pytest.mark.parametrize("run", ["4bit"], indirect=True)  # 8-bit resumes the same way, at twice the time
def test_a_run_resumed_after_the_reset_ends_with_the_uninterrupted_weights(run, tmp_path):
    """The checkpoint after the reset (phase 1, step 1), resumed by a new trainer on a freshly loaded quantised base:
    the frozen factors come back from `frozen/reset-1.safetensors`, the quantised base from the model files, and the
    adapter trains in the bf16 TRL gives a QLoRA adapter (PEFT's `load_adapter`, which HF's resume calls, would make
    it float32)."""
    shutil.copytree(run["root"] / "run", tmp_path / "run", ignore=shutil.ignore_patterns("final"))
    resumed = qlora_trainer(run["tiny_dir"], tmp_path, run["bits"])
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "phase-1" / "checkpoint-1"))
    uninterrupted = run["trainer"]
    assert resumed.prorl_resets == uninterrupted.prorl_resets == 1
    assert resumed.prorl_global_step == uninterrupted.prorl_global_step == sum(STEPS)
    weights = [
        {n: p.detach() for n, p in t.model.named_parameters() if p.requires_grad} | frozen_state_dict(t.model)
        for t in (uninterrupted, resumed)
    ]
    assert same(*weights)
    assert torch.equal(probe_logps(resumed.model), probe_logps(uninterrupted.model))
    assert same(quantised_storage(resumed.model), run["start"]["storage"])
