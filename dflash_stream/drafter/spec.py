"""The drafter's shape: everything needed to rebuild it and to write its `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_stream.config import Config, ConfigError


@dataclass
class DrafterSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    max_position_embeddings: int = 32768
    rope_scaling: dict[str, Any] | None = None
    """The target's RoPE scaling (`rope_type` yarn/llama3/linear and its parameters); None for plain RoPE."""

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)


def _rope_theta(text_config: Any) -> float:
    # transformers 5 keeps rope_theta inside rope_parameters; 4.x has it at top level.
    params = getattr(text_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(text_config, "rope_theta", None) or 10000.0)


SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")
"""Scalings whose frequencies depend on the config alone; `dynamic`/`longrope` change with the sequence length."""


def target_rope_scaling(text_config: Any) -> dict[str, Any] | None:
    """The target's RoPE scaling as the drafter must reproduce it (z-lab's loader builds the drafter's rotary
    embedding from its config the same way): None for plain RoPE."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type: the attention layers'
        params = params.get("full_attention") or next(iter(params.values()))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SCALED_ROPE_TYPES:
        raise ConfigError(
            f"target rope_scaling type '{rope_type}' is not supported by the drafter; "
            f"supported: default, {', '.join(SCALED_ROPE_TYPES)}"
        )
    # rope_theta has its own spec field; the drafter's attention rotates whole heads (no partial rotary).
    drop = ("rope_theta", "type", "partial_rotary_factor")
    return {"rope_type": rope_type, **{k: v for k, v in params.items() if k not in (*drop, "rope_type")}}


def default_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """The tokenizer's mask token; else the first embedding row no token uses (what z-lab uses for Qwen3,
    whose embedding is padded past the tokenizer); else the unknown/pad/eos token, whose row the target has."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    for name in ("unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ConfigError("drafter.mask_token_id: the tokenizer has no mask, unknown, pad or eos token; set it explicitly")


def _load_tokenizer(cfg: Config) -> Any:
    from transformers import AutoTokenizer

    from dflash_stream.target_model.loading import model_location

    location, kwargs = model_location(cfg.target)
    return AutoTokenizer.from_pretrained(location, **kwargs)


def build_spec(cfg: Config, target_config: Any, layer_ids: list[int], tokenizer: Any = None) -> DrafterSpec:
    """Widths, heads and MLP default from the target; depth, block size and mask token from `cfg.drafter`."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    d = cfg.drafter
    hidden = tc.hidden_size
    # The drafter reads the target's embeddings and feeds the target's LM head, so its width is the target's.
    if d.hidden_size is not None and d.hidden_size != hidden:
        raise ConfigError(
            f"drafter.hidden_size={d.hidden_size} must equal the target's hidden size {hidden} "
            "(the drafter shares the target's embedding and LM head); leave it unset"
        )
    heads = d.num_attention_heads or tc.num_attention_heads
    kv_heads = d.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ConfigError(
            f"drafter.num_key_value_heads={kv_heads} must divide drafter.num_attention_heads={heads}"
        )
    head_dim = d.head_dim or getattr(tc, "head_dim", None) or hidden // heads
    vocab = tc.vocab_size
    if d.mask_token_id is not None:
        mask = d.mask_token_id
    else:
        mask = default_mask_token_id(tokenizer if tokenizer is not None else _load_tokenizer(cfg), vocab)
    if not 0 <= mask < vocab:
        raise ConfigError(
            f"drafter.mask_token_id={mask} has no embedding row in the target (vocab_size {vocab}); "
            f"allowed: 0..{vocab - 1}"
        )
    return DrafterSpec(
        hidden_size=hidden,
        intermediate_size=d.intermediate_size or tc.intermediate_size,
        num_layers=d.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=d.rope_theta or _rope_theta(tc),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        block_size=d.block_size,
        mask_token_id=mask,
        target_layer_ids=list(layer_ids),
        num_target_layers=tc.num_hidden_layers,
        max_position_embeddings=getattr(tc, "max_position_embeddings", None) or 32768,
        rope_scaling=target_rope_scaling(tc),
    )
