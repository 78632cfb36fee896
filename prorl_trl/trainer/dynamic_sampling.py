"""DAPO/ProRL dynamic sampling: drop prompt groups whose correctness is uniform and refill with fresh prompts.

A group whose completions are all right or all wrong has zero advantage everywhere: it spends compute and, with the
default `dapo` token normaliser, dilutes the gradient of the useful groups. TRL 1.16 has no filter (maintainers point
to the async trainer, issues #3708/#3973), so `DynamicSamplingMixin._generate_and_score_completions` (below) wraps TRL's method: it
scores the generation batch as usual, then this module decides which groups to keep and asks for more generation
rounds (fresh prompts from a private sampler) until every rank has enough informative groups or
`dynamic_sampling_max_rounds` is spent. Groups still missing are filled with dropped ones, so the batch keeps the
fixed size TRL's buffering and loss normaliser expect. A filler group is uniform in correctness only: its advantages
are 0 when every reward is uniform in it, and otherwise come from the rewards that vary (the overlong penalty, a
format reward), as in any group TRL scores.

The kept rows keep the advantages TRL gave them in their own round. That is verl's advantage of the kept batch only
when every statistic is taken per group (`multi_objective_aggregation='sum_then_normalize'` with `scale_rewards`
'group' or 'none'); batch-wide statistics would include the dropped groups and differ between rounds, so
`checks.check_reward_shaping` refuses them.

DDP: the decision uses the rewards TRL gathered over all ranks, so every rank computes the same keep masks and the
same number of rounds (each round runs collectives). Each rank must hold whole groups (checked at init).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Keys of TRL's `_generate_and_score_completions` output and how to re-pad them when rows of several rounds are
# combined: left-padded prompt side, right-padded completion side (pad value), and one-value-per-row keys.
LEFT_PADDED = {"prompt_ids": None, "prompt_mask": 0}  # None: the tokenizer's pad id
RIGHT_PADDED = {
    "completion_ids": None,
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "tool_mask": 1,
}
PER_ROW = {"advantages"}
RECOMPUTED = {"num_items_in_batch"}


def uniform_groups(correctness: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Bool per group: True when every scored completion of the group has the same correctness (no signal).

    Same means exactly equal, as in verl's DAPO filter (`np.std(values) > 0` keeps a group); a tolerance is relative to
    the reward's scale (`torch.isclose` called [100, 100, 100, 99.9995] uniform; TRL gives its odd one -1.08).
    Rewards a Python function returns equal are equal float32 numbers in TRL's table, so no uniform group is kept.
    NaN (a reward that returned None) is ignored; a group with no scored completion counts as uniform.

    >>> uniform_groups(torch.tensor([1.0, 1.0, 0.0, -1.0, -1.0, -1.0, 100.0, 100.0, 99.9995]), 3).tolist()
    [False, True, False]
    """
    groups = correctness.view(-1, num_generations)
    scored = ~torch.isnan(groups)
    high = torch.where(scored, groups, torch.full_like(groups, -torch.inf)).amax(dim=1)
    low = torch.where(scored, groups, torch.full_like(groups, torch.inf)).amin(dim=1)
    return ~scored.any(dim=1) | (high == low)


class RefillSampler:
    """Endless stream of fresh prompt groups for refill rounds, identical on every rank (same seed, own generator).

    Each call returns one global generation batch of dataset indices, every prompt repeated `num_generations` times
    (the layout of TRL's `RepeatSampler`), reshuffled at every pass over the data.
    """

    def __init__(self, dataset_size: int, num_generations: int, prompts_per_batch: int, seed: int, shuffle: bool = True):
        if dataset_size < 1:
            raise ValueError("dynamic sampling needs a non-empty train_dataset to draw refill prompts from.")
        self.dataset_size = dataset_size
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)
        self._order: list[int] = []
        self.batches_drawn = 0  # checkpointed: a resume draws on from here (`skip`), not from the phase's start

    def _next_prompt(self) -> int:
        if not self._order:
            order = torch.randperm(self.dataset_size, generator=self.generator) if self.shuffle else torch.arange(self.dataset_size)
            self._order = order.tolist()[::-1]
        return self._order.pop()

    def next_batch(self) -> list[int]:
        prompts = [self._next_prompt() for _ in range(self.prompts_per_batch)]
        self.batches_drawn += 1
        return [index for index in prompts for _ in range(self.num_generations)]

    def skip(self, batches: int) -> None:
        """Draw and drop `batches` batches: the stream as it stood after them (the generator's state included)."""
        for _ in range(batches):
            self.next_batch()


def _pad_cat(tensors: list[torch.Tensor], value: Any, side: str) -> torch.Tensor:
    width = max(t.size(1) for t in tensors)
    padded = []
    for t in tensors:
        missing = width - t.size(1)
        if missing:
            pad = t.new_full((t.size(0), missing), value)
            t = torch.cat([pad, t] if side == "left" else [t, pad], dim=1)
        padded.append(t)
    return torch.cat(padded, dim=0)


def select_rows(batches: list[dict[str, Any]], picks: list[tuple[int, int]], pad_token_id: int) -> dict[str, Any]:
    """Combine rows `(batch index, row index)` of several TRL generation outputs into one, re-padding each side.

    `num_items_in_batch` is left out: it is a global token count the caller recomputes over all ranks.
    """
    keys = set(batches[0]) - RECOMPUTED
    unknown = keys - set(LEFT_PADDED) - set(RIGHT_PADDED) - PER_ROW
    if unknown:
        raise ValueError(
            f"dynamic sampling cannot combine the generation outputs {sorted(unknown)} (multimodal or custom rollout "
            "fields); set dynamic_sampling=False for this run."
        )
    combined: dict[str, Any] = {}
    for key in keys:
        parts = []
        for batch_index, row in picks:
            parts.append(batches[batch_index][key][row : row + 1])
        if key in PER_ROW:
            combined[key] = torch.cat(parts, dim=0)
            continue
        side = "left" if key in LEFT_PADDED else "right"
        value = (LEFT_PADDED if side == "left" else RIGHT_PADDED)[key]
        combined[key] = _pad_cat(parts, pad_token_id if value is None else value, side)
    return combined


def dynamic_sampling_step(
    first_output: dict[str, Any],
    first_correctness: torch.Tensor,
    generate_round: Callable[[], tuple[dict[str, Any], torch.Tensor]],
    num_generations: int,
    process_index: int,
    num_processes: int,
    max_extra_rounds: int,
    pad_token_id: int,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Keep informative groups, refilling with `generate_round()` (one more scored generation batch) as needed.

    `first_correctness` and the ones `generate_round` returns are the *gathered* correctness of all ranks (identical
    everywhere), so every rank takes the same decisions. Returns this rank's combined output (same number of rows as
    `first_output`; `num_items_in_batch` still to be recomputed) and stats for logging.
    """
    local_rows = first_output["completion_ids"].size(0)
    groups_per_rank = local_rows // num_generations
    outputs = [first_output]
    kept: list[list[tuple[int, int]]] = [[] for _ in range(num_processes)]
    dropped: list[list[tuple[int, int]]] = [[] for _ in range(num_processes)]
    generated = dropped_count = 0

    def sort_groups(round_index: int, correctness: torch.Tensor) -> None:
        nonlocal generated, dropped_count
        uniform = uniform_groups(correctness.float().cpu(), num_generations).view(num_processes, groups_per_rank)
        generated += uniform.numel()
        dropped_count += int(uniform.sum())
        for rank in range(num_processes):
            for group in range(groups_per_rank):
                (dropped if uniform[rank, group] else kept)[rank].append((round_index, group))

    sort_groups(0, first_correctness)
    extra_rounds = 0
    while extra_rounds < max_extra_rounds and any(len(k) < groups_per_rank for k in kept):
        output, correctness = generate_round()
        outputs.append(output)
        extra_rounds += 1
        sort_groups(extra_rounds, correctness)

    mine = kept[process_index][:groups_per_rank]
    mine += dropped[process_index][: groups_per_rank - len(mine)]
    picks = [(round_index, group * num_generations + g) for round_index, group in mine for g in range(num_generations)]
    combined = select_rows(outputs, picks, pad_token_id)
    informative = sum(min(len(k), groups_per_rank) for k in kept)
    stats = {
        "prorl/dropped_groups": dropped_count / generated,
        "prorl/sampling_rounds": 1.0 + extra_rounds,
        "prorl/informative_groups": informative / (groups_per_rank * num_processes),
    }
    return combined, stats


class DynamicSamplingMixin:
    """Dynamic sampling inside TRL's loop (`dynamic_sampling=True`): TRL 1.16 has no hook, so two of its methods are
    wrapped. Expects the trainer's `current_phase` and `_correctness_index` (set at init).
    """

    _last_rewards_per_func: torch.Tensor | None = None
    _refill_samplers: dict | None = None
    _resumed_refill: list[int] | None = None  # [phase index, batches drawn] of the checkpoint a resume loaded

    def refill_position(self) -> list[int] | None:
        """[phase index, batches drawn] of the running phase's refill stream, for the checkpoint; None before any."""
        sampler = (self._refill_samplers or {}).get(self.current_phase.index)
        return None if sampler is None else [self.current_phase.index, sampler.batches_drawn]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Keep TRL's gathered (all-rank) rewards: dynamic sampling keys on one function's column, which TRL folds
        into advantages without returning it."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards
        return rewards

    def _generate_and_score_completions(self, inputs):
        """TRL's generation + scoring, then (training, `dynamic_sampling=True`) drop uniform-correctness groups and
        refill them with fresh prompts. Wrapping this method keeps TRL's buffering (`_buffered_inputs`), shuffling and
        splitting in `_prepare_inputs` untouched: the combined output has the same rows per rank as TRL's."""
        output = super()._generate_and_score_completions(inputs)
        if not self.args.dynamic_sampling or not self.model.training:
            return output
        column = self._correctness_index
        sampler = self._refill_sampler()
        local_rows = len(inputs)
        rank = self.accelerator.process_index

        def generate_round():
            indices = sampler.next_batch()[rank * local_rows : (rank + 1) * local_rows]
            fresh = [self.train_dataset[int(i)] for i in indices]
            round_output = super(DynamicSamplingMixin, self)._generate_and_score_completions(fresh)
            return round_output, self._last_rewards_per_func[:, column]

        combined, stats = dynamic_sampling_step(
            output,
            self._last_rewards_per_func[:, column],
            generate_round,
            num_generations=self.num_generations,
            process_index=rank,
            num_processes=self.accelerator.num_processes,
            max_extra_rounds=self.args.dynamic_sampling_max_rounds,
            pad_token_id=self._tokenizer.pad_token_id,
        )
        loss_mask = combined["completion_mask"]
        if "tool_mask" in combined:
            loss_mask = loss_mask * combined["tool_mask"]
        combined["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        for key, value in stats.items():
            self._metrics["train"][key].append(value)
        return combined

    def _refill_sampler(self) -> RefillSampler:
        """One refill stream per phase (the group size may change), seeded apart from TRL's own sampler."""
        self._refill_samplers = self._refill_samplers or {}
        phase = self.current_phase
        if phase.index not in self._refill_samplers:
            self._refill_samplers[phase.index] = RefillSampler(
                len(self.train_dataset),
                self.num_generations,
                self.args.generation_batch_size // self.num_generations,
                seed=self.args.seed + 100_003,
                shuffle=self.args.shuffle_dataset,
            )
            resumed, self._resumed_refill = self._resumed_refill, None
            if resumed and resumed[0] == phase.index:  # the uninterrupted run's next refill prompts, not the first ones
                self._refill_samplers[phase.index].skip(resumed[1])
        return self._refill_samplers[phase.index]
