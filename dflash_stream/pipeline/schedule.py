"""The learning-rate schedule: linear warmup, then cosine decay over a length revised as the data become known."""

from __future__ import annotations

import math


class WarmupCosine:
    """LR multiplier for LambdaLR: linear warmup, then cosine decay to zero over `total_steps`.

    An object rather than a closure so that LambdaLR's state_dict records `total_steps`, which is revised as
    the data become known. While the data's size is unknown (`open_ended`), a run past the estimate is assumed
    at most half done, so the rate keeps decaying but never reaches zero early.
    """

    def __init__(self, total_steps: int, warmup_ratio: float) -> None:
        self.total_steps = max(1, total_steps)
        self.warmup_ratio = warmup_ratio
        self.open_ended = False

    def __call__(self, step: int) -> float:
        total = max(self.total_steps, 2 * step) if self.open_ended else self.total_steps
        warmup = round(total * self.warmup_ratio)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))
