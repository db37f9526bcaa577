"""Token-budget batches from the samples of claimed segments, and the padded tensors the drafter's loss takes.

Samples of one segment are queued shortest first so that neighbours in a batch have similar lengths (little
padding); segments are queued in the order they were claimed, so a batch may span two segments. Each queued
sample remembers its segment, which is what the trainer's exactly-once bookkeeping needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch


class SampleLike(Protocol):
    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor


@dataclass(frozen=True)
class Member:
    segment_id: str
    sample: SampleLike

    @property
    def length(self) -> int:
        return int(self.sample.input_ids.shape[0])


class TokenBatcher:
    """A FIFO of samples cut into batches whose padded size (count x longest) stays within `batch_tokens`.

    A sample longer than the budget on its own still forms a batch of one: it was stored, so it is trained.
    """

    def __init__(self, batch_tokens: int) -> None:
        self.batch_tokens = batch_tokens
        self._queue: deque[Member] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, segment_id: str, samples: list[SampleLike]) -> None:
        for sample in sorted(samples, key=lambda s: (int(s.input_ids.shape[0]), s.sample_id)):
            self._queue.append(Member(segment_id, sample))

    def _cut(self) -> int:
        """How many queued samples the next batch takes."""
        count, longest = 0, 0
        for member in self._queue:
            widest = max(longest, member.length)
            if count and (count + 1) * widest > self.batch_tokens:
                break
            count, longest = count + 1, widest
        return count

    def full_batch_ready(self) -> bool:
        """True when the next batch would not grow if more samples were queued behind it."""
        return 0 < self._cut() < len(self._queue)

    def next_batch(self) -> list[Member]:
        """The next batch (full or not); empty when nothing is queued."""
        return [self._queue.popleft() for _ in range(self._cut())]


def collate(members: list[Member], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tensors: hidden_states [N,S,K*D], input_ids [N,S], loss_mask [N,S] (False on padding), lengths [N]."""
    samples = [m.sample for m in members]
    longest = max(m.length for m in members)
    width = samples[0].hidden_states.shape[-1]
    hidden = torch.zeros(len(samples), longest, width, dtype=samples[0].hidden_states.dtype)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = sample.input_ids.shape[0]
        hidden[row, :n] = sample.hidden_states
        input_ids[row, :n] = sample.input_ids
        loss_mask[row, :n] = sample.loss_mask
    lengths = torch.tensor([m.length for m in members], dtype=torch.long)
    non_blocking = device.type == "cuda"
    if non_blocking:
        hidden, input_ids, loss_mask = hidden.pin_memory(), input_ids.pin_memory(), loss_mask.pin_memory()
    return {
        "hidden_states": hidden.to(device, non_blocking=non_blocking),
        "input_ids": input_ids.to(device, non_blocking=non_blocking),
        "loss_mask": loss_mask.to(device, non_blocking=non_blocking),
        "lengths": lengths.to(device),
    }

