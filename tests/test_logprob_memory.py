"""The training half never holds a [tokens, vocab] logits tensor: TRL 1.16's fused LM head
(`trl.trainer.utils.add_fused_lm_head`, `trl.kernels.chunked_logprob.ChunkedLogProbFunction`) scores tokens in tiles
of `TOKEN_CHUNK_SIZE` rows and recomputes each tile in the backward. This checks it through ProRLTrainer, where our
parts touch that path: the head re-patched for a phase's temperature, LoRA with frozen parts after a hard reset, the KL
reference (adapter disabled) under `kl_clamp`, the DAPO loss, the overlong penalty and top-entropy masking, with
gradient accumulation. docs/performance.md ("Log-probabilities without full logits") cites it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trl.kernels.chunked_logprob as chunked_logprob
from _prorl_helpers import lora, prompts_dataset, tiny_args, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from prorl_trl import PhaseConfig, ProRLConfig, ProRLTrainer

TILE_ROWS = 8  # TRL's is 4096; at 8 rows every micro-batch of this run spans several tiles


class LargestVocabTensor(TorchDispatchMode):
    """The most rows of any new tensor an op returns (forward and backward) whose last dimension is the vocabulary."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(result.alias_info is not None for result in func._schema.returns):
            return out  # a view (e.g. the head's weight transposed), or an in-place op: no new memory
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == self.vocab_size:
                self.rows = max(self.rows, tensor.numel() // self.vocab_size)
        return out


def reward(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]  # varied within groups: non-zero advantages, a real policy loss


def test_a_two_phase_run_never_holds_more_than_one_tile_of_logits(tmp_path, monkeypatch):
    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", TILE_ROWS)
    model, tokenizer = tiny_model()
    args = tiny_args(
        tmp_path, beta=0.04, kl_clamp=True, loss_type="dapo", top_entropy_quantile=0.5, gradient_accumulation_steps=2,
        overlong_buffer=4, phases=[PhaseConfig(max_steps=1), PhaseConfig(max_steps=1, temperature=0.7)],
    )  # fmt: skip
    trainer = ProRLTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=prompts_dataset(),
                           processing_class=tokenizer, peft_config=lora())  # fmt: skip
    recorder = LargestVocabTensor(model.config.vocab_size)
    generate = trainer._generate_single_turn

    def unrecorded_generate(*a, **k):  # sampling is not the training half (and is slow under the recorder)
        with _disable_current_modes():
            return generate(*a, **k)

    trainer._generate_single_turn = unrecorded_generate
    scored = []  # how many tokens each log-prob call scored: more than one tile, or the check proves nothing
    score = trainer._get_per_token_logps_and_entropies

    def counted_score(model, input_ids, *a, **k):
        scored.append(input_ids.numel())
        return score(model, input_ids, *a, **k)

    trainer._get_per_token_logps_and_entropies = counted_score
    with recorder:
        trainer.train()

    assert trainer.prorl_resets == 1 and trainer.temperature == 0.7
    assert min(scored) > 2 * TILE_ROWS
    assert 0 < recorder.rows <= TILE_ROWS  # old/reference log-probs, the loss and its backward: one tile at most


def test_liger_fused_cross_entropy_is_refused_before_the_model_loads(tmp_path):
    """Liger's fused linear cross-entropy would replace the forward that carries TRL's fused head (TRL 1.16 refuses
    it only after loading the model). TRL 1.16 has no `use_liger_loss` (older TRL's Liger GRPO loss, which skipped
    the trainer's loss): were it back, our loss overrides would need checking against it."""
    assert "use_liger_loss" not in {field.name for field in dataclasses.fields(ProRLConfig)}
    args = tiny_args(tmp_path, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True})
    with pytest.raises(ValueError, match="fused_linear_cross_entropy: true is not supported"):
        ProRLTrainer(model=str(tmp_path / "not-a-model"), reward_funcs=[reward], args=args)
