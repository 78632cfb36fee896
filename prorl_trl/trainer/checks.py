"""Settings checked before `GRPOTrainer.__init__` loads anything: what TRL would reject later, or a reset would break."""

from __future__ import annotations

import os
from typing import Any

from ..config import ProRLConfig, ResolvedPhase, peft_lora_shape
from ..reset import FSDP2, ZERO2, ZERO3, Engine, ResetNotSupportedError, check_engine_support, engine_of
from ..reset.engine import BF16_OPTIMIZER_PROBLEM
from ..rollout.vllm_sync import shadowed_by_generation_kwargs
from .callbacks import HardResetCallback, SamplingScheduleCallback
from .sampling import SAMPLING_KEYS


def check_before_init(
    args: ProRLConfig,
    phases: list[ResolvedPhase],
    model: Any,
    peft_config: Any,
    reward_funcs: list,
    callbacks: list,
    optimizers: tuple[Any, Any] = (None, None),
) -> None:
    """Fail before any model is loaded for settings TRL would reject later or that a reset would break."""
    is_peft = peft_config is not None or hasattr(model, "peft_config")
    base_beta_zero = args.beta == 0.0
    for phase in phases:
        if (phase.beta == 0.0) != base_beta_zero:
            raise ValueError(
                f"ProRLConfig phase {phase.index} ({phase.name}): beta={phase.beta} but the run starts with "
                f"beta={args.beta}. TRL creates the reference model only when beta != 0 at init, so beta can change "
                "between non-zero values but not to/from 0. Give the base config a non-zero beta."
            )
        if phase.reward_weights is not None and len(phase.reward_weights) != len(reward_funcs):
            raise ValueError(
                f"ProRLConfig phase {phase.index} ({phase.name}): reward_weights has {len(phase.reward_weights)} "
                f"entries for {len(reward_funcs)} reward functions (the overlong penalty is added separately)."
            )
    check_generation_kwargs(args, phases, callbacks)
    check_reward_shaping(args, phases)
    check_user_optimizers(args, phases, peft_config, callbacks, optimizers)
    if args.use_liger_kernel and (args.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
        # TRL 1.16 refuses it too, but in GRPOTrainer.__init__, after the model is loaded.
        raise ValueError(
            "use_liger_kernel with liger_kernel_config fused_linear_cross_entropy: true is not supported: Liger's "
            "fused linear cross-entropy replaces the model's forward, and TRL 1.16 computes every log-prob of the loss "
            "(policy, KL reference, kl_clamp, entropy masking) through its own fused LM head patched into that forward. "
            "That head already scores tokens in tiles without materialising the full logits (docs/performance.md), "
            "so drop fused_linear_cross_entropy; Liger's layer kernels (RMSNorm, RoPE, SwiGLU) still apply."
        )
    check_adapter_reset(args, phases, is_peft, callbacks)
    longest = max(phase.max_completion_length for phase in phases)
    if args.use_vllm and args.vllm_max_model_length is not None and longest >= args.vllm_max_model_length:
        raise ValueError(
            f"A phase generates up to {longest} tokens but vllm_max_model_length={args.vllm_max_model_length} is "
            "fixed when vLLM starts; set vllm_max_model_length above the longest phase's prompt + completion."
        )
    if args.early_stop_importance_ratio is not None and args.early_stop_importance_ratio <= 0:
        raise ValueError(f"early_stop_importance_ratio must be > 0 (RLinf uses 5.0), got {args.early_stop_importance_ratio}.")
    if args.dynamic_sampling:
        world = args.world_size
        for phase in phases:
            local_rows = phase.generation_batch_size // world
            if local_rows % phase.num_generations:
                raise ValueError(
                    f"dynamic_sampling needs whole groups on each process: phase {phase.index} ({phase.name}) has "
                    f"{local_rows} completions per process per generation batch, not a multiple of num_generations "
                    f"{phase.num_generations}. Make generation_batch_size / processes a multiple of num_generations."
                )
        if not reward_funcs:
            raise ValueError("dynamic_sampling needs a correctness reward function; none was given.")


def resets_possible(phases: list[ResolvedPhase], callbacks: list) -> bool:
    """Whether this run can hard-reset: a resetting phase boundary, a LoRA shape change, or a HardResetCallback."""
    shapes = [p.lora_shape for p in phases]
    reshapes = any(p.lora_r is not None and p.lora_shape != q for p, q in zip(phases[1:], shapes))
    return any(p.hard_reset for p in phases) or reshapes or any(isinstance(c, HardResetCallback) for c in callbacks)


def check_launch(args: ProRLConfig, engine: Engine, phases: list[ResolvedPhase], model: Any, peft_config: Any, callbacks: list) -> None:
    """Refuse, before any model loads, what this run cannot do under `engine` (`prorl_trl.reset.engine_of`).

    Raises `ResetNotSupportedError` (a `ValueError`) for an engine a planned reset cannot run under, and
    `ValueError` for compiled generation under ZeRO-3/FSDP2, for TRL's reference model under FSDP2 with
    rank-0-only loading, and for a ready PeftModel whose LoRA shape the phases change under a sharded engine.
    """
    if resets_possible(phases, callbacks) or (len(phases) > 1 and BF16_OPTIMIZER_PROBLEM in engine.problems):
        check_engine_support(engine)
    if args.max_nonfinite_skips > 0 and engine.kind in (ZERO2, ZERO3):
        raise ValueError(
            f"max_nonfinite_skips={args.max_nonfinite_skips} cannot be honoured under {engine.label}: DeepSpeed keeps "
            "the gradients in its own partitions and applies the update before a callback can see it, so a "
            "non-finite step can only be noticed afterwards (the run then stops). Set max_nonfinite_skips: 0, or run "
            "under DDP or FSDP2, where a bad step is skipped before it reaches the weights."
        )
    if args.compiled_generation and engine.kind in (ZERO3, FSDP2):
        raise ValueError(
            f"compiled_generation is not supported under {engine.label}: its CUDA graphs read the weights at fixed "
            "addresses, but ZeRO-3 and FSDP2 gather the parameters anew for every generation. Set "
            "`compiled_generation: false` (TRL's generation path), or use DeepSpeed ZeRO-2 or DDP, where the "
            "weights stay in place and compiled generation works."
        )
    full_fine_tuning = peft_config is None and not hasattr(model, "peft_config")
    if engine.kind == FSDP2 and engine.ram_efficient_loading and full_fine_tuning and args.beta != 0.0:
        raise ValueError(
            "Full fine-tuning with beta > 0 under FSDP2 with fsdp_cpu_ram_efficient_loading: true is refused: "
            "transformers then loads the weights on rank 0 only and accelerate broadcasts them to the policy, but "
            "TRL's reference model gets no broadcast (the other ranks' references would keep unloaded weights). Set "
            "fsdp_cpu_ram_efficient_loading: false (recipes/accelerate/fsdp.yaml), or beta: 0."
        )
    shapes = {(phase.lora_r, phase.lora_shape[2]) for phase in phases}
    if engine.sharded and peft_config is None and hasattr(model, "peft_config") and len(shapes) > 1:
        raise ResetNotSupportedError(
            f"Phases change the LoRA rank or targets under {engine.label}, but the model is a ready PeftModel. "
            "Pass the base model with `peft_config=LoraConfig(...)` instead: the adapter must be allocated for "
            "every phase (largest rank, union of targets) before the engine wraps the model."
        )


def check_reward_shaping(args: ProRLConfig, phases: list[ResolvedPhase]) -> None:
    """Refuse the DAPO overlong penalty and dynamic sampling with a TRL aggregation that would not compute DAPO's.

    DAPO (and verl) add the penalty to the correctness score, then take the group advantage of the score; dynamic
    sampling drops the groups of uniform correctness and computes the advantages of the kept batch. TRL 1.16's
    `_generate_and_score_completions`: `sum_then_normalize` sums the weighted columns (the penalty with weight 1), then
    subtracts the group mean and divides by the group's std ('group'), nothing ('none') or the std of the whole
    generation batch ('batch'); `normalize_then_sum` turns each column into per-group z-scores before the sum, then
    standardises the sum over the whole generation batch (and ignores `scale_rewards`). Dynamic sampling keeps each
    round's advantages, so a statistic over the batch would include the groups it drops.
    """
    penalised = [phase for phase in phases if phase.overlong_buffer > 0]
    if penalised and args.multi_objective_aggregation == "normalize_then_sum":
        first = penalised[0]
        where = f"overlong_buffer={first.overlong_buffer}"
        if first.index:
            where = f"ProRLConfig phase {first.index} ({first.name}) sets {where}"
        raise ValueError(
            f"The DAPO overlong penalty ({where}) cannot be used with multi_objective_aggregation="
            "'normalize_then_sum': TRL then normalises every reward function within its group before summing, so the "
            "penalty becomes a per-group z-score: overlong_penalty_factor has no effect, and a completion one token "
            "into the buffer is punished as hard as a wrong answer. DAPO and verl add the penalty to the score before "
            "the group advantage, which is what multi_objective_aggregation: sum_then_normalize (TRL's default) "
            "computes. Set multi_objective_aggregation: sum_then_normalize, or overlong_buffer: 0 (in every phase) to "
            "train without the penalty."
        )
    if not args.dynamic_sampling:
        return
    if args.multi_objective_aggregation == "normalize_then_sum":
        raise ValueError(
            "dynamic_sampling with multi_objective_aggregation='normalize_then_sum' is refused: after normalising each "
            "reward within its group, TRL standardises the summed reward over the whole generation batch, the groups "
            "dynamic sampling then drops included, and each refill round has its own mean and std, so the kept groups "
            "would train on advantages scaled by groups that are not trained. Set multi_objective_aggregation: "
            "sum_then_normalize (TRL's default; advantages per group, as DAPO computes them on the kept batch), or "
            "dynamic_sampling: false."
        )
    if args.scale_rewards == "batch":
        raise ValueError(
            "dynamic_sampling with scale_rewards='batch' is refused: TRL divides by the std of the whole generation "
            "batch, the groups dynamic sampling then drops included, and each refill round has its own std, so the "
            "kept groups would train on advantages scaled by groups that are not trained (DAPO and verl compute the "
            "advantages of the kept batch). Set scale_rewards: group (TRL's default) or none, whose statistics are "
            "per group, or dynamic_sampling: false."
        )


def check_generation_kwargs(args: ProRLConfig, phases: list[ResolvedPhase], callbacks: list) -> None:
    """Refuse a sampling key in `generation_kwargs` that a phase or a declared schedule changes.

    TRL applies `generation_kwargs` over its sampling fields on both backends, so such a change would reach the
    loss's log-prob temperature and the overlong penalty but not generation. A key nothing changes is TRL's business
    (e.g. `{"top_k": 50}`). Schedules that do not declare their keys are checked when they return them
    (`ProRLTrainer.apply_sampling` refuses the change before applying anything).
    """
    changed = {key for key in SAMPLING_KEYS if any(getattr(phase, key) != getattr(args, key) for phase in phases)}
    by_phase = shadowed_by_generation_kwargs(args.generation_kwargs, changed)
    if by_phase:
        raise ValueError(
            f"generation_kwargs sets {by_phase}, which a phase changes; TRL applies generation_kwargs after (and over) "
            "the phase settings, so the phase value would never reach generation. Set them as ProRLConfig / "
            "PhaseConfig fields instead (e.g. `temperature: 1.2`)."
        )
    if any(phase.overlong_buffer > 0 for phase in phases) and shadowed_by_generation_kwargs(
        args.generation_kwargs, ["max_completion_length"]
    ):
        raise ValueError(
            "generation_kwargs sets the completion cap (max_new_tokens / max_tokens), but the overlong penalty "
            "measures lengths against max_completion_length, so it would penalise the wrong lengths. Set the cap "
            "with max_completion_length (ProRLConfig / PhaseConfig) only."
        )
    for callback in callbacks:
        keys = getattr(callback, "keys", None) if isinstance(callback, SamplingScheduleCallback) else None
        unknown = sorted(set(keys or ()) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"SamplingScheduleCallback(keys=...) names {unknown}; allowed: {list(SAMPLING_KEYS)}.")
        by_schedule = shadowed_by_generation_kwargs(args.generation_kwargs, keys or ())
        if by_schedule:
            raise ValueError(
                f"generation_kwargs sets {by_schedule}, which a SamplingScheduleCallback changes; TRL applies "
                "generation_kwargs over the scheduled value. Remove them from generation_kwargs (the schedule and "
                "the ProRLConfig fields set them)."
            )


def check_user_optimizers(
    args: ProRLConfig, phases: list[ResolvedPhase], peft_config: Any, callbacks: list, optimizers: tuple[Any, Any]
) -> None:
    """User-built `optimizers=(optimizer, scheduler)` are used exactly as given, so refuse runs that must rebuild them.

    A new optimizer or schedule is built at a phase boundary (the next phase's learning rate and horizon), for new
    LoRA Parameters (a shape change), and at a hard reset with `reset_optimizer=True` (a fresh schedule; the
    optimizer's state is cleared in place, which keeps its class, settings and param groups). HF rebuilds its own
    optimizer (`optim`, `optim_args`, `trainer.optimizer_cls_and_kwargs`) and schedule (`lr_scheduler_type`,
    `lr_scheduler_kwargs`) the same way every time; a user-built object has no recipe to rebuild it from.
    """
    optimizer, scheduler = optimizers if optimizers is not None else (None, None)
    if optimizer is None and scheduler is None:
        return
    given = " and ".join(name for name, obj in (("an optimizer", optimizer), ("a scheduler", scheduler)) if obj is not None)
    fix = (
        "Let the trainer build them instead: choose the optimizer with `optim`/`optim_args` (or set "
        "`trainer.optimizer_cls_and_kwargs = (cls, kwargs)` before `train()`) and the schedule with "
        "`lr_scheduler_type`/`lr_scheduler_kwargs`; every phase and reset then rebuilds exactly those."
    )
    if len(phases) > 1:
        raise ValueError(
            f"`optimizers=(...)` passes {given} built for one schedule, but this run has {len(phases)} phases, and each "
            f"phase starts its own learning rate and LR schedule. {fix}"
        )
    first = phases[0]
    if optimizer is not None and first.lora_r is not None and first.lora_shape != peft_lora_shape(peft_config):
        raise ValueError(
            f"`optimizers=(...)` passes an optimizer over the adapter of `peft_config`, but phase 0 ({first.name}) "
            f"asks for another adapter shape {first.lora_shape}, whose new Parameters that optimizer does not hold. "
            f"{fix}"
        )
    if scheduler is not None and args.reset_optimizer and resets_possible(phases, callbacks):
        raise ValueError(
            "`optimizers=(..., scheduler)` passes a scheduler, and this run hard-resets with reset_optimizer=True, "
            f"which starts a fresh LR schedule that a scheduler object cannot be rebuilt into. {fix} Or set "
            "reset_optimizer=False (ProRL v2: the optimizer and its schedule carry on)."
        )


def check_optimizer_hook(optimizer_cls_and_kwargs: Any, phases: list[ResolvedPhase]) -> None:
    """HF's `trainer.optimizer_cls_and_kwargs` (set after init, read by `create_optimizer`) with an `lr` fixes one learning
    rate, but every phase after the first starts at its own `learning_rate`: refuse the mix before training."""
    kwargs = optimizer_cls_and_kwargs[1] if optimizer_cls_and_kwargs is not None else {}
    if len(phases) > 1 and "lr" in (kwargs or {}):
        raise ValueError(
            f"trainer.optimizer_cls_and_kwargs sets lr={kwargs['lr']}, but this run has {len(phases)} phases, and each "
            "phase starts at its own learning_rate. Remove `lr` from the kwargs and set `learning_rate` in ProRLConfig "
            "(and PhaseConfig where a phase differs)."
        )


def check_process_group(args: ProRLConfig) -> None:
    """Refuse processes that were launched together but did not join one process group.

    torchrun/accelerate set WORLD_SIZE for every process; accelerate forms the group only when it can (on a CPU-only
    machine, only with `use_cpu=True`). Otherwise each process trains alone and they overwrite each other's
    checkpoints in the one output folder, a run that looks fine and is not.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and args.distributed_state.num_processes == 1:
        raise ValueError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but they did not form a process group: each "
            "would train alone and overwrite the others' checkpoints. On a machine without GPUs set `use_cpu: true` "
            "(recipe: `training.use_cpu: true`, or `--training.use_cpu true`) so they join one over gloo; on GPUs "
            "check that every process sees a GPU."
        )


def check_adapter_reset(args: ProRLConfig, phases: list[ResolvedPhase], is_peft: bool, callbacks: list) -> None:
    """The parts of a LoRA reset that can be taken alone. TRL's LoRA reference is the adapter-disabled model, so a
    reset that freezes the adapter but keeps the reference keeps the frozen delta for the policy only, and a reference
    reset that keeps the adapter gives the reference a copy of the live delta (`prorl_trl.reset.frozen`'s one-forward
    parts). Both need frozen factors in one process or DDP: a merge moves the base, which both forwards share, and the
    sharded engines do not hold one-forward parts. A kept adapter also keeps its shape."""
    if is_peft and not args.reset_adapter and len({phase.lora_shape for phase in phases}) > 1:
        raise ValueError(
            "reset_adapter=False keeps one adapter through the whole run, but the phases give it different shapes "
            "(lora_r / lora_alpha / lora_target_modules): a new shape needs a new adapter. Give every phase the same "
            "LoRA shape, or keep reset_adapter=True."
        )
    if not resets_possible(phases, callbacks):
        return
    if not args.reset_adapter and not is_peft:
        raise ValueError(
            "reset_adapter=False applies to LoRA runs only: a full fine-tuning run has no adapter to keep or renew. "
            "Remove reset_adapter, or train with a peft_config."
        )
    if not is_peft or args.beta == 0.0 or args.reset_reference == args.reset_adapter:
        return
    knob = "reset_reference=False" if args.reset_adapter else "reset_adapter=False with reset_reference=True"
    if args.reset_adapter and args.lora_reset_mode != "frozen":
        raise ValueError(
            f"{knob} with LoRA and beta > 0 needs lora_reset_mode='frozen': TRL's reference is the adapter-disabled "
            "base, and a merge writes the adapter into that base, so the reference would move with it. Set "
            "lora_reset_mode: frozen (the delta is then kept for the policy only), or keep reset_reference=True."
        )
    if engine_of(args).sharded:
        raise ValueError(
            f"{knob} with LoRA and beta > 0 keeps a delta that acts in only one of the policy's and the reference's "
            "forwards, which runs in one process or under DDP, not under DeepSpeed ZeRO or FSDP. Launch without "
            "them, or reset every part (reset_adapter and reset_reference both True)."
        )
