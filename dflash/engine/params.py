"""Sampling rules shared by every backend (torch and MLX), importable without torch.

Temperatures below `TEMPERATURE_FLOOR` mean greedy decoding, as in vLLM (its _SAMPLING_EPS):
dividing logits by a tinier temperature gains nothing (the distribution is already one-hot to
float32 precision) and can overflow to inf/nan."""

from __future__ import annotations

TEMPERATURE_FLOOR = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature a backend samples with: 0.0 (greedy) below the floor, else itself."""
    return 0.0 if temperature < TEMPERATURE_FLOOR else float(temperature)
