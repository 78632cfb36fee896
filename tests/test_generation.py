"""The compiled static-cache generation path (prorl_trl.rollout.compiled) and the trl 1.16 internals it relies on."""

import inspect

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import CompileConfig, GenerationConfig
from trl import GRPOConfig, GRPOTrainer

from prorl_trl.rollout.compiled import (
    MIN_RECOMPILE_LIMIT,
    configure_trainer_generation,
    default_compile_config,
    enable_compiled_generation,
)
from prorl_trl.rollout.gqa_attention import kv_cache_bytes_per_token
from prorl_trl.tiny import build_tiny

MAX_COMPLETION_LENGTH = 6


def cpu_compile_config() -> CompileConfig:
    """Compile on CPU with the eager backend: dynamo traces the decode step, no C++ toolchain is needed."""
    config = CompileConfig(fullgraph=False, dynamic=False, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers' switch for compiling off-accelerator
    return config


def length_reward(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def build_trainer(tmp_path, peft_config=None, **overrides) -> GRPOTrainer:
    model, tokenizer = build_tiny(seed=0)
    dataset = Dataset.from_dict({"prompt": [f"Q{i}: {i}+{i}=" for i in range(8)]})
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        max_completion_length=MAX_COMPLETION_LENGTH,
        per_device_train_batch_size=4,
        num_generations=4,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        **overrides,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return build_trainer(tmp_path_factory.mktemp("generation"))


def test_trl_version_and_generation_config_where_we_expect_it(trainer):
    """Guard: trl 1.16 builds `generation_config` with `disable_compile=True` and generates with that object."""
    assert trl.__version__ == "1.16.0"
    assert isinstance(trainer.generation_config, GenerationConfig)
    assert trainer.generation_config.disable_compile is True
    assert trainer.generation_config.cache_implementation is None
    assert trainer.generation_config.max_new_tokens == MAX_COMPLETION_LENGTH
    assert trainer.generation_kwargs["max_new_tokens"] == MAX_COMPLETION_LENGTH
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "generation_config=self.generation_config" in source
    init_source = inspect.getsource(GRPOTrainer.__init__)
    assert "GenerationConfig(**generation_kwargs, disable_compile=True)" in init_source
    assert '"cache_implementation": args.cache_implementation' in init_source


def test_cache_implementation_reaches_the_generation_config_but_compile_stays_off(tmp_path):
    trainer = build_trainer(tmp_path, cache_implementation="static")
    assert trainer.generation_config.cache_implementation == "static"
    assert trainer.generation_config.disable_compile is True  # why the helper is needed


def test_configure_is_a_no_op_on_cpu_by_default(trainer):
    before = trainer.generation_config.to_dict()
    assert configure_trainer_generation(trainer, max_prompt_length=32) is False
    assert trainer.generation_config.to_dict() == before


def test_configure_sets_static_cache_compile_and_cache_length(tmp_path):
    trainer = build_trainer(tmp_path)
    assert configure_trainer_generation(trainer, max_prompt_length=40, require_accelerator=False) is True
    config = trainer.generation_config
    assert config.cache_implementation == "static" and config.disable_compile is False
    assert config.max_cache_len == 40 + MAX_COMPLETION_LENGTH
    assert config.compile_config == default_compile_config()
    assert trainer.generation_kwargs["cache_implementation"] == "static"
    assert torch._dynamo.config.recompile_limit >= MIN_RECOMPILE_LIMIT
    # A phase that changes the completion cap re-runs the helper: the cache length follows.
    trainer.max_completion_length = 10
    configure_trainer_generation(trainer, max_prompt_length=40, require_accelerator=False)
    assert config.max_new_tokens == 10 and config.max_cache_len == 50


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_trainer_step_generates_through_the_compiled_decode(tmp_path, use_lora):
    """A real GRPO step with the helper applied compiles the decode step of the (PEFT-wrapped) model and trains."""
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]) if use_lora else None
    trainer = build_trainer(tmp_path, peft_config=peft_config)
    configure_trainer_generation(
        trainer, max_prompt_length=64, compile_config=cpu_compile_config(), require_accelerator=False
    )
    base_model = trainer.model.get_base_model() if use_lora else trainer.model
    assert not hasattr(base_model, "_compiled_call")
    trainer.train()
    assert hasattr(base_model, "_compiled_call"), "generate did not take the compiled static-cache path"
    logged = trainer.state.log_history[0]
    assert logged["completions/max_length"] <= MAX_COMPLETION_LENGTH
    assert torch.isfinite(torch.tensor(logged["loss"]))


def test_compiled_static_path_generates_the_same_tokens_as_the_default_path():
    model, tokenizer = build_tiny(seed=0)
    model.eval()
    input_ids = torch.tensor([[3, 40, 41, 42, 43], [0, 0, 50, 51, 52]])
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    default = GenerationConfig(max_new_tokens=8, do_sample=False, disable_compile=True, pad_token_id=0)
    compiled = enable_compiled_generation(
        GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0), max_cache_len=16,
        compile_config=cpu_compile_config(),
    )
    with torch.no_grad():
        expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=default)
        got = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=compiled)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(got, expected)


def test_bad_settings_fail_with_a_clear_message(trainer):
    with pytest.raises(ValueError, match="leaves no room for the prompt"):
        enable_compiled_generation(GenerationConfig(max_new_tokens=16), max_cache_len=16)
    with pytest.raises(ValueError, match="use_cache=False"):
        enable_compiled_generation(GenerationConfig(max_new_tokens=4, use_cache=False))
    with pytest.raises(ValueError, match="max_prompt_length"):
        configure_trainer_generation(trainer, max_prompt_length=0, require_accelerator=False)


def test_vllm_and_continuous_batching_trainers_are_left_alone(tmp_path):
    trainer = build_trainer(tmp_path, use_transformers_continuous_batching=True)
    assert configure_trainer_generation(trainer, max_prompt_length=8, require_accelerator=False) is False
    assert trainer.generation_config.disable_compile is True


def test_kv_cache_bytes_per_token_for_qwen2_05b_shape():
    model, _ = build_tiny(seed=0, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    # 2 (K and V) x 3 layers x 2 KV heads x head_dim 16 x 2 bytes (bf16)
    assert kv_cache_bytes_per_token(model.config, torch.bfloat16) == 2 * 3 * 2 * 16 * 2


def test_prorl_config_exposes_compiled_generation_and_trainer_skips_it_on_cpu(tmp_path):
    """`compiled_generation` is a ProRLConfig switch; on CPU the trainer keeps TRL's eager default path."""
    from datasets import Dataset

    from prorl_trl import PhaseConfig, ProRLConfig, ProRLTrainer
    from prorl_trl.tiny import build_tiny

    model, tokenizer = build_tiny(seed=0)
    args = ProRLConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, save_strategy="no",
        compiled_generation=True, generation_max_prompt_length=16, phases=[PhaseConfig(max_steps=1)],
    )
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, args=args,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 8),
    )
    trainer.train()
    assert trainer.generation_config.disable_compile is True  # TRL's default stays on CPU
    assert trainer._compiled_generation is False
