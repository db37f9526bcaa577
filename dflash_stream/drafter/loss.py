"""Training objective: anchors, blocks, same-position labels and the decay-weighted loss: cross-entropy on the data's
tokens, KL divergence to the verifier's distribution (train.loss), and a DFlash2 drafter's selector loss.

The LM head dominates training memory: every supervised slot needs a row of vocabulary logits, so a micro-batch
of 16 sequences x 512 anchors x 15 slots at a 151,936-token vocabulary would hold ~37 GB of bf16 logits (and twice
that in float32). `head_cross_entropy` therefore computes the head and the loss `chunk_rows` rows at a time and
recomputes each chunk's logits in backward, so its working set is chunk_rows x vocab whatever the row count (twice
that with a KL term: the teacher's distribution is made from the stored verifier state chunk by chunk too). Rows
that fit one chunk keep its softmax for backward instead (the same buffer, one head matmul fewer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash_stream.config import TrainConfig
from dflash_stream.drafter.dflash2 import CandidateSelector, DFlash2Drafter
from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.model import DFlashDrafter
from dflash_stream.drafter.spec import DrafterSpec


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


@dataclass(frozen=True)
class Objective:
    """What the loss is made of (train.loss): ce_weight x cross-entropy on the data's next tokens + kl_weight x KL
    to the verifier's distribution, per supervised slot; and, for a DFlash2 drafter, selector_weight x its
    candidate selector's loss. Each term is decay-weighted per slot and divided by the same weight sum."""

    ce_weight: float = 1.0
    kl_weight: float = 0.0
    selector_weight: float = 1.0

    @classmethod
    def from_config(cls, train: TrainConfig) -> Objective:
        ce, kl = train.loss_weights
        return cls(ce_weight=ce, kl_weight=kl, selector_weight=train.selector_weight)

    @property
    def uses_verifier(self) -> bool:
        return self.kl_weight > 0


CE = Objective()
"""Today's objective: cross-entropy alone (z-lab's recipe)."""


@dataclass
class HeadTerms:
    """The LM head's share of the loss over R supervised rows (see `head_loss`)."""

    total: Tensor
    """sum_r w_r x (ce_weight x CE_r + kl_weight x KL_r), float32."""
    hits: Tensor
    """[R] bool: the head's argmax is the row's label."""
    candidates: Tensor
    """[R, K] long: the head's top-K ids per row, the selector's target put last where the K missed it ([R, 0]
    without candidates)."""
    candidate_logits: Tensor
    """[R, K] float32 logits of `candidates`, with a gradient (the selector's unary scores)."""
    selector_target: Tensor
    """[R] long: the label, or the verifier's argmax with `select_teacher` (empty without candidates)."""


def _chunk_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """float32 logits of one chunk, computed in the head's dtype like `TargetHead.logits` (bf16 under autocast)."""
    return F.linear(hidden.to(weight.dtype), weight).float()


LSE_SLICE = 16_384
"""Vocabulary entries per slice of `_row_logsumexp`: its temporary is rows x LSE_SLICE, not rows x vocab."""


def _row_logsumexp(x: Tensor) -> Tensor:
    """log sum exp over the last dim of [rows, vocab] without a second [rows, vocab] buffer (torch.logsumexp makes
    one), a vocabulary slice at a time."""
    peak = x.amax(-1, keepdim=True)
    total = sum(x[:, i : i + LSE_SLICE].sub(peak).exp_().sum(-1) for i in range(0, x.shape[-1], LSE_SLICE))
    return total.log_() + peak.squeeze(-1)


def _teacher_log_probs(normed: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    """float32 log-probabilities of the target's own next token from `TargetHead.verifier_normed` rows: the
    same computation as `TargetHead.teacher_logits`, then log-softmax in place."""
    logits = _chunk_logits(normed, weight)
    if softcap:
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    return logits.sub_(_row_logsumexp(logits)[:, None])


@dataclass(frozen=True)
class _Setup:
    """The non-tensor arguments of the chunked head loss."""

    chunk_rows: int
    ce_weight: float
    kl_weight: float
    softcap: float | None
    top_k: int
    select_teacher: bool


def _candidates(logits: Tensor, chosen: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """(top-k ids, their logits) per row, `chosen` put in the last place where the top-k missed it (speculators'
    DFlash2 training candidates: the selector's target must be among them)."""
    values, ids = logits.topk(top_k, dim=-1)
    missed = ~(ids == chosen[:, None]).any(-1)
    last = torch.where(missed, chosen, ids[:, -1])
    ids = torch.cat((ids[:, :-1], last[:, None]), dim=1)
    return ids, logits.gather(1, ids)


# One chunk per call: its logits die when the call returns, before the next chunk's are made.
def _chunk_forward(hidden: Tensor, weight: Tensor, target: Tensor, teacher: Tensor | None, setup: _Setup,
                   keep_softmax: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """(log-sum-exp, the objective, argmax hit, candidates, their logits, selector target) per row, and with
    `keep_softmax` (cross-entropy alone) the chunk's softmax, for a backward that need not compute it again."""
    logits = _chunk_logits(hidden, weight)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    hits = logits.argmax(-1) == target
    log_p = None if teacher is None else _teacher_log_probs(teacher, weight, setup.softcap)
    chosen = log_p.argmax(-1) if log_p is not None and setup.select_teacher else target
    if setup.top_k:
        candidates, candidate_logits = _candidates(logits, chosen, setup.top_k)
    else:
        candidates = candidate_logits = logits.new_empty(0)
    softmax = None
    if log_p is None:
        peak = logits.amax(-1, keepdim=True)
        lse = logits.sub_(peak).exp_().sum(-1).log_() + peak.squeeze(1)  # in place: no second [rows, vocab] buffer
        if keep_softmax:  # exp(logits - peak) x exp(peak - lse)
            softmax = logits.mul_((peak.squeeze(1) - lse).exp_()[:, None])
    else:
        # KL(p || q) = sum p (log p - log q), term by term (a difference of the summed parts loses the small KL to
        # rounding), in the two buffers already there: logits -> log p - log q -> p (log p - log q).
        lse = _row_logsumexp(logits)
        kl = logits.sub_(lse[:, None]).neg_().add_(log_p).mul_(log_p.exp_()).sum(-1)
        del log_p
    objective = lse - picked
    if setup.ce_weight != 1.0:
        objective = objective * setup.ce_weight
    if setup.kl_weight:
        objective = objective + setup.kl_weight * kl
    return lse, objective, hits, candidates, candidate_logits, chosen, softmax


def _chunk_backward(hidden: Tensor, weight: Tensor, target: Tensor, teacher: Tensor | None, lse: Tensor,
                    scale: Tensor, setup: _Setup, candidates: Tensor | None, grad_candidates: Tensor | None,
                    softmax: Tensor | None = None) -> Tensor:
    """d(sum scale * objective + grad_candidates . candidate logits)/d hidden: the softmax (the forward's, or the
    logits recomputed) turned in place into scale * ((ce + kl) x softmax - ce x onehot - kl x teacher), plus the
    candidates' own gradient."""
    grad = softmax if softmax is not None else _chunk_logits(hidden, weight).sub_(lse[:, None]).exp_()
    both = setup.ce_weight + setup.kl_weight
    if both != 1.0:
        grad.mul_(both)
    if setup.ce_weight:
        grad[torch.arange(grad.shape[0], device=grad.device), target] -= setup.ce_weight
    if setup.kl_weight:
        grad.sub_(_teacher_log_probs(teacher, weight, setup.softcap).exp_().mul_(setup.kl_weight))
    grad.mul_(scale[:, None])
    if grad_candidates is not None:
        grad.scatter_add_(1, candidates, grad_candidates.float())
    return (grad.to(weight.dtype) @ weight).to(hidden.dtype)


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum_r w_r x objective_r (see `head_loss`), the argmax hits and the top-k candidates, `chunk_rows` rows of
    logits at a time.

    Forward keeps only each row's log-sum-exp; backward recomputes a chunk's logits (and the teacher's) to get its
    gradient. Where all rows are one chunk and the loss is cross-entropy alone, forward keeps that chunk's softmax
    instead: the buffer backward would make again (the peak is the same) and one head matmul fewer, a third of a
    CPU demo step. The head is frozen, so only the hidden rows get a gradient.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, weights: Tensor, teacher: Tensor | None,
                setup: _Setup) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        rows, k = hidden.shape[0], setup.top_k
        dev = hidden.device
        total = torch.zeros((), dtype=torch.float32, device=dev)
        lse = torch.empty(rows, dtype=torch.float32, device=dev)
        hits = torch.empty(rows, dtype=torch.bool, device=dev)
        candidates = torch.empty(rows, k, dtype=torch.long, device=dev)
        candidate_logits = torch.empty(rows, k, dtype=torch.float32, device=dev)
        chosen = torch.empty(rows if k else 0, dtype=torch.long, device=dev)
        keep = ctx.needs_input_grad[0] and teacher is None and rows <= setup.chunk_rows
        ctx.softmax = None
        for start in range(0, rows, setup.chunk_rows):
            r = slice(start, start + setup.chunk_rows)
            part = None if teacher is None else teacher[r]
            lse[r], objective, hits[r], cand, cand_logits, selected, ctx.softmax = _chunk_forward(
                hidden[r], weight, target[r], part, setup, keep)
            total += (weights[r] * objective).sum()
            if k:
                candidates[r], candidate_logits[r], chosen[r] = cand, cand_logits, selected
        ctx.save_for_backward(hidden, weight, target, weights, lse, teacher, candidates)
        ctx.setup = setup
        ctx.mark_non_differentiable(hits, candidates, chosen)
        return total, hits, candidates, candidate_logits, chosen

    @staticmethod
    def backward(ctx, grad_total: Tensor, _hits: Tensor, _candidates: Tensor, grad_candidate_logits: Tensor | None,
                 _chosen: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, target, weights, lse, teacher, candidates = ctx.saved_tensors
        setup: _Setup = ctx.setup
        grad_hidden = torch.empty_like(hidden)
        with_candidates = setup.top_k and grad_candidate_logits is not None
        softmax, ctx.softmax = ctx.softmax, None  # backward turns it into the gradient, in place: once
        for start in range(0, hidden.shape[0], setup.chunk_rows):
            r = slice(start, start + setup.chunk_rows)
            grad_hidden[r] = _chunk_backward(
                hidden[r], weight, target[r], None if teacher is None else teacher[r], lse[r],
                weights[r] * grad_total, setup, candidates[r] if with_candidates else None,
                grad_candidate_logits[r] if with_candidates else None, softmax)
        return grad_hidden, None, None, None, None, None


def _plain_head_loss(hidden: Tensor, weight: Tensor, target: Tensor, weights: Tensor, teacher: Tensor | None,
                     setup: _Setup) -> HeadTerms:
    """`head_loss` through plain autograd on all rows at once (memory R x vocab): the reference the chunked path
    is tested and benchmarked against."""
    logits = _chunk_logits(hidden, weight)
    objective = F.cross_entropy(logits, target, reduction="none")
    if setup.ce_weight != 1.0:
        objective = objective * setup.ce_weight
    chosen = target
    if teacher is not None:
        log_p = _teacher_log_probs(teacher, weight, setup.softcap)
        chosen = log_p.argmax(-1) if setup.select_teacher else target
        if setup.kl_weight:
            kl = F.kl_div(logits.log_softmax(-1), log_p, reduction="none", log_target=True).sum(-1)
            objective = objective + setup.kl_weight * kl
    empty = logits.new_empty(hidden.shape[0], 0)
    candidates, candidate_logits = (_candidates(logits, chosen, setup.top_k) if setup.top_k
                                    else (empty.long(), empty))
    return HeadTerms((weights * objective).sum(), (logits.argmax(-1) == target).detach(), candidates,
                     candidate_logits, chosen if setup.top_k else target.new_empty(0))


def head_loss(hidden: Tensor, weight: Tensor, target: Tensor, weights: Tensor, *,
              chunk_rows: int | None = DEFAULT_CHUNK_ROWS, objective: Objective = CE, teacher: Tensor | None = None,
              softcap: float | None = None, top_k: int = 0, select_teacher: bool = False) -> HeadTerms:
    """The LM head's loss over hidden rows [R, D]: sum_r w_r x (ce_weight x CE(logits_r, target_r) + kl_weight x
    KL(p_r || softmax(logits_r))), where p_r is the target's own distribution from `teacher` [R, D]
    (`TargetHead.verifier_normed` rows, through the same head; `softcap` as the target applies it); and with
    `top_k` the head's top-k candidates per row for a DFlash2 selector, aiming at the label (or at the teacher's
    argmax with `select_teacher`).

    chunk_rows=None runs the head on all rows at once through plain autograd (memory R x vocab; the reference
    the chunked path is tested and benchmarked against).
    """
    if objective.kl_weight and teacher is None:
        raise ValueError("a KL objective needs the teacher rows (the verifier's normed states)")
    setup = _Setup(chunk_rows or max(1, hidden.shape[0]), objective.ce_weight, objective.kl_weight, softcap, top_k,
                   select_teacher)
    if chunk_rows is None:
        return _plain_head_loss(hidden, weight, target, weights, teacher, setup)
    # Autocast off: the chunks compute in the head's dtype explicitly, the same in forward and in backward.
    with torch.autocast(hidden.device.type, enabled=False):
        total, hits, candidates, candidate_logits, chosen = _ChunkedHeadLoss.apply(
            hidden, weight, target, weights.float(), teacher, setup)
    return HeadTerms(total, hits, candidates, candidate_logits, chosen)


def head_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, weights: Tensor,
                       chunk_rows: int | None = DEFAULT_CHUNK_ROWS) -> tuple[Tensor, Tensor]:
    """(sum of weights x cross-entropy of the LM head's logits, argmax hits per row) for hidden [R, D]
    (`head_loss` with the cross-entropy alone)."""
    terms = head_loss(hidden, weight, target, weights, chunk_rows=chunk_rows)
    return terms.total, terms.hits


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
    objective: Objective = CE,
) -> LossOutput:
    """Decay-weighted loss (`objective`: cross-entropy by default) of all blocks of a batch, drafted in one
    forward pass; a DFlash2 drafter adds its selector's loss (`DFlash2Drafter.selector_loss`).

    batch: "hidden_states" [N, S, K*D] (or [N, S, (K+1)*D] with the verifier's state last, which a KL objective
    needs), "input_ids" [N, S], "loss_mask" [N, S] (False on padding), "lengths" [N].
    Block j is [input_ids[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1; slot k predicts input_ids[a_j + k],
    and the verifier's distribution for that token is the target's output at position a_j + k - 1.
    `num_blocks` fixes A for a batch padded to a fixed shape (`drafter/shapes.py`); the loss is the same.
    chunk_rows: rows of LM-head logits computed at a time (see `head_loss`).
    """
    ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"].bool(), batch["lengths"]
    n, s = ids.shape
    bs = drafter.spec.block_size
    dev = ids.device
    context_states, verifier_states = split_states(batch["hidden_states"], drafter.spec)
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
    context = drafter.context_kv(context_states, ctx_pos)
    hidden = drafter(head.embed(block_ids.flatten(1)), positions.flatten(1), context, drafter.block_masks(anchors, s))
    # Only supervised slots reach the LM head: its [*, vocab] logits dominate memory.
    hidden = hidden.view(n, a, bs, -1)[:, :, 1:][supervised]
    target = labels[supervised]
    w = slot_weights(bs, gamma, dev).expand(n, a, bs - 1)[supervised]
    selector = isinstance(drafter, DFlash2Drafter)
    # The token before each label (slot 1's is the anchor): where the target predicted the label, and the
    # selector's predecessor.
    before = (label_pos - 1).clamp(max=s - 1).flatten(1)
    teacher = None
    if objective.uses_verifier:
        if verifier_states is None:
            raise ValueError("train.loss with kl needs the verifier's state in the batch (extract.verifier_states)")
        rows = verifier_states.gather(1, before[..., None].expand(-1, -1, verifier_states.shape[-1]))
        teacher = head.verifier_normed(rows.view(n, a, bs - 1, -1)[supervised])
    terms = head_loss(hidden, head.lm_head_weight, target, w, chunk_rows=chunk_rows, objective=objective,
                      teacher=teacher, softcap=head.logit_softcap,
                      top_k=drafter.spec.selector_top_k if selector else 0,
                      select_teacher=selector and objective.uses_verifier)
    total, hits = terms.total, terms.hits
    if selector:
        predecessors = ids.gather(1, before).view(n, a, bs - 1)[supervised]
        selector_total, hits = selector_loss(drafter.candidate_selector, hidden, predecessors, terms, target, w,
                                             chunk_rows)
        total = total + objective.selector_weight * selector_total
    total_w = w.sum()
    loss = total / total_w.clamp_min(1e-6)

    slot = offsets[1:].expand(n, a, bs - 1)[supervised] - 1
    hits = hits.float()
    correct = torch.zeros(bs - 1, device=dev).index_add_(0, slot, hits.detach())
    count = torch.zeros(bs - 1, device=dev).index_add_(0, slot, torch.ones_like(hits))
    return LossOutput(loss=loss, correct=correct, count=count, weight=total_w.detach())


def selector_loss(selector: CandidateSelector, hidden: Tensor, predecessors: Tensor, terms: HeadTerms, labels: Tensor,
                  weights: Tensor, chunk_rows: int | None) -> tuple[Tensor, Tensor]:
    """(sum_r w_r x the selector's cross-entropy over row r's K candidates, whether its pick is the label) for a
    DFlash2 drafter, as speculators trains it: each candidate scores its unary logit plus the transition from the
    row's true previous token (teacher forcing: `predecessors` [R]), and the selector's target (`terms`:
    present among the candidates) is the class. Rows go `chunk_rows` at a time, each chunk's [rows, K, rank]
    products recomputed in backward rather than kept."""
    candidates, unary = terms.candidates, terms.candidate_logits
    classes = (candidates == terms.selector_target[:, None]).int().argmax(-1)
    total = unary.new_zeros(())
    hits = torch.empty_like(labels, dtype=torch.bool)
    step = chunk_rows or max(1, hidden.shape[0])
    for start in range(0, hidden.shape[0], step):
        r = slice(start, start + step)
        args = (hidden[r], predecessors[r], candidates[r])
        if torch.is_grad_enabled():
            transition = checkpoint(selector.transition, *args, use_reentrant=False)
        else:
            transition = selector.transition(*args)
        scores = unary[r] + transition.float()
        total = total + (weights[r] * F.cross_entropy(scores, classes[r], reduction="none")).sum()
        hits[r] = candidates[r].gather(1, scores.argmax(-1, keepdim=True)).squeeze(1) == labels[r]
    return total, hits.detach()


def split_states(states: Tensor, spec: DrafterSpec) -> tuple[Tensor, Tensor | None]:
    """(the drafter's K layers [.., K*D], the verifier's state [.., D] or None) of stored states: a store made with
    extract.verifier_states holds one more layer, last (`target_model.stored_layer_ids`)."""
    width = spec.num_context_layers * spec.hidden_size
    if states.shape[-1] == width:
        return states, None
    if states.shape[-1] != width + spec.hidden_size:
        raise ValueError(f"stored states are {states.shape[-1]} wide; the drafter reads {spec.num_context_layers} "
                         f"layers of {spec.hidden_size} (and the verifier's state would make one more)")
    return states[..., :width], states[..., width:]


def expected_acceptance(acc: Sequence[float]) -> float:
    """Acceptance length tau implied by per-slot accuracies: 1 + sum_k prod_{j<=k} acc_j."""
    tau, run = 1.0, 1.0
    for p in acc:
        run *= p
        tau += run
    return tau
