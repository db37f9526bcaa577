"""A DFlash draft model for transformers: `AutoModel.from_pretrained(folder, trust_remote_code=True)`.

dflash-stream copies this file into every export as `dflash.py` (config.json's `auto_map` names it); it needs only
torch and transformers. The math is dflash-stream's drafter (dflash_stream/drafter/model.py): the K target layers
are fused per token as `hidden_norm(fc(concat))`; in each layer the block tokens give the queries and
`[context ; block]` the keys and values, with q/k RMSNorm and RoPE at absolute positions (the target's rope scaling
included, through transformers' Qwen3 rotary embedding) and no causal mask. Embedding and LM head are the
target's: pass its embeddings of the block tokens in, and apply its LM head to what comes out.

`layer_types` may mix in `sliding_attention` layers (z-lab's Qwen3.6 drafters), with z-lab's rule: without an
explicit `is_causal`, sliding layers are causal and see the `sliding_window` keys ending at the query, full
layers see everything; queries stand at the positions of the last keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def default_mask(q_len: int, kv_len: int, causal: bool, window: int | None, device: torch.device
                 ) -> torch.Tensor | None:
    """z-lab's mask when the caller gives none: query i stands at key position kv_len - q_len + i; causal keeps
    keys up to it, a window W keeps keys less than W away (behind it, and ahead of it when not causal)."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        visible &= kv_pos <= q_pos
    if window is not None:
        visible &= q_pos - kv_pos < window
        if not causal:
            visible &= kv_pos - q_pos < window
    return visible


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int = 0) -> None:
        super().__init__()
        layer_types = getattr(config, "layer_types", None)
        self.layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        sliding = self.layer_type == "sliding_attention"
        self.window = config.sliding_window if sliding else None
        is_causal = getattr(config, "is_causal", None)
        self.causal = sliding if is_causal is None else bool(is_causal)
        d, dh = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, dh
        self.q_proj = nn.Linear(d, self.heads * dh, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(self.heads * dh, d, bias=False)
        self.q_norm = nn.RMSNorm(dh, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dh, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [N, Q, D] block tokens, context [N, S, D] fused target features; cos/sin [N, 1, S+Q, Dh]."""
        q_len = x.shape[1]
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))).transpose(1, 2)
        both = torch.cat((context, x), dim=1)
        k = self.k_norm(self.k_proj(both).unflatten(-1, (self.kv_heads, self.head_dim))).transpose(1, 2)
        v = self.v_proj(both).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        q = _rotate(q, cos[:, :, -q_len:], sin[:, :, -q_len:])
        k = _rotate(k, cos, sin)
        if mask is None:
            mask = default_mask(q_len, k.shape[2], self.causal, self.window, x.device)
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, context, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = config.dflash_config
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(config.block_size)
        d = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, position_ids: torch.Tensor, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        """Final hidden states [N, Q, D] of the block tokens.

        noise_embedding [N, Q, D]: the target's embeddings of `[last token, MASK x (Q-1)]`; target_hidden
        [N, S, K*D]: the target layers' states of the context; position_ids [N, S+Q]: the absolute positions of
        the context and then of the block. attention_mask (optional, bool [N, 1, Q, S+Q]): keys each query sees,
        for every layer, or a dict of such masks by layer type; None: each layer's `default_mask`.
        """
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(x.float(), position_ids)
        cos, sin = cos[:, None], sin[:, None]
        for layer in self.layers:
            mask = attention_mask
            if isinstance(mask, dict):
                mask = mask[layer.self_attn.layer_type]
            x = layer(x, context, cos, sin, mask)
        return self.norm(x)

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0) -> torch.Tensor:
        """Greedy speculative decoding of one prompt [1, T]; returns prompt + new tokens, equal to the target's
        own greedy output. A plain reference loop: the drafter re-reads the whole context every block.

        The block tokens are embedded by the target's own embedding module, as SGLang does and as dflash-stream
        trained (Gemma's sqrt(hidden) scale included)."""
        if temperature > 0:
            raise ValueError("this reference decoder is greedy only (temperature=0)")
        stop = set(stop_token_ids or [])
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        cache = DynamicCache(config=target.config)
        out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=True)
        states = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        # Sliding-window and linear-attention (Gated-DeltaNet) layers overwrite what a rejected draft would need
        # back: from here on they record it for one forward, and `crop` restores the accepted prefix. Switched on
        # after the prefill so that the prompt's evicted states are not kept. (Older transformers lack it; their
        # full-attention caches crop without it.)
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording(recurrent_states_to_keep=self.block_size)
        tokens = [int(out.logits[0, -1].argmax())]
        length = input_ids.shape[1]
        while len(tokens) < max_new_tokens and tokens[-1] not in stop:
            block = input_ids.new_full((1, self.block_size), self.mask_token_id)
            block[0, 0] = tokens[-1]
            positions = torch.arange(length + self.block_size, device=input_ids.device)[None]
            hidden = self(positions, embed(block), states)
            block[0, 1:] = head(hidden[:, 1:]).argmax(-1)[0]
            out = target(block, cache=cache, use_cache=True, output_hidden_states=True)
            verdict = out.logits[0].argmax(-1)
            n = int((block[0, 1:] == verdict[:-1]).cumprod(0).sum())
            tokens += block[0, 1 : n + 1].tolist() + [int(verdict[n])]
            length += n + 1
            # Drop the rejected drafts' states; crop(0) too, which ends this step's recording.
            cache.crop(-(self.block_size - n - 1))
            new = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)[:, : n + 1]
            states = torch.cat((states, new), dim=1)
        tokens = tokens[:max_new_tokens]
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
        return torch.cat((input_ids, input_ids.new_tensor([tokens[:cut]])), dim=1)
