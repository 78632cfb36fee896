"""`kl_clamp`: TRL's k3 KL term bounded as verl's `low_var_kl` bounds it, so one extreme token cannot overflow a step.

TRL 1.16 adds `beta * (exp(ref - logp) - (ref - logp) - 1)` per token, unbounded. verl's `low_var_kl` (the KL loss
ProRL and Logic-RL trained with; OpenRLHF and SkyRL do the same) clamps `ref - logp` to [-20, 20] and the term to
[-10, 10] "for numerical stability". A token that the sharpened policy gives ~90 nats less than the reference
overflows TRL's `exp`, and the step's loss and gradients become NaN.

How, without re-implementing TRL's loss: the clamps only make a token's KL term constant (its gradient zero) where
they bite. TRL's term with the reference log-prob replaced by the policy's own (detached) value is `exp(0) - 0 - 1 = 0`
with gradient `1 - exp(0) = 0`, exactly. So where verl's clamps would bite (|ref - logp| > 20, or the term above 10),
`ref_per_token_logps` is replaced by the detached policy log-prob, right after TRL computes the policy log-probs in
`_compute_loss` and before it reads the reference's. Every gradient is then verl's; the loss value and the logged
`kl` differ from verl's only by those tokens' constant (10 each in verl, 0 here). Elsewhere nothing changes, so with
no extreme token a step is TRL's bit for bit. With TRL's `use_bias_correction_kl` (its default) the term is also
multiplied by the importance ratio (value 1, gradient d logp), as verl's `k3plusplus` is; a clamped token then adds no
gradient at all, where `k3plusplus` would add its constant 10 times the ratio's gradient.
"""

from __future__ import annotations

from typing import Any

import torch

LOG_RATIO_BOUND = 20.0  # verl low_var_kl: kl = clamp(ref - logp, -20, 20)
TERM_BOUND = 10.0  # verl low_var_kl: kld = clamp(exp(kl) - kl - 1, -10, 10)


def clamped_reference(ref_logps: torch.Tensor, policy_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the reference log-probs with the policy's own detached value where verl's `low_var_kl` clamps would bite,
    the boolean mask of those positions). Decided in float32, as a k3 term above 10 or a ratio beyond e^20 is."""
    policy = policy_logps.detach()
    log_ratio = ref_logps.float() - policy.float()
    term = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND + 1)) - log_ratio - 1
    clamped = (log_ratio.abs() > LOG_RATIO_BOUND) | (term > TERM_BOUND)
    return torch.where(clamped, policy.to(ref_logps.dtype), ref_logps), clamped


class KLClampMixin:
    """`kl_clamp` inside TRL's `_compute_loss` (see the module docstring); logs `prorl/kl_clamped_tokens`, the
    completion tokens clamped per micro-batch on this process (TRL's mean over the logging window)."""

    _kl_clamp_inputs: dict[str, Any] | None = None

    def _compute_loss(self, model, inputs):
        if not getattr(self.args, "kl_clamp", False) or self.beta == 0.0 or "ref_per_token_logps" not in inputs:
            return super()._compute_loss(model, inputs)
        self._kl_clamp_inputs = inputs = dict(inputs)  # TRL keeps `inputs` for later iterations: edit a copy
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._kl_clamp_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        inputs = self._kl_clamp_inputs
        if inputs is not None:  # the policy's log-probs inside `_compute_loss`: TRL reads the reference's next
            self._kl_clamp_inputs = None
            reference, clamped = clamped_reference(inputs["ref_per_token_logps"], result[0])
            mask = inputs["completion_mask"].bool()
            inputs["ref_per_token_logps"] = reference
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["prorl/kl_clamped_tokens"].append(float((clamped & mask).sum().item()))
        return result
