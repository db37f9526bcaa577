"""Training objective: anchors, blocks, same-position labels and the decay-weighted cross-entropy.

The LM head dominates training memory: every supervised slot needs a row of vocabulary logits, so a micro-batch
of 16 sequences x 512 anchors x 15 slots at a 151,936-token vocabulary would hold ~37 GB of bf16 logits (and twice
that in float32). `head_cross_entropy` therefore computes the head and the loss `chunk_rows` rows at a time and
recomputes each chunk's logits in backward, so its working set is chunk_rows x vocab whatever the row count.
"""

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


DEFAULT_CHUNK_ROWS = 2048
"""Rows of logits alive at once: 2048 x 151,936 x 6 B (bf16 logits + their float32 copy) is ~1.9 GB."""


def _chunk_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """float32 logits of one chunk, computed in the head's dtype like `TargetHead.logits` (bf16 under autocast)."""
    return F.linear(hidden.to(weight.dtype), weight).float()


# One chunk per call: its logits die when the call returns, before the next chunk's are made.
def _chunk_forward(hidden: Tensor, weight: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp, logit of the target, argmax hit) per row."""
    logits = _chunk_logits(hidden, weight)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    hits = logits.argmax(-1) == target
    peak = logits.amax(-1, keepdim=True)
    lse = logits.sub_(peak).exp_().sum(-1).log_() + peak.squeeze(1)  # in place: no second [rows, vocab] buffer
    return lse, picked, hits


def _chunk_backward(hidden: Tensor, weight: Tensor, target: Tensor, lse: Tensor, scale: Tensor) -> Tensor:
    """d(sum scale * CE)/d hidden: the logits recomputed and turned in place into scale * (softmax - onehot)."""
    grad = _chunk_logits(hidden, weight).sub_(lse[:, None]).exp_()
    grad[torch.arange(grad.shape[0], device=grad.device), target] -= 1.0
    grad.mul_(scale[:, None])
    return (grad.to(weight.dtype) @ weight).to(hidden.dtype)


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_r w_r * CE(hidden_r @ W^T, target_r) and the argmax hits, `chunk_rows` rows of logits at a time.

    Forward keeps only each row's log-sum-exp; backward recomputes a chunk's logits to get its gradient. The
    head is frozen, so only the hidden rows get a gradient.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, weights: Tensor, chunk_rows: int
                ) -> tuple[Tensor, Tensor]:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        hits = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            lse[rows], picked, hits[rows] = _chunk_forward(hidden[rows], weight, target[rows])
            total += (weights[rows] * (lse[rows] - picked)).sum()
        ctx.save_for_backward(hidden, weight, target, weights, lse)
        ctx.chunk_rows = chunk_rows
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_hits: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, target, weights, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            grad_hidden[rows] = _chunk_backward(hidden[rows], weight, target[rows], lse[rows],
                                                weights[rows] * grad_total)
        return grad_hidden, None, None, None, None


def head_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, weights: Tensor,
                       chunk_rows: int | None = DEFAULT_CHUNK_ROWS) -> tuple[Tensor, Tensor]:
    """(sum of weights x cross-entropy of the LM head's logits, argmax hits per row) for hidden [R, D].

    chunk_rows=None runs the head on all rows at once through plain autograd (memory R x vocab; the reference
    the chunked path is tested and benchmarked against).
    """
    if chunk_rows is None:
        logits = _chunk_logits(hidden, weight)
        ce = F.cross_entropy(logits, target, reduction="none")
        return (weights * ce).sum(), (logits.argmax(-1) == target).detach()
    # Autocast off: the chunks compute in the head's dtype explicitly, the same in forward and in backward.
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedHeadCE.apply(hidden, weight, target, weights.float(), chunk_rows)


def dflash_loss(
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: dict[str, Tensor],
    *,
    num_anchors: int,
    gamma: float,
    generator: torch.Generator | None = None,
    num_blocks: int | None = None,
    chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
) -> LossOutput:
    """Decay-weighted cross-entropy of all blocks of a batch, drafted in one forward pass.

    batch: "hidden_states" [N, S, K*D], "input_ids" [N, S], "loss_mask" [N, S] (False on padding), "lengths" [N].
    Block j is [input_ids[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1; slot k predicts input_ids[a_j + k].
    `num_blocks` fixes A for a batch padded to a fixed shape (`drafter/shapes.py`); the loss is the same.
    chunk_rows: rows of LM-head logits computed at a time (see `head_cross_entropy`).
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
    hidden = drafter(head.embed(block_ids.flatten(1)), positions.flatten(1), context, drafter.block_masks(anchors, s))
    # Only supervised slots reach the LM head: its [*, vocab] logits dominate memory.
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:][supervised]
    target = labels[supervised]
    w = slot_weights(bs, gamma, dev).expand(n, a, bs - 1)[supervised]
    ce_sum, hits = head_cross_entropy(hidden, head.lm_head_weight, target, w, chunk_rows)
    total_w = w.sum()
    loss = ce_sum / total_w.clamp_min(1e-6)

    slot = offsets[1:].expand(n, a, bs - 1)[supervised] - 1
    hits = hits.float()
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
