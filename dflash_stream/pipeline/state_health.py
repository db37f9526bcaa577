"""Are the captured states real? Checked per sample before it is packed, summed per segment for the metrics.

Whatever computed them (the extractor's own forward, engine hf, or a vLLM server, engine vllm), a layer whose
states hold NaN/Inf, or a token whose whole layer vector is exactly zero, stops the extractor with one line
naming the layer, the sample and the engine: a drafter trained on such states "converges" and then accepts
nothing (vLLM #46301 once returned all-zero states for Qwen3.5 hybrids). A real layer output never has an
all-zero token row. Every segment also logs, per layer, the RMS of its states, the share of exact zeros and the
count of non-finite values (a `health` metrics event, shown by `status`), so drift is visible before it stops
anything.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from dflash_stream.data import PreparedSample
from dflash_stream.errors import DFlashError


class BadStates(DFlashError):
    """A captured layer state that no real forward produces."""


class NonFiniteStates(BadStates):
    """A captured hidden state holds NaN or Inf."""


class ZeroStates(BadStates):
    """A captured layer state is all zero for some token."""


class StateHealth:
    """`check` each sample's states [T, K*D] (raises BadStates); `segment` sums the checked samples of a
    segment per layer."""

    def __init__(self, layer_ids: list[int], hidden_size: int, engine: str) -> None:
        self.layer_ids, self.hidden_size, self.engine = list(layer_ids), hidden_size, engine
        self._sums: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def check(self, sample: PreparedSample, states: torch.Tensor) -> None:
        """Raise BadStates when a layer of `states` (bf16 [T, K*D]) holds NaN/Inf, or all-zero rows for half of the
        tokens or more. A few zero rows are real: a token whose embedding row is zero (a `padding_idx` row that
        training never updates) can leave a layer's output exactly zero."""
        layers = states.view(states.shape[0], len(self.layer_ids), self.hidden_size)
        non_finite = (~torch.isfinite(layers)).sum(dim=(0, 2))
        zero = layers == 0
        zero_rows = zero.all(dim=2).sum(dim=0)
        what = f"sample {sample.sample_id} ({sample.origin}), engine {self.engine}"
        for k, layer in enumerate(self.layer_ids):
            if non_finite[k]:
                raise NonFiniteStates(
                    f"{what}: layer {layer}'s states hold {int(non_finite[k]):,} NaN/Inf values; check target.dtype "
                    "(float16 overflows on many models)")
            if zero_rows[k] and 2 * zero_rows[k] >= layers.shape[0]:
                raise ZeroStates(
                    f"{what}: layer {layer}'s states are all zero for {int(zero_rows[k])} of {layers.shape[0]} "
                    "tokens, which no real forward produces (vLLM #46301 returned such states for Qwen3.5 "
                    "hybrids): check the engine and its version before training on them")
        squares = torch.linalg.vector_norm(layers, dim=(0, 2), dtype=torch.float32).double() ** 2
        sums = torch.stack([squares, zero.sum(dim=(0, 2)).double(), non_finite.double(),
                            torch.full_like(squares, layers.shape[0] * self.hidden_size)])
        with self._lock:
            self._sums[sample.sample_id] = sums

    def segment(self, sample_ids: list[int]) -> dict[str, Any]:
        """Per layer over the checked samples `sample_ids` (forgotten afterwards): RMS, share of exact zeros,
        non-finite count."""
        with self._lock:
            parts = [self._sums.pop(i) for i in sample_ids if i in self._sums]
        total = torch.stack(parts).sum(dim=0) if parts else torch.zeros(4, len(self.layer_ids), dtype=torch.float64)
        values = total[3].clamp(min=1)
        return {"engine": self.engine, "layers": self.layer_ids,
                "rms": [round(float(v), 6) for v in (total[0] / values).sqrt()],
                "zero_share": [round(float(v), 8) for v in total[1] / values],
                "non_finite": [int(v) for v in total[2]]}
