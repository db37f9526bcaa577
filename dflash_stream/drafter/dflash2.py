"""The DFlash2 draft model: DFlash (drafter/model.py) with a local convolution around each sublayer and a candidate
selector, as speculators trains it (`models/dflash2`) and vLLM serves it (`qwen3_dflash2.py`, DFlash2DraftModel).

- Each draft layer wraps its attention and its MLP in a grouped two-tap causal convolution over the block's tokens:
  `prepare` convolves the sublayer's (normed) input, `finish` its output. A tap k mixes in the token k slots
  before, within the same block only; its coefficients are a learned base kernel per channel plus a delta per
  group of `conv_group_size` channels that a projection of the token's input predicts. Both convolutions start
  as the identity (base tap 0 = 1, the rest and the projection 0): a fresh DFlash2 drafter computes what the
  same DFlash backbone computes.
- The candidate selector reranks the head's top-k tokens of each slot by a bilinear score of the token before
  it: `predecessor_codebook[previous] * hidden_projection(hidden)` against `successor_codebook[candidate]`,
  added to the candidate's logit. Drafting walks the slots left to right, each slot's pick becoming the next
  slot's predecessor (the anchor token for the first), as vLLM's DFlash2 speculator does.

Shapes as in model.py: N sequences, Q block-token queries (A blocks of B tokens), D hidden, G = D / group size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_stream.drafter.model import KV, DFlashDrafter, Layer, Mask
from dflash_stream.drafter.spec import DFLASH2, DrafterSpec

if TYPE_CHECKING:
    from dflash_stream.drafter.head import TargetHead


def grouped_conv(x: Tensor, delta: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
    """x [..., Q, D] convolved causally within blocks of `block_size` consecutive queries: output[q] =
    sum_k (base[k] + delta[q, k]) * x[q - k] over the taps k that stay inside q's block. delta [..., Q, taps, G]
    (one coefficient per group of `group_size` channels), base [taps, D]."""
    taps, d = base.shape
    groups = x.unflatten(-1, (d // group_size, group_size))
    coefficients = base.view(taps, d // group_size, group_size) + delta[..., None]  # [..., Q, taps, G, gs]
    out = coefficients[..., 0, :, :] * groups
    slot = torch.arange(x.shape[-2], device=x.device) % block_size
    for tap in range(1, taps):
        before = F.pad(groups[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))  # x[q - tap], zeros at the start
        out = out + coefficients[..., tap, :, :] * before * (slot >= tap).view(-1, 1, 1)
    return out.flatten(-2)


class GroupedConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, both driven by one projection of its input."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        d = spec.hidden_size
        self.taps, self.group_size, self.block_size = spec.conv_kernel_size, spec.conv_group_size, spec.block_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, d))
        self.kernel_projection = nn.Linear(d, 2 * self.taps * (d // self.group_size), bias=False)

    def reset_parameters(self) -> None:
        """The identity on both sides."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(x convolved, the output side's kernel deltas [.., Q, taps, G] for `finish`)."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, -1))
        return self._conv(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, x: Tensor, delta: Tensor) -> Tensor:
        return self._conv(x, delta, 1)

    def _conv(self, x: Tensor, delta: Tensor, side: int) -> Tensor:
        args = (x, delta, self.base_kernel[side], self.block_size, self.group_size)
        if torch.is_grad_enabled():
            # Recomputed in backward: kept, its per-token coefficients and shifted inputs (taps x hidden each)
            # would double a layer's activations; recomputing them is a few elementwise products.
            return checkpoint(grouped_conv, *args, use_reentrant=False)
        return grouped_conv(*args)


class DFlash2Layer(Layer):
    """A DFlash layer whose attention and MLP each sit inside a `GroupedConv`."""

    def __init__(self, spec: DrafterSpec, window: int | None = None) -> None:
        super().__init__(spec, window)
        self.attention_conv = GroupedConv(spec)
        self.mlp_conv = GroupedConv(spec)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: KV, mask: Mask) -> Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context, mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    """Bilinear scores of (previous token, hidden state) -> candidate token, added to the candidates' logits."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.top_k = spec.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(spec.vocab_size, spec.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(spec.vocab_size, spec.selector_rank))
        self.hidden_projection = nn.Linear(spec.hidden_size, spec.selector_rank, bias=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def transition(self, hidden: Tensor, predecessors: Tensor, candidates: Tensor) -> Tensor:
        """[..., K] scores of `candidates` [..., K] after the token `predecessors` [...] at hidden states [..., D]."""
        context = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)
        return (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)

    def edge_scores(self, candidates: Tensor, unary: Tensor, hidden: Tensor, anchors: Tensor) -> Tensor:
        """[b, L, K, K] score of candidate c at slot l after candidate p of slot l - 1 (after the anchor token for
        l = 0, the same for every p): unary[b, l, c] + transition. candidates/unary [b, L, K], hidden [b, L, D],
        anchors [b]. vLLM's DFlash2 speculator scores all edges at once like this, then walks them."""
        b, length, k = candidates.shape
        previous = torch.cat((anchors.view(b, 1, 1).expand(b, 1, k), candidates[:, :-1]), dim=1)  # [b, L, K]
        context = self.predecessor_codebook[previous] * self.hidden_projection(hidden).unsqueeze(2)
        return unary.unsqueeze(2) + context @ self.successor_codebook[candidates].transpose(-1, -2)


def walk(scores: Tensor, candidates: Tensor) -> Tensor:
    """The greedy path through edge scores [b, L, K, K] (`CandidateSelector.edge_scores`): at slot 0 the best
    candidate after the anchor, then at each slot the best candidate after the one picked before. Token ids
    [b, L]."""
    b, length, k = candidates.shape
    rows = torch.arange(b, device=scores.device)
    previous = torch.zeros(b, dtype=torch.long, device=scores.device)
    picked = []
    for slot in range(length):
        previous = scores[rows, slot, previous].argmax(-1)
        picked.append(candidates[rows, slot, previous])
    return torch.stack(picked, dim=1)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash backbone (`DFlashDrafter`) with `DFlash2Layer`s and a `candidate_selector`."""

    layer_class = DFlash2Layer

    def __init__(self, spec: DrafterSpec, attention: str = "auto") -> None:
        super().__init__(spec, attention)
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        self.candidate_selector = CandidateSelector(spec)
        self.candidate_selector.reset_parameters()

    def propose(self, head: TargetHead, block: Tensor, positions: Tensor, context: list[KV]) -> Tensor:
        """Greedy drafts [N, B-1] for the masked slots of `block` [N, B]: the head's top-k per slot, reranked by
        the selector along the path that starts at the block's first (anchor) token."""
        hidden = self(head.embed(block), positions, context)[:, 1:]
        unary, candidates = head.logits(hidden).float().topk(self.spec.selector_top_k, dim=-1)
        scores = self.candidate_selector.edge_scores(candidates, unary, hidden, block[:, 0])
        return walk(scores, candidates)


def build_drafter(spec: DrafterSpec, attention: str = "auto") -> DFlashDrafter:
    """A fresh drafter of the spec's kind: `DFlashDrafter` or `DFlash2Drafter`."""
    return (DFlash2Drafter if spec.kind == DFLASH2 else DFlashDrafter)(spec, attention=attention)
