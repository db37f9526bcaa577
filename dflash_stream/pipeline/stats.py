"""The training statistics a log line reports: summed on each rank, then over the ranks by the step's
all-reduce, so every rank logs the same loss and accuracies."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_stream.drafter import LossOutput


class StepStats:
    """Loss and per-slot accuracy since the last log line, summed over micro-batches and (once synced) ranks."""

    def __init__(self, block_size: int) -> None:
        self.slots = block_size - 1
        self._local = [0.0] * (2 + 2 * self.slots)
        self._total = [0.0] * (2 + 2 * self.slots)
        self.step_weight = 0.0
        self.tokens = 0
        self.epoch = 0
        self._since = time.perf_counter()

    def add(self, out: LossOutput) -> None:
        w = float(out.weight)
        values = [float(out.loss.detach()) * w, w, *out.correct.tolist(), *out.count.tolist()]
        self._local = [a + b for a, b in zip(self._local, values, strict=True)]

    def pending(self) -> list[float]:
        """This rank's statistics of the current step, for the all-reduce."""
        local, self._local = self._local, [0.0] * len(self._local)
        return local

    def absorb(self, synced: list[float]) -> None:
        self.step_weight = synced[1]
        self._total = [a + b for a, b in zip(self._total, synced, strict=True)]

    def step_done(self, tokens: int) -> None:
        self.tokens += tokens

    def flush(self) -> dict[str, Any] | None:
        loss_sum, weight = self._total[:2]
        if weight == 0:
            return None
        correct, count = self._total[2:2 + self.slots], self._total[2 + self.slots:]
        stats = {
            "loss": loss_sum / weight,
            "acc": [c / n if n else 0.0 for c, n in zip(correct, count, strict=True)],
            "tokens": self.tokens,
            "seconds": time.perf_counter() - self._since,
            "epoch": self.epoch,
        }
        self._total = [0.0] * len(self._total)
        self.tokens = 0
        self._since = time.perf_counter()
        return stats
