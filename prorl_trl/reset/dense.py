"""A base layer's weight as a plain dense tensor: as stored for `nn.Linear`, dequantised for bitsandbytes layers.

Why: merged saves (`merged/reset-<k>/`, `final/`) and the vLLM weight push fold every LoRA delta into the base weights
once, in float32. A QLoRA base stores packed 4-bit codes (`Params4bit`, with a quant state) or int8 rows with per-row
scales (`Int8Params`); the dense weight the layer multiplies by is the dequantised one, and a merged save of a QLoRA
run is therefore a plain (bf16) model, loadable without bitsandbytes.
"""

from __future__ import annotations

import torch
from torch import nn


def is_quantized_weight(weight: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit (`Params4bit`) or 8-bit (`Int8Params`) weight."""
    return type(weight).__name__ in ("Params4bit", "Int8Params")


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The weight `layer` computes with, as a dense (out_features, in_features) tensor: the weight itself for a float
    layer, the dequantised weight (in its quant state's dtype, 4-bit; float32, 8-bit) for a bitsandbytes one."""
    weight = layer.weight
    kind = type(weight).__name__
    if kind == "Params4bit":
        import bitsandbytes as bnb

        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    if kind == "Int8Params":
        import bitsandbytes as bnb

        codes = weight.CB if getattr(weight, "CB", None) is not None else weight.data
        # the per-row scales: on the weight until the layer's first forward on a GPU moves them to its state
        scales = weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB
        return bnb.functional.int8_vectorwise_dequant(codes, scales)
    return weight
