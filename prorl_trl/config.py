"""`ProRLConfig` (a `trl.GRPOConfig` with phases, hard resets, overlong penalty and dynamic sampling) and `PhaseConfig`.

A ProRL run is a list of phases. Each `PhaseConfig` field left at `None` carries over from the previous phase (the
first phase takes it from the base `ProRLConfig`, and the LoRA fields from the trainer's `peft_config`).
`resolve_phases` turns the list into fully specified `ResolvedPhase` objects before any model is loaded, so a bad
phase fails fast with a message that names it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from .attention import CUDNN_GUARD_MODES

# PhaseConfig fields that mirror a GRPOConfig field of the same name (carried over from the base config).
GRPO_PHASE_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_generations",
    "max_completion_length",
    "generation_batch_size",
    "learning_rate",
    "beta",
    "epsilon",
    "epsilon_high",
    "reward_weights",
)
# PhaseConfig fields that mirror a ProRLConfig (not GRPOConfig) field of the same name.
PRORL_PHASE_FIELDS = ("overlong_buffer", "overlong_penalty_factor", "plateau_patience", "plateau_min_delta")
# PhaseConfig fields that mirror a peft.LoraConfig field: phase field -> LoraConfig attribute.
LORA_PHASE_FIELDS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_target_modules": "target_modules"}
# How a hard reset keeps the LoRA delta (`ProRLConfig.lora_reset_mode`; see prorl_trl/reset/frozen.py).
LORA_RESET_MODES = ("frozen", "merge")
# The dtypes a merged save can be written in (`ProRLConfig.merged_save_dtype`; see prorl_trl/reset/save.py).
MERGED_SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class PhaseConfig:
    r"""
    One phase of a ProRL run. Every field left at `None` carries over from the previous phase (the first phase from
    the base [`ProRLConfig`] and the trainer's `peft_config`).

    Parameters:
        > Identity and length

        name (`str`, *optional*): Name shown on the console and in the phase table; defaults to `phase-<index>`.
        max_steps (`int`, *optional*): Optimizer steps of this phase (the phase may end earlier on a validation
            plateau). Unset in a single-phase run: `ProRLConfig.max_steps`, or, when that is unset too, the length
            HF derives from `num_train_epochs` (exactly `GRPOTrainer`'s steps). A multi-phase run needs it on every
            phase.
        hard_reset (`bool`, *optional*): Whether to hard-reset when entering this phase (keep the LoRA delta, fresh
            adapter, optimizer, reference). Defaults to `ProRLConfig.hard_reset_between_phases`; ignored for the first phase.

        > Sampling (reaches both generation and the loss's log-prob temperature)

        temperature, top_p, top_k, min_p, repetition_penalty, num_generations, max_completion_length,
        generation_batch_size: as in `GRPOConfig`. When `num_generations` changes and `generation_batch_size` is not
        set, the number of prompts per generation batch is kept (rounded up to whole micro-batches).

        > Overlong penalty (DAPO eq. 13)

        overlong_buffer (`int`, *optional*): Length of the soft-penalty buffer before `max_completion_length`;
            `0` disables the penalty.
        overlong_penalty_factor (`float`, *optional*): Penalty at the cap (the penalty is linear in the buffer).

        > LoRA (a change of shape is applied at the phase boundary)

        lora_r, lora_alpha, lora_target_modules: rank, alpha and target modules of the phase's fresh adapter.

        > Optimisation

        learning_rate, beta, epsilon, epsilon_high, reward_weights: as in `GRPOConfig`.

        > Plateau rule

        plateau_patience (`int`, *optional*): End the phase when the validation metric has not improved by
            `plateau_min_delta` for this many evaluations. `0`/unset: never.
        plateau_min_delta (`float`, *optional*): Smallest improvement that counts.
    """

    max_steps: int | None = field(
        default=None,
        metadata={
            "help": "Optimizer steps of this phase (it may end earlier on a plateau). Unset: a single-phase run takes "
            "`max_steps`, else `num_train_epochs` (as HF does); a multi-phase run needs it on every phase."
        },
    )
    name: str | None = field(
        default=None, metadata={"help": "Phase name for the console and the phase table (default `phase-<i>`)."}
    )
    hard_reset: bool | None = field(
        default=None,
        metadata={
            "help": "Hard-reset when entering this phase (keep the LoRA delta, fresh adapter/optimizer, reference "
            "reset). None: `ProRLConfig.hard_reset_between_phases`. Ignored for the first phase."
        },
    )
    temperature: float | None = field(default=None, metadata={"help": "Sampling and log-prob temperature."})
    top_p: float | None = field(default=None, metadata={"help": "Nucleus sampling probability mass."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (0 disables)."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling threshold."})
    repetition_penalty: float | None = field(default=None, metadata={"help": "Generation repetition penalty."})
    num_generations: int | None = field(
        default=None, metadata={"help": "Completions per prompt (group size, >= 2); may change only between phases."}
    )
    max_completion_length: int | None = field(default=None, metadata={"help": "Maximum completion tokens."})
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation batch (global). None: keep the previous phase's prompts per "
            "generation batch, times this phase's `num_generations` (rounded up to whole micro-batches)."
        },
    )
    overlong_buffer: int | None = field(
        default=None, metadata={"help": "DAPO soft overlong buffer length in tokens (0 disables the penalty)."}
    )
    overlong_penalty_factor: float | None = field(
        default=None, metadata={"help": "Overlong penalty at the completion cap (linear inside the buffer)."}
    )
    lora_r: int | None = field(default=None, metadata={"help": "LoRA rank of this phase's adapter."})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha of this phase's adapter."})
    lora_target_modules: list[str] | str | None = field(
        default=None, metadata={"help": "LoRA target modules of this phase's adapter (list, or 'all-linear')."}
    )
    learning_rate: float | None = field(default=None, metadata={"help": "Learning rate of this phase."})
    beta: float | None = field(default=None, metadata={"help": "KL coefficient (0 <-> non-0 cannot change mid-run)."})
    epsilon: float | None = field(default=None, metadata={"help": "Lower clip range epsilon."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range epsilon (clip-higher)."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weights of the reward functions."})
    plateau_patience: int | None = field(
        default=None, metadata={"help": "Evaluations without improvement that end the phase (0: never)."}
    )
    plateau_min_delta: float | None = field(default=None, metadata={"help": "Smallest validation improvement."})


@dataclass
class ResolvedPhase:
    """A phase with every setting filled in (see `resolve_phases`). Plain data: the trainer applies it."""

    index: int
    name: str
    max_steps: int  # -1: the length HF derives from `num_train_epochs` (single-phase runs only)
    num_train_epochs: float
    hard_reset: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float | None
    repetition_penalty: float
    num_generations: int
    max_completion_length: int
    generation_batch_size: int
    overlong_buffer: int
    overlong_penalty_factor: float
    lora_r: int | None
    lora_alpha: float | None
    lora_target_modules: list[str] | str | None
    learning_rate: float
    beta: float
    epsilon: float
    epsilon_high: float | None
    reward_weights: list[float] | None
    plateau_patience: int
    plateau_min_delta: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_phase_config(self) -> PhaseConfig:
        """This phase with every setting explicit; resolving a list of these gives the same phases back."""
        values = {k: v for k, v in self.to_dict().items() if k not in ("index", "num_train_epochs")}
        if self.max_steps < 1:  # the length of a single phase comes from num_train_epochs: leave it unset
            values["max_steps"] = None
        return PhaseConfig(**values)

    @property
    def length(self) -> str:
        """The phase's length as the phase table shows it: `300` (steps) or `2ep` (from `num_train_epochs`)."""
        return str(self.max_steps) if self.max_steps > 0 else f"{self.num_train_epochs:g}ep"

    @property
    def lora_shape(self) -> tuple:
        """What decides whether a new adapter is needed: rank, alpha, targets."""
        return _lora_shape(self.lora_r, self.lora_alpha, self.lora_target_modules)


@dataclass
class ProRLConfig(GRPOConfig):
    r"""
    Configuration of [`ProRLTrainer`]: every `trl.GRPOConfig` field, plus the following.

    Parameters:
        > Phases

        phases (`list[PhaseConfig | dict]`, *optional*): The phases to run in order. None: one phase with the base
            settings, as long as `GRPOTrainer` would train (`max_steps`, else `num_train_epochs`).
        reseed_phases (`bool`, defaults to `True`): Shift the data seed per phase, so phase k+1 does not re-read
            the prompts of phase k in the same order (TRL rebuilds its sampler from `seed` on every `train()`).

        > Hard reset

        hard_reset_between_phases (`bool`, defaults to `True`): Hard-reset at every phase boundary.
        reset_optimizer (`bool`, defaults to `True`): A reset starts a fresh optimizer state and LR schedule
            (ProRL v1). False keeps the moments (ProRL v2).
        reset_reference (`bool`, defaults to `True`): A reset moves the KL reference to the current policy. With
            LoRA, False keeps the reference (the adapter-disabled model): the frozen delta then acts in the policy's
            forward only (`lora_reset_mode="frozen"`, one process or DDP).
        reset_adapter (`bool`, defaults to `True`): With LoRA, a reset keeps the adapter's delta and starts a fresh
            adapter. False keeps the live adapter training through the reset; with `reset_reference=True` and beta > 0
            the reference then gets a copy of the live delta acting in its forward only, so it equals the policy.
            Each part of a reset (adapter, `reset_optimizer`, `reset_reference`) can so be taken alone: the prolonged
            study's knob arms. Every phase must keep one adapter shape. LoRA only.
        save_merged_on_reset (`bool`, defaults to `True`): Save the merged model under
            `<output_dir>/merged/reset-<k>/` at every reset.
        merged_save_dtype (`str`, defaults to `"auto"`): The dtype of merged saves (`merged/reset-<k>/`, `final/`),
            whose LoRA deltas are folded in float32 first. `"auto"`: the base weights' dtype when that keeps the
            deltas (at most 1 % of their norm rounded away), else float32; or `"float32"`, `"bfloat16"`, `"float16"`.
        lora_reset_mode (`str`, defaults to `"frozen"`): How a hard reset keeps the LoRA delta. `"frozen"`: as frozen
            low-rank factors beside the base weights, which are never written (exact in every dtype, quantised bases
            included; the forward pays for the frozen rank). `"merge"`: added into the base weights (exact only for
            a float32 base computed without autocast; a bf16 base rounds most of a small delta away).
        consolidate_frozen_parts (`bool`, defaults to `False`): With `"frozen"`, join each layer's frozen parts
            into one at every reset, so later steps pay for one part (float32 rounding instead of bitwise resets),
            with zero room for the planned resets, filled in place (the rollout engine keeps its graphs).

        > Overlong penalty

        overlong_buffer (`int`, defaults to `0`): DAPO soft overlong buffer (tokens); 0 disables. The penalty is added
            to the score before the group advantage, as in DAPO/verl: it needs `multi_objective_aggregation`
            `"sum_then_normalize"` (TRL's default; `"normalize_then_sum"` would make it a per-group z-score).
        overlong_penalty_factor (`float`, defaults to `1.0`): Penalty at the cap.

        > Dynamic sampling

        dynamic_sampling (`bool`, defaults to `False`): Drop groups whose correctness is uniform (all values
            exactly equal, as verl's filter), refill with fresh prompts. The kept groups keep their per-group
            advantages, so it needs `scale_rewards` `"group"` or `"none"` with `"sum_then_normalize"` (batch-wide
            statistics would include the dropped groups).
        dynamic_sampling_reward (`str`, *optional*): `__name__` of the correctness reward it keys on (default:
            the first reward function).
        dynamic_sampling_max_rounds (`int`, defaults to `3`): Extra generation rounds per step to refill.

        > Generation speed

        compiled_generation (`bool`, defaults to `False`): Static KV cache + compiled decode step + grouped-query
            decode attention on GPU (see `prorl_trl.rollout.compiled`); the shipped recipes enable it.
        generation_max_prompt_length (`int`, *optional*): Prompt budget of the static cache, so each phase
            compiles once.
        rollout_engine (`bool`, defaults to `False`): Generate with `prorl_trl.rollout`'s CUDA-graph decode loop
            (prefill + captured decode steps, sort-free sampling, early stop) instead of `generate`; CUDA only, falls
            back to TRL's path elsewhere; the shipped recipes enable it.

        > KL term

        kl_clamp (`bool`, defaults to `False`): Bound the k3 KL term as verl's `low_var_kl` does
            (`prorl_trl.trainer.kl_clamp`); off: TRL's unbounded term.

        > Minibatch early stop (RLinf)

        early_stop_importance_ratio (`float`, *optional*): Zero a micro-batch's loss when its token-masked mean
            importance ratio exceeds this. None: off (RLinf uses 5.0).

        > Plateau rule

        plateau_metric (`str`, defaults to `"eval_reward"`): Logged metric the plateau rule watches.
        plateau_mode (`str`, defaults to `"max"`): `"max"` (higher is better) or `"min"`.
        plateau_patience (`int`, defaults to `0`): Base patience for phases that do not set one (0: off).
        plateau_min_delta (`float`, defaults to `0.0`): Base minimum improvement.

        > Safety

        stop_on_nonfinite (`bool`, defaults to `True`): Stop before an optimizer step whose gradients are NaN or inf
            (`NonFiniteUpdate`), so the weights and the latest checkpoint stay good (`prorl_trl.trainer.finite`).
        max_nonfinite_skips (`int`, defaults to `0`): With `stop_on_nonfinite`, how many such steps a run skips (the
            update dropped, weights and optimizer state untouched, logged) before it stops; 0: stop at the first.
        cudnn_attention_guard (`str`, defaults to `"auto"`): Keep cuDNN's SDPA backward from making training gradients
            NaN on H100/H200 (`prorl_trl.attention`): `"auto"` (the lengths it gets wrong), `"always"`, `"off"`.

        > Resume

        resume_from_checkpoint (`str` or `bool`, *optional*): A checkpoint folder, or `True` (`"true"`, `"latest"`)
            for the latest complete checkpoint of `output_dir`; used by `ProRLTrainer.train()` when it is called without
            one.
    """

    phases: list[dict] | None = field(
        default=None,
        metadata={
            "help": "The phases, in order (PhaseConfig or dicts). None: one phase of `max_steps` (else "
            "`num_train_epochs`), exactly as GRPOTrainer trains."
        },
    )
    reseed_phases: bool = field(
        default=True, metadata={"help": "Shift the data seed per phase so phases do not replay the same prompts."}
    )
    hard_reset_between_phases: bool = field(
        default=True,
        metadata={"help": "Hard-reset (keep the LoRA delta, fresh adapter/optimizer/reference) between phases."},
    )
    reset_optimizer: bool = field(
        default=True, metadata={"help": "A hard reset clears the optimizer state and restarts the LR schedule."}
    )
    reset_reference: bool = field(
        default=True, metadata={"help": "A hard reset moves the KL reference policy to the current policy."}
    )
    reset_adapter: bool = field(
        default=True,
        metadata={
            "help": "With LoRA, a hard reset keeps the delta and starts a fresh adapter. False keeps the live adapter "
            "(the reset then restarts only what reset_optimizer / reset_reference ask for)."
        },
    )
    save_merged_on_reset: bool = field(
        default=True, metadata={"help": "Save the merged model under <output_dir>/merged/reset-<k>/ at each reset."}
    )
    merged_save_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of merged saves (merged/reset-<k>/, final/), folded in float32 first: 'auto' writes the "
            "base dtype when that keeps the LoRA deltas (<= 1 % of their norm rounded away), else float32.",
            "choices": list(MERGED_SAVE_DTYPES),
        },
    )
    consolidate_frozen_parts: bool = field(
        default=False,
        metadata={
            "help": "lora_reset_mode 'frozen': at each reset join a layer's frozen LoRA parts into one (ranks stacked, "
            "scalings folded in float32), so steps cost one part however many resets came before (each part made an "
            "H100 step of a small model ~0.09 s slower). The delta is kept to float32 rounding, but such a reset is no "
            "longer bitwise a no-op (outputs move by float32 rounding; a bf16 model's by up to one bf16 step). Float32 "
            "adapters only: a bf16 (QLoRA) adapter's parts stay one per reset, since folding the scaling would round "
            "them. The joined part leaves zero rank for the resets the phases plan, which later resets fill in place, "
            "so the rollout engine keeps its compiled graphs. Off: one part per reset, every reset exact to the bit."
        },
    )
    lora_reset_mode: str = field(
        default="frozen",
        metadata={
            "help": "How a hard reset keeps the LoRA delta: 'frozen' keeps each phase's adapter as frozen low-rank "
            "factors beside the base weights (exact in every dtype, QLoRA included); 'merge' adds it into the base "
            "weights (exact only in float32 without autocast: a bf16 base rounds most of a small delta away).",
            "choices": list(LORA_RESET_MODES),
        },
    )
    overlong_buffer: int = field(
        default=0,
        metadata={
            "help": "DAPO soft overlong buffer length in tokens before the cap; 0 disables. Added to the score before "
            "the group advantage: needs multi_objective_aggregation sum_then_normalize (TRL's default)."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"help": "Overlong penalty at the completion cap (linear inside the buffer)."}
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Drop groups whose correctness is all-right or all-wrong and refill with fresh prompts. Needs "
            "per-group advantages: scale_rewards group or none, multi_objective_aggregation sum_then_normalize."
        },
    )
    dynamic_sampling_reward: str | None = field(
        default=None,
        metadata={"help": "Name of the correctness reward dynamic sampling keys on (default: the first reward)."},
    )
    dynamic_sampling_max_rounds: int = field(
        default=3, metadata={"help": "Extra generation rounds per step used to refill dropped groups."}
    )
    compiled_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate with a static KV cache, a torch.compile'd (CUDA-graph) decode step and grouped-query "
            "decode attention on TRL's transformers path: 3.5-6x faster on GPU (benchmarks/results/generation.md); "
            "the recipes turn it on. No effect on CPU, with vLLM or with continuous batching."
        },
    )
    generation_max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Prompt tokens reserved in the static KV cache of `compiled_generation` (cache = this + "
            "max_completion_length), so each phase compiles once. None: the cache follows the longest prompt seen."
        },
    )
    rollout_engine: bool = field(
        default=False,
        metadata={
            "help": "Generate rollouts with prorl_trl.rollout's own decode loop: one prefill, then decode steps "
            "captured as CUDA graphs and replayed back to back (transformers' sampling distribution, sort-free top-p, "
            "stop checked every 16 steps); 3.4x `compiled_generation`'s decode rate at the seed's Initial shape on an "
            "H100 (benchmarks/results/rollout_engine.md). CUDA only: on CPU, with vLLM, FSDP, ZeRO-3 or an unsupported "
            "model or setting it falls back to TRL's path (with a warning). The recipes turn it on."
        },
    )
    kl_clamp: bool = field(
        default=False,
        metadata={
            "help": "Bound TRL's k3 KL term as verl's low_var_kl does (log-ratio within +-20, term within +-10; the "
            "recipes that mirror verl turn it on): a token past the bounds adds no KL gradient, as in verl, instead "
            "of overflowing exp() and making the step's gradients NaN. Off: TRL's unbounded term."
        },
    )
    early_stop_importance_ratio: float | None = field(
        default=None,
        metadata={"help": "Zero a micro-batch's loss when its mean importance ratio exceeds this (RLinf: 5.0)."},
    )
    plateau_metric: str = field(
        default="eval_reward", metadata={"help": "Logged metric the plateau rule watches (e.g. `eval_pass@1`)."}
    )
    plateau_mode: str = field(default="max", metadata={"help": "'max': higher is better; 'min': lower is better."})
    plateau_patience: int = field(
        default=0, metadata={"help": "Evaluations without improvement that end a phase (0: never)."}
    )
    plateau_min_delta: float = field(default=0.0, metadata={"help": "Smallest improvement of the plateau metric."})
    stop_on_nonfinite: bool = field(
        default=True,
        metadata={
            "help": "Stop before an optimizer step whose gradients are NaN or inf (NonFiniteUpdate, naming the latest "
            "checkpoint), instead of writing NaN into the weights and training on garbage. Under DeepSpeed the "
            "logged grad_norm is checked after the step."
        },
    )
    max_nonfinite_skips: int = field(
        default=0,
        metadata={
            "help": "With stop_on_nonfinite: how many optimizer steps with NaN/inf gradients a run skips before it "
            "stops. A skipped step drops that update (the weights and optimizer state stay as before it, the LR "
            "schedule moves on), is logged (prorl/nonfinite_skips) and kept for a replay in nonfinite/step-<N>/; one "
            "more stops the run as with 0. For long unattended runs; not under DeepSpeed, whose update is applied "
            "before the check can see it."
        },
    )
    cudnn_attention_guard: str = field(
        default="auto",
        metadata={
            "help": "Keep cuDNN's SDPA backward (H100/H200, torch >= 2.11) from returning NaN gradients at lengths of "
            "64 mod 128 (PyTorch issue 196678): 'auto' runs training attention at the lengths a start-up probe finds "
            "failing (always 64 mod 128) on another SDPA backend, 'always' at every length, 'off' never. Generation "
            "keeps cuDNN. See prorl_trl.attention.",
            "choices": list(CUDNN_GUARD_MODES),
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Continue a run: a checkpoint folder, or `true` (also `latest`, or True from Python) for the latest "
            "complete checkpoint in output_dir. Unlike TrainingArguments (where it is informational), "
            "ProRLTrainer.train() uses it when called without `resume_from_checkpoint`, and `prorl-trl train` reads it "
            "like `--resume`. Typed `str` so that HfArgumentParser/TrlParser can read it."
        },
    )

    def __post_init__(self):
        if isinstance(self.resume_from_checkpoint, str):  # what a command line or config file gives as text
            word = self.resume_from_checkpoint.strip().lower()
            if word in ("true", "latest"):
                self.resume_from_checkpoint = True
            elif word in ("", "false", "none"):
                self.resume_from_checkpoint = None
        elif self.resume_from_checkpoint is False:
            self.resume_from_checkpoint = None
        super().__post_init__()
        if self.phases is not None:
            self.phases = [p if isinstance(p, PhaseConfig) else PhaseConfig(**p) for p in self.phases]
            if not self.phases:
                raise ValueError("`phases` is empty: give at least one phase, or leave it unset for a single phase.")
        if self.lora_reset_mode not in LORA_RESET_MODES:
            raise ValueError(
                f"lora_reset_mode must be one of {list(LORA_RESET_MODES)}, got {self.lora_reset_mode!r}: 'frozen' "
                "keeps each phase's LoRA delta exactly as frozen factors, 'merge' adds it into the base weights."
            )
        if self.consolidate_frozen_parts and self.lora_reset_mode != "frozen":
            raise ValueError(
                "consolidate_frozen_parts joins the frozen LoRA parts of lora_reset_mode 'frozen', but lora_reset_mode "
                f"is {self.lora_reset_mode!r}, which keeps no parts: set lora_reset_mode: frozen, or drop "
                "consolidate_frozen_parts."
            )
        if self.merged_save_dtype not in MERGED_SAVE_DTYPES:
            raise ValueError(
                f"merged_save_dtype must be one of {list(MERGED_SAVE_DTYPES)}, got {self.merged_save_dtype!r}."
            )
        if self.cudnn_attention_guard not in CUDNN_GUARD_MODES:
            raise ValueError(
                f"cudnn_attention_guard must be one of {list(CUDNN_GUARD_MODES)}, got {self.cudnn_attention_guard!r}: "
                "'auto' guards the lengths cuDNN's backward gets wrong, 'always' every length, 'off' none."
            )
        if self.max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips}.")
        if self.max_nonfinite_skips > 0 and not self.stop_on_nonfinite:
            raise ValueError(
                f"max_nonfinite_skips={self.max_nonfinite_skips} needs stop_on_nonfinite: true (the check that finds a "
                "non-finite step); without it every update is applied, NaN or not. Turn stop_on_nonfinite on, or set "
                "max_nonfinite_skips: 0."
            )
        if self.save_only_model and self.save_strategy != "no":
            raise ValueError(
                "save_only_model: true writes checkpoints without the optimizer, LR scheduler and RNG state, and a "
                "resume from one would restart Adam and the schedule without saying so: not the run it records. Drop "
                "save_only_model (the final model is saved in final/, each reset's merged model in merged/), or set "
                "save_strategy: no."
            )
        if self.plateau_mode not in ("max", "min"):
            raise ValueError(f"plateau_mode must be 'max' or 'min', got {self.plateau_mode!r}.")
        if self.overlong_buffer < 0:
            raise ValueError(f"overlong_buffer must be >= 0, got {self.overlong_buffer}.")
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds must be >= 0, got {self.dynamic_sampling_max_rounds}.")

    def to_dict(self) -> dict[str, Any]:
        """`TrainingArguments.to_dict` with `phases` as plain dicts, so `to_json_string()` and the trackers (which
        record the arguments as the run's config) can serialise it. `ProRLTrainer` resolves its copy's phases, so the
        trackers get the phase table as it runs (every setting explicit)."""
        data = super().to_dict()
        if self.phases is not None:
            data["phases"] = [dataclasses.asdict(p) if isinstance(p, PhaseConfig) else dict(p) for p in self.phases]
        return data


def _lora_value(peft_config: Any, attribute: str) -> Any:
    value = getattr(peft_config, attribute, None) if peft_config is not None else None
    return sorted(value) if isinstance(value, set) else value


def _lora_shape(r: int | None, alpha: float | None, targets: Any) -> tuple:
    targets = tuple(sorted(targets)) if isinstance(targets, (list, tuple, set)) else targets
    return (r, alpha, targets)


def peft_lora_shape(peft_config: Any) -> tuple:
    """`ResolvedPhase.lora_shape` of the adapter `peft_config` describes (all None without one)."""
    return _lora_shape(*(_lora_value(peft_config, attribute) for attribute in LORA_PHASE_FIELDS.values()))


def resolve_phases(args: ProRLConfig, peft_config: Any = None, world_size: int = 1) -> list[ResolvedPhase]:
    """Fill every phase's unset fields from the previous phase (the first from `args` / `peft_config`) and check them.

    Raises `ValueError` naming the phase and field for any value TRL would reject later (group size < 2, a
    generation batch not divisible by the group size or by the global micro-batch, a buffer not shorter than the
    cap, a LoRA rank without a `peft_config`, ...).
    """
    phases = args.phases or [PhaseConfig(name="main")]
    previous: dict[str, Any] = {name: getattr(args, name) for name in GRPO_PHASE_FIELDS + PRORL_PHASE_FIELDS}
    previous["num_generations"] = previous["num_generations"] or 8
    previous.update({field_: _lora_value(peft_config, attr) for field_, attr in LORA_PHASE_FIELDS.items()})
    prompts_per_generation = max(1, previous["generation_batch_size"] // previous["num_generations"])
    micro_batch = args.per_device_train_batch_size * world_size
    resolved = []
    for index, phase in enumerate(phases):
        values = dict(previous)
        explicit = {f.name: getattr(phase, f.name) for f in dataclasses.fields(phase) if getattr(phase, f.name) is not None}
        values.update({k: v for k, v in explicit.items() if k in previous})
        name = phase.name or f"phase-{index}"
        where = f"phase {index} ({name})"
        if "generation_batch_size" not in explicit:
            # Keep the prompts per generation batch; round up to whole micro-batches (TRL splits it into them).
            values["generation_batch_size"] = math.lcm(prompts_per_generation * values["num_generations"], micro_batch)
        prompts_per_generation = max(1, values["generation_batch_size"] // values["num_generations"])
        hard_reset = args.hard_reset_between_phases if phase.hard_reset is None else phase.hard_reset
        max_steps = _phase_length(where, phase.max_steps, args.max_steps, len(phases))
        _check_phase(where, max_steps, phase.max_steps is None, values, micro_batch, peft_config)
        resolved.append(
            ResolvedPhase(
                index=index,
                name=name,
                max_steps=max_steps,
                num_train_epochs=args.num_train_epochs,
                hard_reset=bool(hard_reset) and index > 0,
                **{k: values[k] for k in GRPO_PHASE_FIELDS + PRORL_PHASE_FIELDS + tuple(LORA_PHASE_FIELDS)},
            )
        )
        previous = values
    return resolved


def _phase_length(where: str, phase_max_steps: int | None, base_max_steps: int, num_phases: int) -> int:
    """A phase's `max_steps`; -1 (HF's "from `num_train_epochs`") only for an unset length in a one-phase run.

    One phase is what `GRPOTrainer` would run: `max_steps` if set, else the epochs. With several phases each
    phase's length must be known before training (its schedule, resets and plateau rule depend on it), and an
    epoch count per phase would silently re-read the data set once per phase.
    """
    if phase_max_steps is not None:
        return phase_max_steps
    if num_phases == 1:
        return base_max_steps if base_max_steps > 0 else -1
    raise ValueError(
        f"ProRLConfig {where}: max_steps is required in a multi-phase run (each phase's length must be known at "
        "init; `num_train_epochs` sets the length of a single-phase run only). Give every PhaseConfig a max_steps."
    )


def _check_phase(
    where: str, max_steps: int, length_unset: bool, v: dict[str, Any], micro_batch: int, peft_config: Any
) -> None:
    problems = []
    if max_steps < 1 and not (length_unset and max_steps == -1):  # -1 unset: `num_train_epochs` (one phase)
        problems.append(f"max_steps must be >= 1, got {max_steps}")
    if v["num_generations"] < 2:
        problems.append(f"num_generations must be >= 2 (GRPO needs a group), got {v['num_generations']}")
    elif v["generation_batch_size"] % v["num_generations"]:
        problems.append(
            f"generation_batch_size {v['generation_batch_size']} is not divisible by num_generations "
            f"{v['num_generations']}"
        )
    if v["generation_batch_size"] % micro_batch:
        problems.append(
            f"generation_batch_size {v['generation_batch_size']} is not divisible by per_device_train_batch_size x "
            f"processes = {micro_batch}"
        )
    if v["max_completion_length"] is None or v["max_completion_length"] < 1:
        problems.append(f"max_completion_length must be >= 1, got {v['max_completion_length']}")
    elif v["overlong_buffer"] and not 0 <= v["overlong_buffer"] < v["max_completion_length"]:
        problems.append(
            f"overlong_buffer ({v['overlong_buffer']}) must be shorter than max_completion_length "
            f"({v['max_completion_length']})"
        )
    if v["overlong_penalty_factor"] < 0:  # a negative factor would reward length near the cap (verl clips it to 0)
        problems.append(f"overlong_penalty_factor must be >= 0 (the penalty at the cap), got "
                        f"{v['overlong_penalty_factor']}")  # fmt: skip
    if v["temperature"] <= 0:
        problems.append(f"temperature must be > 0, got {v['temperature']}")
    if not 0 < v["top_p"] <= 1:
        problems.append(f"top_p must be in (0, 1], got {v['top_p']}")
    if v["learning_rate"] < 0:
        problems.append(f"learning_rate must be >= 0, got {v['learning_rate']}")
    if v["lora_r"] is not None and peft_config is None:
        problems.append("sets lora_r but the trainer has no peft_config (LoRA fields need a LoRA run)")
    if v["lora_r"] is not None and v["lora_r"] < 1:
        problems.append(f"lora_r must be >= 1, got {v['lora_r']}")
    if problems:
        raise ValueError(f"ProRLConfig {where}: " + "; ".join(problems) + ".")
