"""TRL 1.16 vLLM-path guards and what vLLM receives after a hard reset (vLLM itself cannot run on this CPU box).

The weight-stream tests run TRL's real `VLLMGeneration._iter_named_params` / `sync_weights` on a real PeftModel; only
the vLLM engine is replaced, by a recorder standing at `llm.llm_engine...model.load_weights` (the call TRL makes).
"""

import inspect
import re

import pytest
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from trl.distributed import DistributedBackend
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.grpo_trainer import GRPOTrainer

from prorl_trl.reset import (
    freeze_lora_delta,
    lora_layers,
    merge_lora_in_place,
    merged_state_dict,
    reinit_adapter,
)
from prorl_trl.tiny import build_tiny
from prorl_trl.rollout.vllm_sync import (
    VLLM_SAMPLING_ATTRIBUTES,
    apply_vllm_sampling,
    force_weight_sync,
    shadowed_by_generation_kwargs,
    stream_policy_weights,
)

INPUT_IDS = torch.tensor([[5, 17, 42, 99, 130, 7, 250, 3]])


# ------------------------------------------------------------------------------------------- guards on TRL source
def test_vllm_generation_stores_and_rereads_every_sampling_attribute():
    init = inspect.getsource(VLLMGeneration.__init__)
    generate = inspect.getsource(VLLMGeneration.generate)
    for name in VLLM_SAMPLING_ATTRIBUTES + ("generation_kwargs",):
        assert re.search(rf"self\.{name} = {name}\b", init), f"VLLMGeneration.__init__ no longer stores {name}"
        assert f"self.{name}" in generate, f"VLLMGeneration.generate no longer reads self.{name}"
    assert "generation_kwargs.update(self.generation_kwargs)" in generate  # colocate: extra kwargs applied last
    assert '"max_tokens": max_completion_length' in generate


def test_weight_sync_is_keyed_on_global_step_vs_last_loaded_step():
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "self.state.global_step != self._last_loaded_step" in source
    assert "self.vllm_generation.sync_weights()" in source
    assert "self._last_loaded_step = -1" in inspect.getsource(GRPOTrainer.__init__)


def test_weight_stream_skips_lora_and_strips_peft_names():
    source = inspect.getsource(VLLMGeneration._iter_named_params)
    assert "model.merge_adapter()" in source and "model.unmerge_adapter()" in source
    assert 'removeprefix("base_model.model.").replace(".base_layer", "")' in source
    assert "if model.prefix in name" in source
    # ProRL replaces the stream on the instance (`stream_policy_weights`): TRL must still read it there, and name
    # tensors with the fixer our stream calls
    assert inspect.getsource(VLLMGeneration.sync_weights).count("self._iter_named_params()") >= 3
    assert "extra_prefixes" in inspect.signature(VLLMGeneration._fix_param_name_to_vllm).parameters


# ---------------------------------------------------------------------------------------- sampling settings
def bare_vllm_generation(**attributes):
    """A VLLMGeneration without starting vLLM (its __init__ would); only the attributes our code touches."""
    generation = VLLMGeneration.__new__(VLLMGeneration)
    defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_completion_length=16)
    for name, value in (defaults | {"generation_kwargs": {}} | attributes).items():
        setattr(generation, name, value)
    return generation


def test_apply_vllm_sampling_sets_attributes_read_by_generate():
    generation = bare_vllm_generation()
    in_force = apply_vllm_sampling(generation, temperature=1.2, top_p=0.9, max_completion_length=64, min_p=0.05)
    assert in_force == dict(temperature=1.2, top_p=0.9, top_k=0, min_p=0.05, repetition_penalty=1.0, max_completion_length=64)
    apply_vllm_sampling(generation, generation_kwargs={"seed": 3}, top_k=20)
    assert generation.generation_kwargs == {"seed": 3} and generation.top_k == 20


def test_generation_kwargs_that_shadow_a_schedule_are_refused():
    generation = bare_vllm_generation(generation_kwargs={"max_tokens": 128})
    with pytest.raises(ValueError, match=r"generation_kwargs also sets \['max_completion_length'\].*max_tokens"):
        apply_vllm_sampling(generation, max_completion_length=64)
    assert generation.max_completion_length == 16  # nothing applied
    assert shadowed_by_generation_kwargs({"temperature": 0.7, "seed": 1}, ["temperature", "top_p"]) == ["temperature"]
    with pytest.raises(ValueError, match="Unknown vLLM sampling settings"):
        apply_vllm_sampling(generation, max_tokens=64)


def test_force_weight_sync_sets_the_tag_trl_compares():
    class Trainer:  # only the two attributes TRL's check reads
        use_vllm, _last_loaded_step = True, 7

    trainer = Trainer()
    force_weight_sync(trainer)
    assert trainer._last_loaded_step == -1


def test_both_spellings_of_the_completion_cap_are_caught():
    for key in ("max_tokens", "max_new_tokens", "max_completion_length"):
        assert shadowed_by_generation_kwargs({key: 64}, ["max_completion_length", "top_p"]) == ["max_completion_length"]
    assert shadowed_by_generation_kwargs({"seed": 0, "stop": ["x"]}, ["max_completion_length", "top_k"]) == []


# ------------------------------------------------------------------------------------- what vLLM receives
class RecordingEngine:
    """Stands where TRL pushes colocated weights: `llm.llm_engine.model_executor.driver_worker.model_runner.model`."""

    def __init__(self):
        self.weights, self.prefix_cache_resets = {}, 0
        self.llm_engine = self.model_executor = self.driver_worker = self.model_runner = self.model = self

    def load_weights(self, pairs):
        for name, tensor in pairs:
            self.weights[name] = tensor.detach().clone()

    def reset_prefix_cache(self):
        self.prefix_cache_resets += 1


def colocated_generation(model):
    generation = bare_vllm_generation(model=model, accelerator=Accelerator(cpu=True), mode="colocate")
    generation.enable_sleep_mode = False
    generation._dist = DistributedBackend(generation.accelerator)
    generation.llm = RecordingEngine()
    return generation


def trained_lora_model():
    model, _ = build_tiny(seed=0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=generator))
    return model.eval()


def pushed(generation):
    generation.llm.weights.clear()
    generation.sync_weights()
    return dict(generation.llm.weights)


def test_vllm_gets_the_merged_policy_before_and_after_a_reshaping_reset():
    model = trained_lora_model()
    generation = colocated_generation(model)
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits
    before = pushed(generation)
    expected = merged_state_dict(model)
    assert not any("lora" in name for name in before)
    assert all(torch.allclose(before[name], expected[name], atol=1e-6) for name in before)

    merge_lora_in_place(model)
    reinit_adapter(model, r=8, target_modules=["q_proj", "v_proj", "up_proj"], seed=0)
    after = pushed(generation)
    # Server mode caches (name, dtype, shape) on the first sync: a reset must not change them.
    assert [(n, t.dtype, t.shape) for n, t in before.items()] == [(n, t.dtype, t.shape) for n, t in after.items()]
    assert all(torch.allclose(before[name], after[name], atol=1e-5) for name in before)  # function unchanged
    # The push merges and unmerges around the stream: the live model is left as it was.
    assert all(layer.merged_adapters == [] for _, layer in lora_layers(model))
    with torch.no_grad():
        assert (model(input_ids=INPUT_IDS).logits - logits).abs().max() < 1e-5
    assert generation.llm.prefix_cache_resets == 2


def test_trainer_refuses_generation_kwargs_that_shadow_phase_settings_on_either_backend(tmp_path):
    """`max_tokens` (vLLM's spelling of the cap) in generation_kwargs would override a phase's cap silently.

    Refused only where a phase changes the setting; a key no phase changes is TRL's (tests/test_parity.py)."""
    import pytest
    from datasets import Dataset

    from prorl_trl import PhaseConfig, ProRLConfig, ProRLTrainer
    from prorl_trl.tiny import build_tiny

    model, tokenizer = build_tiny(seed=0)
    phases = [PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, max_completion_length=6, temperature=0.9)]
    for extra in ({"max_tokens": 5}, {"max_new_tokens": 5}, {"temperature": 0.7}):
        args = ProRLConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
            num_generations=4, max_completion_length=4, phases=phases, generation_kwargs=extra,
        )
        with pytest.raises(ValueError, match="generation_kwargs"):
            ProRLTrainer(
                model=model, processing_class=tokenizer, args=args,
                reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 8),
            )


def test_the_stream_prorl_installs_sends_every_delta_and_never_writes_the_live_weights():
    """`stream_policy_weights` (what ProRLTrainer installs for a PEFT model with vLLM): after a frozen reset and a newly
    trained adapter, vLLM gets base + frozen parts + live adapter folded in float32 and cast once, under TRL's own
    names and in the base dtype; the live model's weights are never written. TRL's own stream merges and unmerges the
    bf16 base in place, which moves it (round(round(W + delta) - delta) != W): the reason it is replaced."""
    model = trained_lora_model().to(torch.bfloat16)
    freeze_lora_delta(model)
    reinit_adapter(model, r=2, target_modules=["q_proj", "v_proj"], seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator))
    live = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}

    trl_generation = colocated_generation(model)
    trl_pushed = pushed(trl_generation)
    moved = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, live[name])]
    assert moved, "TRL's merge + unmerge left the bf16 base as it was: the replacement's reason is gone"
    with torch.no_grad():  # put the weights back as they were before TRL's push
        for name, tensor in model.state_dict().items():
            tensor.copy_(live[name])

    generation = colocated_generation(model)
    stream_policy_weights(generation)
    ours = pushed(generation)
    expected = merged_state_dict(model)
    assert ours.keys() == trl_pushed.keys()  # TRL's names: vLLM's metadata cache stays valid
    assert all(ours[name].dtype == torch.bfloat16 for name in ours)
    assert all(torch.equal(ours[name], expected[name]) for name in ours)
    assert all(torch.equal(tensor, live[name]) for name, tensor in model.state_dict().items())  # nothing written
    frozen_only = [n for n in ours if "k_proj.weight" in n]  # k: a frozen part, no live adapter since the reshape
    base = {name.replace(".base_layer", "").removeprefix("base_model.model."): t for name, t in live.items()}
    assert all(not torch.equal(ours[n], base[n]) for n in frozen_only)  # the frozen delta reached vLLM
