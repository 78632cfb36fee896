"""Hard-reset mechanics on a real PeftModel over the tiny Qwen2 model (prorl_trl.reset)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from prorl_trl.reset import (
    ResetNotSupportedError,
    broadcast_adapter,
    check_reset_support,
    engine_of,
    lora_layers,
    lora_parameters,
    merge_lora_in_place,
    reinit_adapter,
    reset_optimizer_state,
    save_merged_model,
    sync_reference,
)
from prorl_trl.tiny import build_tiny

INPUT_IDS = torch.tensor([[5, 17, 42, 99, 130, 7, 250, 3], [60, 61, 62, 63, 64, 65, 66, 67]])
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(r=4, targets=("q_proj", "k_proj"), seed=0, **lora_kwargs):
    """A PeftModel whose adapter has been 'trained': B is random, so the delta is non-zero."""
    model, _ = build_tiny(seed=seed)
    lora_kwargs.setdefault("target_modules", list(targets))
    config = LoraConfig(r=r, lora_alpha=2 * r, task_type="CAUSAL_LM", **lora_kwargs)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, layer in lora_layers(peft_model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    return peft_model.eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def b_weights(model):
    return [layer.lora_B["default"].weight for _, layer in lora_layers(model)]


def test_merge_and_same_shape_reinit_preserve_function_and_parameters():
    model = lora_model()
    before = logits(model)
    base_before = {name: layer.base_layer.weight.detach().clone() for name, layer in lora_layers(model)}
    params_before = dict(model.named_parameters())  # held, so the identity check cannot be fooled by id() reuse
    base_storage = [layer.base_layer.weight.data_ptr() for _, layer in lora_layers(model)]

    merge_lora_in_place(model)
    assert reinit_adapter(model) is False

    assert (logits(model) - before).abs().max() < 1e-5
    assert all(torch.count_nonzero(w) == 0 for w in b_weights(model))
    assert all(layer.merged_adapters == [] for _, layer in lora_layers(model))
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[name] is params_before[name] for name in params_before)
    assert [layer.base_layer.weight.data_ptr() for _, layer in lora_layers(model)] == base_storage
    assert all(not torch.equal(layer.base_layer.weight, base_before[name]) for name, layer in lora_layers(model))
    # The delta is now part of the base: disabling or unmerging the adapter must not remove it.
    with pytest.warns(UserWarning, match="Already unmerged"):
        model.unmerge_adapter()
    assert (logits(model) - before).abs().max() < 1e-5
    with model.disable_adapter():
        assert (logits(model) - before).abs().max() < 1e-5


def test_merge_when_adapter_is_already_merged_adds_it_once():
    model = lora_model()
    before = logits(model)
    model.merge_adapter()  # as TRL's vLLM weight sync does around a push
    merge_lora_in_place(model)
    reinit_adapter(model)
    assert (logits(model) - before).abs().max() < 1e-5


def test_reinit_draws_a_fresh_kaiming_a():
    model = lora_model()
    old_a = [layer.lora_A["default"].weight.detach().clone() for _, layer in lora_layers(model)]
    merge_lora_in_place(model)
    reinit_adapter(model, seed=3)
    for (_, layer), previous in zip(lora_layers(model), old_a):
        weight = layer.lora_A["default"].weight
        bound = 1 / weight.shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) on (r, in_features)
        assert not torch.equal(weight, previous)
        assert weight.abs().max() <= bound and weight.abs().max() > 0.5 * bound


def test_seeded_reinit_is_deterministic_and_leaves_global_rng_alone():
    first, second = lora_model(seed=0), lora_model(seed=5)
    state = torch.random.get_rng_state()
    reinit_adapter(first, seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)
    reinit_adapter(second, seed=11)
    for (_, a), (_, b) in zip(lora_parameters(first), lora_parameters(second)):
        assert torch.equal(a, b)
    reinit_adapter(second, seed=12)
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(lora_parameters(first), lora_parameters(second)))


def test_shape_change_rank_and_targets_builds_a_new_trainable_default_adapter():
    model = lora_model(r=4, targets=("q_proj", "k_proj"))
    before = logits(model)
    old_params = [p for _, p in lora_parameters(model)]  # hold them: a freed object's id() can be reused

    merge_lora_in_place(model)
    assert reinit_adapter(model, r=8, target_modules=ALL_LINEAR, seed=0) is True

    assert (logits(model) - before).abs().max() < 1e-5
    assert list(model.peft_config) == ["default"] and model.active_adapters == ["default"]
    assert model.peft_config["default"].r == 8
    layers = lora_layers(model)
    assert len(layers) == 2 * len(ALL_LINEAR)
    assert all(layer.lora_A["default"].weight.shape[0] == 8 for _, layer in layers)
    assert all(torch.count_nonzero(w) == 0 for w in b_weights(model))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name for name, _ in lora_parameters(model)} and all(".default." in n for n in trainable)
    assert not any(new is old for _, new in lora_parameters(model) for old in old_params)


def test_alpha_only_change_keeps_parameters_and_updates_scaling():
    model = lora_model(r=4)
    before = [p for _, p in lora_parameters(model)]  # held, so identity checks cannot be fooled by id() reuse
    assert reinit_adapter(model, lora_alpha=32) is False
    assert all(a is b for a, b in zip([p for _, p in lora_parameters(model)], before, strict=True))
    assert all(layer.scaling["default"] == 8.0 for _, layer in lora_layers(model))


def test_reset_optimizer_state_on_adamw_after_steps():
    model = lora_model()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(2):
        model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(optimizer.state) > 0
    groups = [list(map(id, group["params"])) for group in optimizer.param_groups]
    reset_optimizer_state(optimizer)
    assert len(optimizer.state) == 0
    assert [list(map(id, group["params"])) for group in optimizer.param_groups] == groups
    model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
    optimizer.step()  # state is rebuilt lazily, as for a new optimizer
    assert all(state["step"].item() == 1 for state in optimizer.state.values())


def test_reset_optimizer_state_through_accelerate_wrapper():
    from accelerate import Accelerator

    model = lora_model().train()
    accelerator = Accelerator(cpu=True)
    optimizer = accelerator.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
    optimizer.step()
    assert len(optimizer.optimizer.state) > 0
    reset_optimizer_state(optimizer)
    assert len(optimizer.optimizer.state) == 0 and len(optimizer.state) == 0


def test_save_merged_model_reloads_with_equal_logits_and_keeps_live_model(tmp_path):
    model = lora_model(targets=ALL_LINEAR)
    _, tokenizer = build_tiny()
    before = logits(model)
    path = save_merged_model(model, tokenizer, tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (logits(reloaded) - before).abs().max() < 1e-5
    assert not any("lora" in name for name in reloaded.state_dict())
    assert (logits(model) - before).abs().max() == 0  # live PeftModel untouched (still unmerged)
    assert all(layer.merged_adapters == [] for _, layer in lora_layers(model))
    assert (path / "tokenizer_config.json").exists()

    # Overwrite after a reset: the saved model now reflects base+old delta+new delta.
    merge_lora_in_place(model)
    reinit_adapter(model, seed=0)
    with torch.no_grad():
        for weight in b_weights(model):
            weight.fill_(0.01)
    save_merged_model(model, tokenizer, path)
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (logits(reloaded) - logits(model)).abs().max() < 1e-5
    assert not list(tmp_path.glob(".merged*"))  # no temp/old directories left behind


def test_interrupted_save_keeps_previous_save(tmp_path, monkeypatch):
    model = lora_model()
    _, tokenizer = build_tiny()
    path = save_merged_model(model, tokenizer, tmp_path / "merged")
    saved = sorted(p.name for p in path.iterdir())

    class Interrupted(Exception):
        pass

    def fail(*args, **kwargs):
        raise Interrupted

    monkeypatch.setattr(type(tokenizer), "save_pretrained", fail)  # crash after the weights were written
    with pytest.raises(Interrupted):
        save_merged_model(model, tokenizer, path)
    assert sorted(p.name for p in path.iterdir()) == saved
    assert not list(tmp_path.glob(".merged*"))
    AutoModelForCausalLM.from_pretrained(path)


def test_sync_reference_copies_policy_into_reference_in_place():
    policy, _ = build_tiny(seed=0)
    reference, _ = build_tiny(seed=1)
    before = list(reference.parameters())
    sync_reference(reference, policy)
    assert all(a is b for a, b in zip(reference.parameters(), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), policy.state_dict().values()))
    with pytest.raises(TypeError, match="PeftModel"):
        sync_reference(reference, lora_model())


def test_broadcast_is_a_no_op_without_process_group():
    model = lora_model()
    before = [p.detach().clone() for _, p in lora_parameters(model)]
    broadcast_adapter(model)
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, lora_parameters(model)))


@pytest.mark.parametrize(
    "lora_kwargs, message",
    [
        ({"use_dora": True}, "use_dora"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_bias": True, "target_modules": ["o_proj"]}, "lora_bias=True but layer .*o_proj has no bias"),
    ],
)
def test_unsupported_lora_variants_are_refused(lora_kwargs, message):
    model = lora_model(**lora_kwargs)
    with pytest.raises(ResetNotSupportedError, match=message):
        check_reset_support(None, model)
    with pytest.raises(ResetNotSupportedError, match="Supported: LoraConfig"):
        merge_lora_in_place(model)


def test_non_linear_lora_layers_are_refused():
    model, _ = build_tiny()
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ResetNotSupportedError, match="embed_tokens is a .*Embedding, not a LoRA Linear"):
        reinit_adapter(model)


def test_supported_configurations_pass_the_check():
    check_reset_support(None, lora_model())
    check_reset_support(None, lora_model(init_lora_weights="gaussian"))
    check_reset_support(None, build_tiny()[0])  # full fine-tuning


def test_launch_engine_from_args_and_environment(monkeypatch, tmp_path):
    """FSDP1 is refused before any model is loaded; FSDP2 and DeepSpeed ZeRO-2 (the defaults) are supported (the
    whole matrix: tests/test_sharded_resets.py)."""
    from trl import GRPOConfig

    fsdp1 = GRPOConfig(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config={"version": 1}, use_cpu=True, report_to=[])
    with pytest.raises(ResetNotSupportedError, match="not supported under FSDP1: FSDP version 1 flattens.*Supported: single process"):
        check_reset_support(fsdp1, lora_model())
    with pytest.raises(ResetNotSupportedError, match="FSDP1"):
        check_reset_support(fsdp1, None)  # launch-only check, before any model is loaded
    fsdp2 = GRPOConfig(output_dir=str(tmp_path), fsdp="full_shard", use_cpu=True, report_to=[])
    assert engine_of(fsdp2).kind == "fsdp2"
    check_reset_support(fsdp2, lora_model())
    plain = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert engine_of(plain).kind == "replicated"
    check_reset_support(plain, lora_model())
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --use_deepspeed` exports
    assert engine_of(plain).kind == "zero2"  # accelerate's default stage
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    with pytest.raises(ResetNotSupportedError, match="not supported under DeepSpeed ZeRO-2: CPU/NVMe offload"):
        check_reset_support(plain, lora_model())


def test_quantised_base_is_refused_from_its_config():
    from transformers import BitsAndBytesConfig

    model, _ = build_tiny()
    model.config.quantization_config = BitsAndBytesConfig(load_in_4bit=True)  # as from_pretrained records QLoRA
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with pytest.raises(ResetNotSupportedError, match="quantised base model \\(bitsandbytes 4-bit.*unquantised"):
        check_reset_support(None, peft_model)
    model, _ = build_tiny()
    model.is_loaded_in_8bit = True
    with pytest.raises(ResetNotSupportedError, match="bitsandbytes 8-bit"):
        check_reset_support(None, model)


def test_reference_adapter_is_reset_to_the_merged_policy_and_stays_frozen():
    """TRL's "ref" adapter (PeftModel + beta>0): after a reset, the reference equals the current policy."""
    from prorl_trl.reset import reset_reference_adapter

    model = lora_model()
    model.add_adapter("ref", model.peft_config["default"])  # as GRPOTrainer does: a copy of "default"
    model.set_adapter("default")
    policy = logits(model)
    merge_lora_in_place(model)
    assert reinit_adapter(model, r=8, target_modules=ALL_LINEAR) is True
    assert reset_reference_adapter(model) is True
    model.set_adapter("ref")
    assert (logits(model) - policy).abs().max() < 1e-5
    model.set_adapter("default")
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in name for name in trainable)
    assert reset_reference_adapter(lora_model()) is False


def test_target_spellings_of_the_same_modules_do_not_rebuild_the_adapter():
    """PEFT rewrites "all-linear" into full module names (in the user's config too): compare modules, not configs."""
    from prorl_trl.reset import adapter_needs_rebuild, targeted_module_names

    model = lora_model(targets=ALL_LINEAR)
    model_all = get_peft_model(build_tiny()[0], LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert isinstance(model_all.peft_config["default"].target_modules, set)  # PEFT resolved the shorthand
    assert targeted_module_names(model_all, "all-linear") == targeted_module_names(model, ALL_LINEAR)
    assert len(targeted_module_names(model, "all-linear")) == 2 * len(ALL_LINEAR)  # lm_head excluded
    for candidate in (model, model_all):
        assert not adapter_needs_rebuild(candidate, r=4, target_modules="all-linear")
        assert not adapter_needs_rebuild(candidate, target_modules=ALL_LINEAR)
        assert adapter_needs_rebuild(candidate, target_modules=["q_proj", "k_proj"])
        assert adapter_needs_rebuild(candidate, r=8)
    before = [p for _, p in lora_parameters(model_all)]
    assert reinit_adapter(model_all, target_modules="all-linear", lora_alpha=16) is False
    assert all(a is b for a, b in zip([p for _, p in lora_parameters(model_all)], before, strict=True))
    narrow = lora_model(targets=("q_proj", "k_proj"))
    assert not adapter_needs_rebuild(narrow, target_modules=r".*\.(q_proj|k_proj)")  # a regex for the same modules


def test_reinit_never_modifies_the_callers_lora_config():
    model, _ = build_tiny()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    reinit_adapter(model, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 8, {"q_proj"})
    assert model.peft_config["default"].r == 8


def tied_tiny_model():
    """The tiny model with tied input/output embeddings, as Qwen2-0.5B has."""
    model, _ = build_tiny()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_save_merged_model_with_tied_embeddings_and_lora_bias(tmp_path):
    _, tokenizer = build_tiny()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True, task_type="CAUSAL_LM")
    model = get_peft_model(tied_tiny_model(), config).eval()  # Qwen2's q/k/v projections have a bias
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for tensor in (layer.lora_B["default"].weight, layer.lora_B["default"].bias):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    before = logits(model)
    reloaded = AutoModelForCausalLM.from_pretrained(save_merged_model(model, tokenizer, tmp_path / "m")).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert (logits(reloaded) - before).abs().max() < 1e-5
    merge_lora_in_place(model)  # lora_bias is merged into the base bias too
    reinit_adapter(model)
    assert (logits(model) - before).abs().max() < 1e-5


def test_merge_into_bf16_base_is_close_and_keeps_dtype():
    """bf16 bases: the merge rounds W + dBA to bf16 once per reset (TRL loads fp32 by default, which avoids it)."""
    model, _ = build_tiny(dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B["default"].weight.normal_(std=0.05)
    model.eval()
    before = logits(model).float()
    merge_lora_in_place(model)
    reinit_adapter(model, seed=0)
    assert all(layer.base_layer.weight.dtype == torch.bfloat16 for _, layer in lora_layers(model))
    assert all(layer.lora_A["default"].weight.dtype == torch.float32 for _, layer in lora_layers(model))
    assert (logits(model).float() - before).abs().max() < 0.05 * before.abs().max()


def test_merged_state_dict_copies_only_layers_with_a_delta():
    from prorl_trl.reset import merged_state_dict

    model = lora_model()
    merge_lora_in_place(model)
    reinit_adapter(model)  # B = 0: nothing to add
    base = model.get_base_model()
    live = {key.replace(".base_layer.", "."): t for key, t in base.state_dict().items() if "lora_" not in key}
    state = merged_state_dict(model)
    assert state.keys() == live.keys() and all(state[k].data_ptr() == live[k].data_ptr() for k in state)


def test_rank_pattern_layers_keep_their_scaling():
    model = lora_model(r=4, rank_pattern={"q_proj": 2}, alpha_pattern={"q_proj": 16})
    scalings = {name: layer.scaling["default"] for name, layer in lora_layers(model)}
    assert reinit_adapter(model, seed=0) is False
    assert {name: layer.scaling["default"] for name, layer in lora_layers(model)} == scalings
    with pytest.raises(ResetNotSupportedError, match="alpha_pattern"):
        reinit_adapter(model, lora_alpha=32)


def test_save_killed_between_renames_is_recovered(tmp_path):
    """A process killed after moving the old save aside but before renaming the new one in leaves `path` missing."""
    from prorl_trl.reset import recover_interrupted_save

    model = lora_model()
    _, tokenizer = build_tiny()
    path = save_merged_model(model, tokenizer, tmp_path / "merged")
    expected = logits(AutoModelForCausalLM.from_pretrained(path).eval())
    path.rename(tmp_path / ".merged.old-4242")  # the kill: old save aside, new one never renamed in
    (tmp_path / ".merged.tmp-abc").mkdir()  # and an unfinished temporary directory
    recover_interrupted_save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(path).eval()), expected)


@torch.no_grad()
def _independent_lost_fraction(before: dict, model) -> float:
    """|merged - (before + scale B A)| / |scale B A| over the LoRA layers, all in float64 (the test's own sums)."""
    lost_sq = delta_sq = 0.0
    for name, layer in lora_layers(model):
        b, a = layer.lora_B["default"].weight.double(), layer.lora_A["default"].weight.double()
        delta = (b @ a) * layer.scaling["default"]
        lost = layer.base_layer.weight.double() - (before[name] + delta)
        lost_sq += float(lost.square().sum())
        delta_sq += float(delta.square().sum())
    return (lost_sq / delta_sq) ** 0.5


@pytest.mark.parametrize(
    ("dtype", "b_scale", "low", "high"),
    [
        (torch.float32, 1.0, 0.0, 1e-6),  # float32 keeps the delta (to float32 rounding)
        (torch.bfloat16, 1.0, 0.0, 0.05),  # a delta many bf16 steps wide: the rounding takes a few per cent at most
        (torch.bfloat16, 1e-5, 0.9, 1.1),  # under half a bf16 step of the weights: rounded away entirely
    ],
)
def test_merge_reports_the_share_of_the_delta_that_the_base_dtype_rounds_away(dtype, b_scale, low, high):
    model, _ = build_tiny(seed=0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, task_type="CAUSAL_LM")
    model = get_peft_model(model.to(dtype), config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5 * b_scale)
    before = {name: layer.base_layer.weight.double().clone() for name, layer in lora_layers(model)}
    # the merge leaves A and B as they are (a reset zeroes B after it): the test recomputes the delta from them
    rounding = merge_lora_in_place(model)
    expected = _independent_lost_fraction(before, model)
    assert low <= rounding.lost_fraction <= high
    assert rounding.lost_fraction == pytest.approx(expected, rel=1e-3, abs=1e-7)
    assert rounding.delta_sq > 0
