"""Guard tests: one per TRL/transformers private internal ProRLTrainer relies on (pinned trl==1.16.0).

If one fails after an upgrade, the named ProRLTrainer code path must be revisited, not the test.
"""

import inspect

import pytest
import torch
import trl
from _prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model
from transformers import GenerationConfig, Trainer, TrainerState
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer.utils import add_fused_lm_head

from prorl_trl import ProRLTrainer


def test_trl_version_is_the_pinned_one():
    assert trl.__version__ == "1.16.0"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    model, tokenizer = tiny_model()
    return ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=tiny_args(tmp_path_factory.mktemp("guard"), max_steps=1), train_dataset=prompts_dataset(),
        peft_config=lora(),
    )


def test_generation_settings_live_in_generation_config_and_kwargs(trainer):
    # apply_sampling writes these; TRL's _generate_single_turn reads generation_config at every call.
    assert isinstance(trainer.generation_config, GenerationConfig)
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"):
        assert key in trainer.generation_kwargs and hasattr(trainer.generation_config, key)
    assert "generation_config=self.generation_config" in inspect.getsource(GRPOTrainer._generate_single_turn)


def test_vllm_generation_reads_sampling_attributes_at_each_call():
    init, generate = inspect.getsource(VLLMGeneration.__init__), inspect.getsource(VLLMGeneration.generate)
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length"):
        assert f"self.{key} = {key}" in init
        assert f"self.{key}" in generate
    assert "_last_loaded_step" in inspect.getsource(GRPOTrainer._generate_single_turn)


def test_fused_head_temperature_is_fixed_at_patch_time():
    signature = inspect.signature(add_fused_lm_head)
    assert {"temperature", "cast_lm_head_to_fp32", "outputs"} <= set(signature.parameters)
    assert "add_fused_lm_head(" in inspect.getsource(GRPOTrainer.__init__)
    assert "fused_lm_head=True" in inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)


def test_generation_buffer_and_step_counter(trainer):
    assert trainer._buffered_inputs is None and trainer._step == 0
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "self._buffered_inputs" in source and "self._step" in source
    assert "self._generate_and_score_completions(" in source


def test_metrics_buffer_and_live_loss_attributes(trainer):
    assert set(trainer._metrics) == {"train", "eval"}
    assert isinstance(trainer.reward_weights, torch.Tensor)
    for name in ("epsilon_low", "epsilon_high", "beta", "num_generations", "temperature", "max_completion_length"):
        assert hasattr(trainer, name), name
    loss_source = inspect.getsource(GRPOTrainer._compute_loss)
    assert "self.epsilon_low" in loss_source and "self.epsilon_high" in loss_source and "self.beta" in loss_source
    # Phases change the group size and generation batch between train() calls: TRL must read them when it builds
    # the sampler, not cache them at init.
    sampler_source = inspect.getsource(GRPOTrainer._get_train_sampler)
    assert "self.num_generations" in sampler_source and "self.args.generation_batch_size" in sampler_source
    assert "self.args.steps_per_generation" in inspect.getsource(GRPOTrainer._prepare_inputs)  # _apply_phase sets it
    assert "self.reward_weights" in inspect.getsource(GRPOTrainer._generate_and_score_completions)


def test_overridden_private_methods_keep_their_signatures():
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(GRPOTrainer._calculate_rewards) == ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert params(GRPOTrainer._compute_loss) == ["self", "model", "inputs"]
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep"
    ]
    assert "return rewards_per_func" in inspect.getsource(GRPOTrainer._calculate_rewards)
    assert params(Trainer._get_output_dir) == ["self", "trial"]
    assert {"num_training_steps", "optimizer"} <= set(inspect.signature(Trainer.create_scheduler).parameters)


def test_generate_single_turn_contract_the_rollout_engine_reproduces():
    """`ProRLTrainer._generate_single_turn` (rollout engine) returns what TRL's transformers branch returns; these
    are the steps of that branch `prorl_trl.rollout.trl_generation` mirrors."""
    params = list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)
    assert params == ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"]
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    for step in ('padding_side="left"', "pad_to_multiple_of=self.pad_to_multiple_of", "unwrap_model_for_generation(",
                 "generation_kwargs=self.generation_kwargs", "torch.isin(completion_ids, torch.tensor(self.eos_token_ids",
                 "(sequence_indices <= eos_idx.unsqueeze(1))", "logprobs = None", "return completion_ids, logprobs"):  # fmt: skip
        assert step in source, step
    from transformers import GenerationMixin

    assert list(inspect.signature(GenerationMixin._prepare_generation_config).parameters)[:2] == ["self", "generation_config"]


def test_hf_resume_loads_optimizer_and_scheduler_after_building_them_from_the_settings():
    """`ProRLTrainer._load_optimizer_and_scheduler` reads the freshly built scheduler's `base_lrs` (this run's rate)
    before HF's load overwrites them, rebuilds the schedule with `create_scheduler(num_training_steps, optimizer)` over
    `state.max_steps` (loaded, then set to this run's length, before the optimizer is prepared) and moves the loaded
    LambdaLR (`base_lrs`, `lr_lambdas`, `_last_lr`) to it; HF's default schedules are LambdaLR."""
    from transformers.optimization import get_scheduler

    assert list(inspect.signature(Trainer._load_optimizer_and_scheduler).parameters) == ["self", "checkpoint"]
    assert list(inspect.signature(Trainer.create_scheduler).parameters) == ["self", "num_training_steps", "optimizer"]
    assert "return self.lr_scheduler" in inspect.getsource(Trainer.create_scheduler)
    prepare = inspect.getsource(Trainer._prepare_for_training)
    assert prepare.index("self.create_scheduler(") < prepare.index("self._load_optimizer_and_scheduler(")
    loop = inspect.getsource(Trainer._inner_training_loop)
    assert loop.index("self._init_training_state(") < loop.index("self._prepare_for_training(")
    assert "self.max_steps = max_steps" in inspect.getsource(TrainerState.init_training_references)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=4)
    assert scheduler.base_lrs == [1e-3] and len(scheduler.lr_lambdas) == 1 and scheduler.lr_lambdas[0](2) > 0


def test_hf_loop_reads_optimizer_and_scheduler_from_self_each_step():
    source = inspect.getsource(Trainer._run_epoch)
    assert "self.optimizer.step()" in source and "self.lr_scheduler.step()" in source
    assert "current_gradient_accumulation_steps" in source


def test_accelerator_optimizer_registry(trainer):
    assert isinstance(trainer.accelerator._optimizers, list)


def test_tokenizer_and_batch_keys_dynamic_sampling_and_early_stop_rely_on(trainer):
    # dynamic sampling re-pads merged rounds with `_tokenizer.pad_token_id` and recounts `num_items_in_batch` the way
    # TRL does; early stop reads `old_per_token_logps` (absent = on-policy) and the `tool_mask`-weighted completion mask.
    assert trainer._tokenizer is trainer.processing_class and trainer._tokenizer.pad_token_id is not None
    assert "self._tokenizer = processing_class" in inspect.getsource(GRPOTrainer.__init__)
    produce = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert 'output["old_per_token_logps"] = old_per_token_logps' in produce and 'output["tool_mask"]' in produce
    assert "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()" in produce
    assert "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask" in produce
    consume = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'inputs.get("old_per_token_logps")' in consume and 'inputs["num_items_in_batch"]' in consume
    assert 'inputs["completion_mask"]' in consume and 'inputs["tool_mask"]' in consume


def test_lora_reference_is_the_base_or_the_ref_adapter(tmp_path):
    # hard_reset moves a LoRA run's KL reference by merging into the base (and resetting a "ref" adapter): TRL must
    # keep no separate reference model for PEFT and compute the reference under `use_adapter(None | "ref")`.
    model, tokenizer = tiny_model()
    trainer = ProRLTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=tiny_args(tmp_path, max_steps=1, beta=0.05), train_dataset=prompts_dataset(), peft_config=lora(),
    )
    assert trainer.beta == 0.05 and trainer.ref_model is None
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert 'use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)' in source


def test_reference_copy_rule_the_load_line_states():
    # `prorl-trl train` prints "policy + reference (a second copy ...)" for full fine-tuning with beta != 0 and
    # "policy" otherwise (recipe.run._models_loaded): TRL loads the second copy only in that case.
    from prorl_trl.recipe.run import _models_loaded

    source = inspect.getsource(GRPOTrainer.__init__)
    assert "if self.beta == 0.0:" in source and "elif is_peft_model(model):" in source
    assert "self.ref_model = create_model_from_path(get_config_model_id(self.model.config)" in source
    assert "reference" in _models_loaded("m", 0.01, peft=False)
    assert _models_loaded("m", 0.0, peft=False) == _models_loaded("m", 0.01, peft=True) == "m: policy"


def test_resume_internals_a_finished_phase_restores_by_hand():
    # ProRLTrainer._restore_finished_phase: HF's train() checks max_steps only after a step (DefaultFlowCallback), so a
    # resume from a phase's last checkpoint calls these instead; _save_checkpoint is overridden to un-commit first.
    from transformers.trainer import OPTIMIZER_NAME
    from transformers.trainer_callback import DefaultFlowCallback

    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(Trainer._load_from_checkpoint)[:2] == ["self", "resume_from_checkpoint"]
    assert params(Trainer._load_rng_state) == ["self", "checkpoint"]
    assert params(Trainer._save_checkpoint) == ["self", "model", "trial"]
    assert OPTIMIZER_NAME == "optimizer.pt"
    assert "torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))" in inspect.getsource(
        Trainer._save_optimizer_and_scheduler
    )
    assert "state.global_step >= state.max_steps" in inspect.getsource(DefaultFlowCallback.on_step_end)


def test_tracker_callbacks_internals_trackers_span_relies_on():
    # prorl_trl.trainer.trackers: the run is opened in on_train_begin and closed in on_train_end (MLflow ends it,
    # trackio finishes it), steps come from state.global_step; these private attributes continue a resumed run.
    from transformers.integrations import INTEGRATION_TO_CALLBACK, MLflowCallback, TensorBoardCallback, TrackioCallback

    assert {"tensorboard", "trackio", "wandb", "mlflow"} <= set(INTEGRATION_TO_CALLBACK)
    assert "end_run()" in inspect.getsource(MLflowCallback.on_train_end)
    assert "self._trackio.finish()" in inspect.getsource(TrackioCallback.on_train_end)
    assert "self.tb_writer.close()" in inspect.getsource(TensorBoardCallback.on_train_end)
    assert "state.global_step" in inspect.getsource(TensorBoardCallback.on_log)
    callback = TensorBoardCallback()
    assert hasattr(callback, "_SummaryWriter") and hasattr(callback, "logging_dir") and callback.tb_writer is None
    assert "purge_step" in inspect.signature(callback._SummaryWriter).parameters
    assert 'os.getenv("MLFLOW_RUN_ID"' in inspect.getsource(MLflowCallback.setup)
    assert "self._ml_flow = mlflow" in inspect.getsource(MLflowCallback.__init__)


def test_trl_loads_models_by_path_with_device_map_none_only_under_ddp_and_deepspeed():
    # Why ProRLTrainer sets device_map to the process's device under FSDP2 (trainer.placement): TRL builds the models
    # it loads by path with its default device_map="auto" there (seen on 2 x H100: "found at least two devices").
    source = inspect.getsource(GRPOTrainer.__init__)
    assert source.count('distributed_type in ["MULTI_GPU", "DEEPSPEED"]') >= 2 and '"FSDP"' not in source


def test_what_the_drop_in_parity_relies_on():
    # args=None: ProRLTrainer names its default config after the model like GRPOTrainer, with TRL's helper.
    from trl.trainer.utils import get_config_model_id

    init = inspect.getsource(GRPOTrainer.__init__)
    assert 'args = GRPOConfig(f"{model_name}-GRPO")' in init and "get_config_model_id(model.config)" in init
    assert callable(get_config_model_id)
    # generation_kwargs is applied over the sampling fields (transformers path), which is why a key a phase or a
    # schedule changes is refused and any other key is left to TRL.
    assert "generation_kwargs.update(args.generation_kwargs)" in init
    # An environment's `get_reward` is appended with weight 1 after the user's rewards; `_apply_phase` keeps it.
    assert "self.reward_weights = torch.cat([self.reward_weights, torch.ones(1)])" in init
    # Every optimizer a phase or reset builds comes from HF's create_optimizer, which honours this documented hook.
    assert "self.optimizer_cls_and_kwargs" in inspect.getsource(Trainer.create_optimizer)
    # A plain TRL checkpoint is recognised by HF's trainer state file (phase 0, its global_step and log_history).
    from transformers.trainer import TRAINER_STATE_NAME

    assert TRAINER_STATE_NAME == "trainer_state.json"
    assert "TRAINER_STATE_NAME" in inspect.getsource(Trainer._save_checkpoint)


def test_hf_loss_sum_a_resumed_phase_puts_back():
    # `ProRLTrainer._phase_loss_sum` saves `_total_loss_scalar` + `_tr_loss` with each checkpoint and `_on_train_begin`
    # puts the sum back: HF zeroes both before `on_train_begin`, and `_finalize_training` divides the sum by this
    # call's steps and logs it as `train_loss` beside `train_runtime` (how `log` recognises the summary).
    loop = inspect.getsource(Trainer._inner_training_loop)
    assert "self._tr_loss = torch.tensor(0.0" in loop
    assert loop.index("self._total_loss_scalar = 0.0") < loop.index("callback_handler.on_train_begin")
    final = inspect.getsource(Trainer._finalize_training)
    assert "self._total_loss_scalar += self._tr_loss.item()" in final
    assert "train_loss = self._total_loss_scalar / max(num_steps_trained" in final
    assert 'speed_metrics(\n            "train"' in final and 'metrics["train_loss"] = train_loss' in final
    assert final.index('metrics["train_loss"]') < final.index("self.log(metrics)")
