"""`kl_clamp`: TRL's k3 KL term overflows on one extreme token (loss and gradients NaN/inf); with the clamp the same
batch gives exactly the gradients of verl's `low_var_kl` (written out here independently), and a batch without
extreme tokens is TRL's bit for bit."""

from __future__ import annotations

import pytest
import torch
from _prorl_helpers import TINY_ARGS, lora, prompts_dataset, tiny_model

from prorl_trl import ProRLConfig, ProRLTrainer
from prorl_trl.trainer.kl_clamp import clamped_reference

BETA = 0.04
RARE = 20  # a token id the policy's head pushes far down (as a sharpened policy does for tokens it never samples)


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trainer(tmp_path, kl_clamp: bool, bias_correction: bool = True) -> ProRLTrainer:
    model, tokenizer = tiny_model()
    with torch.no_grad():
        model.lm_head.bias[RARE] = -500.0
    args = ProRLConfig(output_dir=str(tmp_path / f"{kl_clamp}-{bias_correction}"), **TINY_ARGS, beta=BETA,
                       loss_type="dapo", kl_clamp=kl_clamp, use_bias_correction_kl=bias_correction)  # fmt: skip
    made = ProRLTrainer(model=model, reward_funcs=[zero_reward], args=args, train_dataset=prompts_dataset(),
                        processing_class=tokenizer, peft_config=lora())  # fmt: skip
    made.current_gradient_accumulation_steps = 1  # what HF's loop sets before each step
    return made


def batch(tokenizer, reference: torch.Tensor) -> dict:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = torch.tensor([[5, 6, 7], [5, 6, 8]])
    completion_ids = torch.tensor([[9, RARE, 11, eos], [12, eos, pad, pad]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -1.0]),
        "ref_per_token_logps": reference, "old_per_token_logps": None, "num_items_in_batch": completion_mask.sum(),
    }  # fmt: skip


def policy_logps(trainer, inputs: dict) -> torch.Tensor:
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, ids.shape[1] - 3)[0]


def gradients(trainer, loss: torch.Tensor) -> list[torch.Tensor]:
    trainer.model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]


def verl_low_var_kl(ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """verl's `low_var_kl` as its docs and code define it: kl = clamp(ref - logp, +-20); clamp(e^kl - kl - 1, +-10)."""
    kl = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


@pytest.mark.parametrize("bias_correction", [False, True], ids=["k3", "k3-times-ratio"])
def test_an_extreme_token_overflows_trl_and_the_clamp_gives_verl_gradients(tmp_path, bias_correction):
    """Without TRL's `use_bias_correction_kl` the term is verl's `low_var_kl` exactly. With it (TRL's default) TRL
    multiplies the term by the importance ratio (value 1, gradient d logp: verl's `k3plusplus`); a clamped token then
    adds nothing, where `k3plusplus` would add its constant 10 times the ratio's gradient."""
    unclamped = trainer(tmp_path, kl_clamp=False, bias_correction=bias_correction)
    clamped = trainer(tmp_path, kl_clamp=True, bias_correction=bias_correction)
    tokenizer = clamped.processing_class
    unclamped.model.train(), clamped.model.train()
    inputs = batch(tokenizer, torch.full((2, 4), -5.0))  # at the RARE token ref - logp is ~495 nats
    loss = unclamped._compute_loss(unclamped.model, batch(tokenizer, torch.full((2, 4), -5.0)))
    trl_grads = gradients(unclamped, loss)
    assert not torch.isfinite(loss) and any(not torch.isfinite(g).all() for g in trl_grads)  # TRL 1.16's overflow

    ours = gradients(clamped, clamped._compute_loss(clamped.model, dict(inputs)))
    assert all(torch.isfinite(g).all() for g in ours)
    assert clamped._metrics["train"]["prorl/kl_clamped_tokens"][-1] >= 1
    # verl: TRL's policy-gradient part (beta 0) plus beta * low_var_kl over the completion tokens, same normalizer
    clamped.beta = 0.0
    policy_part = clamped._compute_loss(clamped.model, dict(inputs))
    clamped.beta = BETA
    mask, logps = inputs["completion_mask"], policy_logps(clamped, inputs)
    term = verl_low_var_kl(inputs["ref_per_token_logps"], logps)
    if bias_correction:
        kept = (inputs["ref_per_token_logps"] - logps).abs() <= 20  # and term <= 10: the only clamped token is RARE
        term = term * kept * torch.exp(logps - logps.detach())
    kl_part = BETA * (term * mask).sum()
    expected = gradients(clamped, policy_part + kl_part / inputs["num_items_in_batch"])
    for mine, verl in zip(ours, expected, strict=True):
        torch.testing.assert_close(mine, verl, rtol=1e-5, atol=1e-7)


def test_without_extreme_tokens_the_clamp_changes_no_bit(tmp_path):
    unclamped, clamped = trainer(tmp_path, kl_clamp=False), trainer(tmp_path, kl_clamp=True)
    tokenizer = clamped.processing_class
    unclamped.model.train(), clamped.model.train()
    with torch.no_grad():  # a reference a little off the policy everywhere, never past verl's bounds
        probe = batch(tokenizer, torch.zeros(2, 4))
        probe["completion_ids"][0, 1] = 10  # no RARE token
        reference = policy_logps(unclamped, probe) + 0.3 * torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for each in (unclamped, clamped):
        inputs = batch(tokenizer, reference)
        inputs["completion_ids"][0, 1] = 10
        losses.append(each._compute_loss(each.model, inputs))
        grads.append(gradients(each, losses[-1]))
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert clamped._metrics["train"]["kl"] == unclamped._metrics["train"]["kl"]


@pytest.mark.parametrize(
    "log_ratio, clamped",
    [(0.0, False), (2.0, False), (2.7, True), (25.0, True), (-2.0, False), (-25.0, True), (-1e9, True)],
)
def test_the_clamp_bites_where_verl_makes_the_term_constant(log_ratio, clamped):
    """verl's term is constant (zero gradient) past |ref - logp| > 20 or past a term of 10 (e^2.7 - 3.7 > 10)."""
    policy = torch.tensor([-3.0])
    reference, bites = clamped_reference(policy + log_ratio, policy)
    assert bool(bites) is clamped
    assert torch.equal(reference, policy if clamped else policy + log_ratio)
