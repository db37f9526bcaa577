"""Training objective: anchors, blocks, same-position labels and the decay-weighted cross-entropy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.model import DFlashDrafter


@dataclass
class LossOutput:
    loss: Tensor
    correct: Tensor
    """[B-1] correct (argmax) predictions per slot k = 1..B-1."""
    count: Tensor
    """[B-1] supervised predictions per slot."""
    weight: Tensor
    """Sum of the loss weights (to combine micro-batches exactly)."""


def eligible_anchors(loss_mask: Tensor) -> Tensor:
    """[N, S] bool: positions a with loss_mask[a] and loss_mask[a+1] (a block there has a first label)."""
    eligible = torch.zeros_like(loss_mask)
    eligible[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return eligible


def sample_anchors(
    loss_mask: Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    *,
    lengths: Tensor | None = None,
    num_blocks: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Up to `num_anchors` distinct eligible anchors per sequence, uniformly, in increasing order.

    Returns anchors [N, A] (long) and valid [N, A] (bool); A = min(num_anchors, most eligible in a row), or
    `num_blocks` when given (a fixed shape; it must be at least that), and rows with fewer eligible positions
    are padded with anchor 0 marked invalid. With `lengths` [N] (0 for an empty padding row, after the real
    rows), the random scores cover only the real rows and positions, so a batch padded to a fixed shape draws
    the very anchors of the same batch unpadded.
    """
    eligible = eligible_anchors(loss_mask)
    counts = [eligible.sum(dim=1).max()]
    if lengths is not None:
        counts += [(lengths > 0).sum(), lengths.max()]
    most, *real = torch.stack(counts).tolist()  # one device sync for all three
    extent = tuple(real) or eligible.shape
    a = max(1, min(num_anchors, most))
    if num_blocks is not None:
        if num_blocks < a:
            raise ValueError(f"num_blocks={num_blocks} is below the {a} blocks this batch needs")
        a = num_blocks
    rng_device = generator.device if generator is not None else eligible.device
    scores = torch.full(eligible.shape, -1.0, device=eligible.device)
    scores[: extent[0], : extent[1]] = torch.rand(extent, generator=generator, device=rng_device).to(eligible.device)
    scores = scores.masked_fill(~eligible, -1.0)
    top, idx = scores.topk(a, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, idx, torch.full_like(idx, torch.iinfo(idx.dtype).max)).sort(dim=1).values
    valid = valid.sum(dim=1, keepdim=True) > torch.arange(a, device=idx.device)
    return anchors.masked_fill(~valid, 0), valid


def slot_weights(block_size: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """[B-1] weight exp(-(k-1)/gamma) of slot k = 1..B-1: early slots decide acceptance, so they count most."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def dflash_loss(
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: dict[str, Tensor],
    *,
    num_anchors: int,
    gamma: float,
    generator: torch.Generator | None = None,
    num_blocks: int | None = None,
) -> LossOutput:
    """Decay-weighted cross-entropy of all blocks of a batch, drafted in one forward pass.

    batch: "hidden_states" [N, S, K*D], "input_ids" [N, S], "loss_mask" [N, S] (False on padding), "lengths" [N].
    Block j is [input_ids[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1; slot k predicts input_ids[a_j + k].
    `num_blocks` fixes A for a batch padded to a fixed shape (`drafter/shapes.py`); the loss is the same.
    """
    ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"].bool(), batch["lengths"]
    n, s = ids.shape
    bs = drafter.spec.block_size
    dev = ids.device
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator, lengths=lengths, num_blocks=num_blocks)
    a = anchors.shape[1]

    offsets = torch.arange(bs, device=dev)
    positions = anchors[..., None] + offsets  # [N, A, B]
    block_ids = torch.full_like(positions, drafter.spec.mask_token_id)
    block_ids[..., 0] = ids.gather(1, anchors)

    label_pos = positions[..., 1:]
    in_range = label_pos < lengths[:, None, None]
    safe_pos = label_pos.clamp(max=s - 1).flatten(1)
    labels = ids.gather(1, safe_pos).view(n, a, bs - 1)
    supervised = in_range & loss_mask.gather(1, safe_pos).view(n, a, bs - 1) & valid[..., None]

    ctx_pos = torch.arange(s, device=dev).expand(n, s)
    context = drafter.context_kv(batch["hidden_states"], ctx_pos)
    hidden = drafter(head.embed(block_ids.flatten(1)), positions.flatten(1), context, drafter.block_mask(anchors, s))
    # Only supervised slots reach the LM head: its [*, vocab] logits dominate memory.
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:][supervised]
    logits = head.logits(hidden).float()
    target = labels[supervised]
    w = slot_weights(bs, gamma, dev).expand(n, a, bs - 1)[supervised]
    ce = F.cross_entropy(logits, target, reduction="none")
    total_w = w.sum()
    loss = (w * ce).sum() / total_w.clamp_min(1e-6)

    slot = offsets[1:].expand(n, a, bs - 1)[supervised] - 1
    hits = (logits.argmax(-1) == target).float()
    correct = torch.zeros(bs - 1, device=dev).index_add_(0, slot, hits.detach())
    count = torch.zeros(bs - 1, device=dev).index_add_(0, slot, torch.ones_like(hits))
    return LossOutput(loss=loss, correct=correct, count=count, weight=total_w.detach())


def expected_acceptance(acc: Sequence[float]) -> float:
    """Acceptance length tau implied by per-slot accuracies: 1 + sum_k prod_{j<=k} acc_j."""
    tau, run = 1.0, 1.0
    for p in acc:
        run *= p
        tau += run
    return tau
