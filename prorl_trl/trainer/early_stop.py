"""RLinf minibatch early stop: zero a micro-batch's loss when its mean importance ratio exceeds a threshold.

TRL's `off_policy_mask_threshold` masks sequences by KL instead and has no whole-micro-batch rule, and the policy
log-probs the ratio needs are computed inside TRL's `_compute_loss` and not returned, so two TRL 1.16 methods are
wrapped here (`_get_per_token_logps_and_entropies` remembers them while `_compute_loss` runs).
"""

from __future__ import annotations

import torch


class MinibatchEarlyStopMixin:
    """`early_stop_importance_ratio` (RLinf) inside TRL's loss; counts early-stopped micro-batches in `_early_stopped`."""

    _capture_logps = False
    _captured_logps: torch.Tensor | None = None
    _early_stopped = 0

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Unchanged, but remembers the log-probs while `_compute_loss` runs (early stop needs them)."""
        result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if self._capture_logps:
            self._captured_logps = result[0]
        return result

    def _compute_loss(self, model, inputs):
        """RLinf minibatch early stop: zero the micro-batch loss (keeping the graph, so DDP still all-reduces) when the
        token-masked mean importance ratio pi_new/pi_old, averaged over ranks, exceeds the threshold. TRL's
        `off_policy_mask_threshold` masks sequences by KL instead and has no whole-micro-batch rule."""
        threshold = self.args.early_stop_importance_ratio
        if threshold is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        self._capture_logps = True
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_logps = False
        logps, self._captured_logps = self._captured_logps, None
        old = inputs.get("old_per_token_logps")
        if old is None:  # on-policy micro-batch: TRL uses the detached current log-probs, so the ratio is exactly 1
            return loss
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        ratio = torch.exp(logps.detach() - old) * mask
        mean_ratio = ratio.sum() / mask.sum().clamp(min=1)
        mean_ratio = self.accelerator.gather(mean_ratio.reshape(1).float()).mean().item()  # one device sync
        self._metrics["train"]["prorl/importance_ratio"].append(mean_ratio)
        if mean_ratio > threshold:
            self._early_stopped += 1
            loss = loss * 0.0
        return loss
