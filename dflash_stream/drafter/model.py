"""The DFlash draft model (block diffusion drafter, arXiv 2602.06036) in one file.

The drafter reads K layers of the frozen target, fused per token: `hidden_norm(fc(concat(layers)))`. Those
context features never get a residual stream of their own: each draft layer projects them to keys/values only.
The block being drafted is `[last token, MASK x (B-1)]`, embedded with the target's own (frozen) embedding; its
queries attend, without a causal mask, to the context features strictly before the block and to the whole
block. The final `norm` output goes through the target's LM head. Module names follow the z-lab checkpoints
(`layers.N.self_attn.q_proj`, `fc`, `hidden_norm`, `norm`, ...) so exported weights load in vLLM and SGLang.

Layers may be `sliding_attention` (spec.layer_types, as in z-lab's Qwen3.6 drafters), with z-lab's semantics: a
block token at absolute position p sees only the keys at positions p - W + 1 .. p (W = spec.sliding_window):
the last context positions before the anchor that fit, and its own block causally (slots 0..itself).

Shapes: N sequences, S context positions, Q block-token queries (A blocks of B tokens in training, one block
when decoding), H query heads, G key/value heads, Dh head width.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash_stream.config import ConfigError
from dflash_stream.drafter.spec import DrafterSpec

if TYPE_CHECKING:
    from dflash_stream.drafter.head import TargetHead

KV = tuple[Tensor, Tensor]  # keys, values of the context: [N, G, S, Dh] each
Mask = Tensor | BlockMask | None
Masks = dict[int | None, Mask]
"""Training masks by sliding window: None for the full-attention layers, W for the layers of window W."""


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE at absolute positions; cos/sin are computed per call because positions differ per block.

    With the target's `rope_scaling` (YaRN, llama3, linear) the frequencies and the cos/sin scale come from
    transformers' own RoPE init functions, as in the target and in z-lab's loader (Qwen3RotaryEmbedding)."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.scale = 1.0
        if spec.rope_scaling is None:
            dh = spec.head_dim
            inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
        else:
            inv_freq, self.scale = scaled_rope_frequencies(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [N, T] -> cos, sin [N, 1, T, Dh] (broadcast over heads)."""
        angles = positions[..., None].float() * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)[:, None]
        if self.scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.scale, emb.sin() * self.scale


def scaled_rope_frequencies(spec: DrafterSpec) -> tuple[Tensor, float]:
    """(inv_freq, cos/sin scale) of a scaled RoPE, from a Qwen3 config carrying the spec's rope parameters."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    try:
        config = Qwen3Config(
            hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings, rope_parameters=params,
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"the target's rope_scaling {spec.rope_scaling} is not usable: {err}") from None
    return inv_freq.float(), float(scale)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


COMPILED_FLEX_DEVICES = {"cuda"}
"""Device types where FlexAttention runs compiled. The CPU compiler has no backward pass, so only `bench compile`
(forward only) adds "cpu"."""


@cache
def _compiled_flex() -> Callable:
    # FlexAttention is only fast (and memory-light) compiled; the eager fallback materialises the scores.
    # One graph per input shape: the trainer keeps to a fixed family of shapes (drafter/shapes.py).
    return torch.compile(flex_attention, dynamic=False)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    if isinstance(mask, BlockMask):
        fn = _compiled_flex() if q.device.type in COMPILED_FLEX_DEVICES else flex_attention
        return fn(q, k, v, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        d, h, g, dh = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = h, g, dh
        self.q_proj = nn.Linear(d, h * dh, bias=False)
        self.k_proj = nn.Linear(d, g * dh, bias=False)
        self.v_proj = nn.Linear(d, g * dh, bias=False)
        self.o_proj = nn.Linear(h * dh, d, bias=False)
        self.q_norm = nn.RMSNorm(dh, eps=spec.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dh, eps=spec.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """Keys and values of x [N, T, D] at the positions cos/sin encode."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: KV, mask: Mask) -> Tensor:
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k = torch.cat((context[0], k), dim=2)
        v = torch.cat((context[1], v), dim=2)
        # Under autocast the RMSNorms may hand back float32 q/k beside a bf16 v; the kernels want one dtype.
        out = attend(q.to(v.dtype), k.to(v.dtype), v, mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, spec: DrafterSpec, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        """Sliding window of this layer; None for full attention."""
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: KV, mask: Mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    layer_class: type[Layer] = Layer
    """The draft layer; DFlash2 (drafter/dflash2.py) wraps its sublayers in convolutions."""

    def __init__(self, spec: DrafterSpec, attention: str = "auto") -> None:
        super().__init__()
        self.spec = spec
        self.attention = attention
        d = spec.hidden_size
        self.fc = nn.Linear(spec.num_context_layers * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=spec.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(spec, window) for window in spec.layer_windows)
        self.norm = nn.RMSNorm(d, eps=spec.rms_norm_eps)
        self.rotary = Rotary(spec)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def context_kv(self, target_states: Tensor, positions: Tensor) -> list[KV]:
        """Per-layer keys/values of the context: target_states [N, S, K*D] at positions [N, S].

        They depend on nothing but the target's states, so a decoder caches them and appends new positions.
        """
        feats = self.hidden_norm(self.fc(target_states.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(positions)
        return [layer.self_attn.kv(feats, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: Tensor, positions: Tensor, context: list[KV], mask: Mask | Masks = None
                ) -> Tensor:
        """Final hidden states [N, Q, D] of the block tokens.

        block_embeds [N, Q, D] (target embeddings of the block tokens), positions [N, Q] (absolute),
        context from `context_kv`; mask over keys [context ; block]: None = one block drafted right after its
        whole context (full layers see everything, sliding layers their window), else from `block_masks`
        (or `block_mask` when every layer is full attention).
        """
        if isinstance(mask, dict):
            masks = mask
        elif mask is None:
            kv_len = context[0][0].shape[2] + block_embeds.shape[1]
            masks = {w: None if w is None else window_mask(block_embeds.shape[1], kv_len, w, block_embeds.device)
                     for w in dict.fromkeys(self.spec.layer_windows)}
        elif self.spec.sliding_window is None:
            masks = {None: mask}
        else:
            raise ValueError("sliding layers need their own masks: pass drafter.block_masks(...), not one mask")
        cos, sin = self.rotary(positions)
        x = block_embeds.to(self.fc.weight.dtype)
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, kv, masks[layer.window])
        return self.norm(x)

    def propose(self, head: TargetHead, block: Tensor, positions: Tensor, context: list[KV]) -> Tensor:
        """Greedy drafts [N, B-1] for the masked slots of `block` [N, B] at `positions`, after `context`: the
        target's LM head's argmax at each slot."""
        return head.logits(self(head.embed(block), positions, context)[:, 1:]).argmax(-1)

    def uses_flex(self, device: torch.device) -> bool:
        """Whether training masks on `device` go to FlexAttention (compiled on CUDA) rather than SDPA."""
        return self.attention == "flex" or (self.attention == "auto" and device.type == "cuda")

    def block_masks(self, anchors: Tensor, context_len: int) -> Masks:
        """The training mask of each layer type (see `block_mask`), by sliding window (None: full layers)."""
        return {w: self.block_mask(anchors, context_len, w) for w in dict.fromkeys(self.spec.layer_windows)}

    def block_mask(self, anchors: Tensor, context_len: int, window: int | None = None) -> Mask:
        """Training mask for A blocks per sequence (anchors [N, A]) after `context_len` context keys, for the
        full-attention layers (window None) or the sliding layers of `window`: FlexAttention's BlockMask
        (attention `flex`, or `auto` on CUDA) or a dense bool mask (SDPA)."""
        layout = None
        if self.spec.sliding_window is not None:
            # A tensor, not a constant: compiled FlexAttention then builds one graph for both layer types (a
            # graph per window would double the graphs per shape, past torch's recompile limit of 8).
            layout = torch.tensor(NO_WINDOW if window is None else window, device=anchors.device)
        mask_mod = anchor_mask_mod(anchors, context_len, self.spec.block_size, layout)
        n, a = anchors.shape
        q_len = a * self.spec.block_size
        kv_len = context_len + q_len
        if self.uses_flex(anchors.device):
            if not anchors.is_cuda and torch.is_grad_enabled():
                # Off CUDA FlexAttention runs uncompiled, and torch warns its backward pass may be wrong.
                raise ConfigError("drafter.attention=flex trains only on CUDA; use auto or sdpa on this device")
            return create_block_mask(mask_mod, n, None, q_len, kv_len, device=anchors.device)
        dev = anchors.device
        b = torch.arange(n, device=dev)[:, None, None, None]
        q = torch.arange(q_len, device=dev)[None, None, :, None]
        kv = torch.arange(kv_len, device=dev)[None, None, None, :]
        return mask_mod(b, None, q, kv)


NO_WINDOW = 2**62
"""The window value that marks a full-attention layer in a drafter with sliding layers (see `anchor_mask_mod`)."""


def anchor_mask_mod(anchors: Tensor, context_len: int, block_size: int, window: Tensor | None = None) -> Callable:
    """Who a block-token query may see: context keys strictly before its block's anchor (when decoding, the
    target has not yet run on the anchor token, so no state exists there), every token of its own block, and
    nothing of the other blocks. Written with tensor ops only so that it serves as a
    FlexAttention mask_mod and, evaluated on broadcast index grids, as the dense SDPA mask.

    With a `window` W (a 0-d tensor; drafters with sliding layers use this form for all their layers, NO_WINDOW
    for the full ones), what `window_mask` gives when decoding, at the block's absolute positions: the query at
    position p = anchor + k keeps only keys at positions p - W + 1 .. p, i.e. context from p - W + 1 and its own
    block's slots 0..k. NO_WINDOW keeps the rule above unchanged (not causal, no window)."""

    def mask_mod(b: Tensor, h: Tensor | None, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size
        before_anchor = kv_idx < anchors[b, block]
        same_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        if window is None:
            return before_anchor | same_block
        anchor = anchors[b, block]
        q_pos = anchor + q_idx % block_size
        kv_pos = torch.where(kv_idx >= context_len, anchor + (kv_idx - context_len) % block_size, kv_idx)
        causal = (kv_pos <= q_pos) | (window == NO_WINDOW)
        return (before_anchor | same_block) & causal & (q_pos - kv_pos < window)

    return mask_mod


def window_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> Tensor:
    """A sliding layer's mask when one block is drafted right after its whole context (keys = context at
    positions 0..S-1, then the block): z-lab's decoding rule, queries aligned with the last q_len keys, each
    seeing the `window` keys that end at itself. Bool [Q, KV], True = visible."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None]
    return (kv_pos <= q_pos) & (q_pos - kv_pos < window)
