"""Token-budget batches from the samples of claimed segments, and the padded tensors the drafter's loss takes.

Samples wait in one queue per length bucket (`drafter/shapes.py`), so that a batch holds samples of similar
length and takes its bucket's fixed shape. Buckets fill at different rates: once HOLD_BATCHES batches' worth
of tokens queued behind a sample, its bucket's queue moves up one bucket (its samples fit there, padded a
little more), so rare lengths join a bucket that fills instead of going out as batches of empty rows; in the
last bucket the batch then goes out partly filled, topped up with shorter samples. Each queued sample
remembers its segment, which is what the trainer's exactly-once bookkeeping needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from dflash_stream.config import HOLD_BATCHES
from dflash_stream.drafter.shapes import Shape, ShapePlan

# HOLD_BATCHES bounds how long a segment stays unfinished (so unreleasable, and held in host memory) because one
# of its samples waits in a rare bucket: at most one such period per bucket. `plan` counts it (config.py).


class SampleLike(Protocol):
    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor


@dataclass(frozen=True)
class Member:
    segment_id: str
    sample: SampleLike
    queued_at: int = 0
    """Tokens queued before this sample: its place in arrival order."""
    deadline: int = 0
    """When the batcher's token count passes this, the sample's bucket queue moves up (or goes out)."""

    @property
    def length(self) -> int:
        return int(self.sample.input_ids.shape[0])


class TokenBatcher:
    """Samples queued per length bucket and cut into batches of the bucket's `rows` (rows x length stays
    within train.batch_tokens; a bucket longer than the budget holds one sample a batch)."""

    def __init__(self, plan: ShapePlan) -> None:
        self.plan = plan
        self._queues: list[list[Member]] = [[] for _ in plan.shapes]
        self._queued_tokens = 0
        self._hold_tokens = HOLD_BATCHES * plan.batch_tokens

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def add(self, segment_id: str, samples: list[SampleLike]) -> None:
        for sample in sorted(samples, key=lambda s: (int(s.input_ids.shape[0]), s.sample_id)):
            member = Member(segment_id, sample, self._queued_tokens, self._queued_tokens + self._hold_tokens)
            self._queued_tokens += member.length
            self._queues[self.plan.bucket(member.length)].append(member)
        self._promote()

    def _overdue(self, bucket: int) -> bool:
        return any(m.deadline < self._queued_tokens for m in self._queues[bucket])

    def _promote(self) -> None:
        """Move every bucket queue holding an overdue sample up one bucket, with a fresh deadline."""
        for i in range(len(self._queues) - 1):
            if self._overdue(i):
                moved = [replace(m, deadline=self._queued_tokens + self._hold_tokens) for m in self._queues[i]]
                self._queues[i + 1] = sorted(self._queues[i + 1] + moved, key=lambda m: m.queued_at)
                self._queues[i] = []

    def _oldest(self, buckets: Iterable[int]) -> int | None:
        """The bucket among `buckets` whose first sample has waited longest (None if all are empty)."""
        waiting = [i for i in buckets if self._queues[i]]
        return min(waiting, key=lambda i: self._queues[i][0].queued_at, default=None)

    def _due(self) -> int | None:
        """The bucket whose batch is due: a full one, or the last one once a sample in it is overdue."""
        full = [i for i, q in enumerate(self._queues) if len(q) >= self.plan.shapes[i].rows]
        last = len(self._queues) - 1
        return self._oldest(full or ([last] if self._overdue(last) else []))

    def full_batch_ready(self) -> bool:
        """True when a batch is due: more samples queued behind it would not change it."""
        return self._due() is not None

    def next_batch(self) -> list[Member]:
        """The next batch (full or not); empty when nothing is queued. A partly filled batch is that of the
        longest bucket with samples, topped up with the longest-waiting samples of shorter buckets: what is
        queued goes out in the fewest batches."""
        bucket = self._due()
        if bucket is None:
            bucket = max((i for i, q in enumerate(self._queues) if q), default=None)
            if bucket is None:
                return []
        rows, source = self.plan.shapes[bucket].rows, self._queues[bucket]
        batch, self._queues[bucket] = source[:rows], source[rows:]
        while len(batch) < rows and (shorter := self._oldest(range(bucket))) is not None:
            batch.append(self._queues[shorter].pop(0))
        return batch

    def shape(self, members: list[Member]) -> Shape:
        """The fixed shape of a batch: that of the bucket of its longest sample."""
        return self.plan.shapes[self.plan.bucket(max(m.length for m in members))]


def collate(members: list[Member], device: torch.device, shape: Shape | None = None) -> dict[str, torch.Tensor]:
    """Right-padded tensors: hidden_states [N,S,K*D], input_ids [N,S], loss_mask [N,S] (False on padding), lengths [N].

    N and S are the batch's own (count, longest), or `shape`'s rows and length: the extra rows are empty samples
    of length 0, after the real ones.
    """
    samples = [m.sample for m in members]
    longest = max(m.length for m in members) if shape is None else shape.length
    rows = len(samples) if shape is None else shape.rows
    width = samples[0].hidden_states.shape[-1]
    hidden = torch.zeros(rows, longest, width, dtype=samples[0].hidden_states.dtype)
    input_ids = torch.zeros(rows, longest, dtype=torch.long)
    loss_mask = torch.zeros(rows, longest, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = sample.input_ids.shape[0]
        hidden[row, :n] = sample.hidden_states
        input_ids[row, :n] = sample.input_ids
        loss_mask[row, :n] = sample.loss_mask
    lengths = torch.zeros(rows, dtype=torch.long)
    lengths[: len(members)] = torch.tensor([m.length for m in members], dtype=torch.long)
    non_blocking = device.type == "cuda"
    if non_blocking:
        hidden, input_ids, loss_mask = hidden.pin_memory(), input_ids.pin_memory(), loss_mask.pin_memory()
    return {
        "hidden_states": hidden.to(device, non_blocking=non_blocking),
        "input_ids": input_ids.to(device, non_blocking=non_blocking),
        "loss_mask": loss_mask.to(device, non_blocking=non_blocking),
        "lengths": lengths.to(device),
    }

