"""Attention kernels the package chooses for training: `cudnn_guard` keeps cuDNN's SDPA backward from returning NaN.

A plain-function layer (no trainer import): `install_cudnn_attention_guard(model, mode)` switches a model on "sdpa"
to a guarded SDPA that steers training attention at the lengths cuDNN gets wrong to another backend, and returns the
one line that says what it did; `probe_cudnn_backward` is the start-up check behind it.
"""

from .cudnn_guard import (
    CUDNN_GUARD_MODES,
    GUARDED_SDPA,
    CudnnGuardReport,
    guarded_sdpa_attention_forward,
    install_cudnn_attention_guard,
    probe_cudnn_backward,
    steered_away_from_cudnn,
)

__all__ = [
    "CUDNN_GUARD_MODES",
    "GUARDED_SDPA",
    "CudnnGuardReport",
    "guarded_sdpa_attention_forward",
    "install_cudnn_attention_guard",
    "probe_cudnn_backward",
    "steered_away_from_cudnn",
]
