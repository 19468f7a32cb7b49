"""Temperature: rlfleet's behaviour log-probs are of ``logits / temperature`` (what was sampled).

TorchRL's ``TransformersWrapper`` scores with the raw logits (it has no temperature), so at a
sampling temperature T != 1 ``GRPOLoss``'s ratio would compare log-softmax(logits) with
log-softmax(logits / T): wrong even on the first step. ``temperature_scaled(model, T)`` makes the
model itself return ``logits / T`` (a forward hook), so the wrapper, the loss and the KL terms all
see the sampled distribution. The weights are untouched, so pushes are unaffected.
"""

from __future__ import annotations

import torch


def temperature_scaled(model: torch.nn.Module, temperature: float):
    """Divide ``model``'s output logits by ``temperature``; returns the hook handle (``.remove()`` undoes it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    inverse = 1.0 / float(temperature)

    def scale(module, args, output):
        output["logits"] = output["logits"] * inverse
        return output

    return model.register_forward_hook(scale)
