"""The target's shape, read once from its transformers config: the one place every part asks.

Wrappers (VLMs such as Qwen3.5/3.6, Gemma 3) keep the language model's settings under `text_config`; hybrids
mix layer types (Gated-DeltaNet `linear_attention`, `sliding_attention`, `full_attention`); RoPE may differ per
layer type; MoE targets run a fraction of their parameters per token; Gemma scales its embeddings inside the
module. Plan, run, tune, the drafter spec, the memory model and eval all read these facts from here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.target_model.location import load_target_config, model_location

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
KV_LAYER_TYPES = (FULL, SLIDING, "chunked_attention")
"""Layer types whose cache grows with the sequence (the others keep a fixed-size recurrent state)."""

_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@dataclass(frozen=True)
class TargetShape:
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None
    intermediate_size: int | None
    source: str
    """Where these figures came from (named in plan's output)."""
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    """The width of one attention head as a drafter should copy it (MLA targets: the value head width)."""
    layer_types: tuple[str, ...] = ()
    """One entry per decoder layer."""
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    embed_scale: float = 1.0
    """What the target's embedding module multiplies its rows by (Gemma: sqrt(hidden)); the drafter must see the
    same inputs."""
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)
    """RoPE parameters per layer type (`rope_theta`, `rope_type`, scaling), as transformers 5 keeps them."""
    num_parameters: float | None = None
    """Parameters of the causal LM (vision towers of wrappers excluded: extraction never loads them)."""
    active_parameters: float | None = None
    """Parameters one token runs through (MoE: routed experts counted top-k of n); equals num_parameters for
    dense targets."""
    kv_elements_per_token: dict[str, int] = field(default_factory=dict)
    """Elements one token adds to the cache of one layer, per attention layer type (2 x KV heads x head_dim; MLA:
    the compressed latent). Gemma 4's full layers have heads of their own, wider and fewer than its sliding ones."""
    state_elements_per_sequence: int = 0
    """Fixed-size state of all linear-attention layers for one sequence (recurrent + convolution state)."""
    config: Any = None
    """The text config itself when one was read."""

    @property
    def layer_type_counts(self) -> dict[str, int]:
        return dict(Counter(self.layer_types or (FULL,) * self.num_layers))

    @property
    def kv_layers(self) -> int:
        """Layers that hold a KV cache growing with the sequence."""
        return sum(n for kind, n in self.layer_type_counts.items() if kind in KV_LAYER_TYPES)

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state or a window: speculative decoding must roll them back."""
        return any(kind != FULL for kind in self.layer_type_counts) or self.sliding_window is not None

    @property
    def slides_everywhere(self) -> bool:
        """Every layer is sliding-window: engines then treat the window as the model's (vLLM gives it to any layer
        that names none; SGLang's Llama-family models drop it)."""
        return set(self.layer_type_counts) == {SLIDING}

    def rope_for(self, layer_type: str = FULL) -> dict[str, Any]:
        return self.rope.get(layer_type) or self.rope.get(FULL) or next(iter(self.rope.values()), {})

    def summary(self) -> dict[str, Any]:
        """What plan's JSON says of the target."""
        return {
            "model_type": self.model_type, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size, "layer_types": self.layer_type_counts,
            "num_parameters": self.num_parameters, "active_parameters": self.active_parameters,
        }


MLP_PER_HIDDEN = 3
"""A drafter's MLP width over its hidden size where the target has no dense MLP to copy (MoE-only families such
as Qwen3.5/3.6-MoE give `moe_intermediate_size` and `shared_expert_intermediate_size`, no `intermediate_size`):
z-lab's drafter for Qwen3.5-35B-A3B (hidden 2048) has intermediate_size 6144."""


def default_intermediate_size(target: TargetShape) -> int:
    """A drafter's MLP width when drafter.intermediate_size is unset: the target's dense MLP width, else
    MLP_PER_HIDDEN x hidden."""
    return target.intermediate_size or MLP_PER_HIDDEN * target.hidden_size


def text_config_of(config: Any) -> Any:
    """The language model's settings: `text_config` of wrappers, the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_by_layer_type(tc: Any, types: set[str]) -> dict[str, dict[str, Any]]:
    params = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # transformers 5: one entry per layer type
        return {kind: dict(v) for kind, v in params.items()}
    params = dict(params)
    params.setdefault("rope_theta", getattr(tc, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return dict.fromkeys(types or {FULL}, params)


def _layer_types(tc: Any) -> tuple[str, ...]:
    types = getattr(tc, "layer_types", None)
    if types:
        return tuple(types)
    # Mistral-style configs give a window but no per-layer list: every layer slides.
    kind = SLIDING if getattr(tc, "sliding_window", None) and getattr(tc, "use_sliding_window", True) else FULL
    return (kind,) * tc.num_hidden_layers


def _layer_widths(tc: Any) -> tuple[int | None, int | None, int | None, int | None]:
    """(heads, KV heads, head width for a drafter, cache elements per token) of one layer's settings."""
    heads = getattr(tc, "num_attention_heads", None)
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    if getattr(tc, "kv_lora_rank", None):  # MLA (DeepSeek): `head_dim` aliases the narrow RoPE part
        return heads, kv_heads, tc.v_head_dim, tc.kv_lora_rank + tc.qk_rope_head_dim
    head_dim = getattr(tc, "head_dim", None) or (tc.hidden_size // heads if heads else None)
    return heads, kv_heads, head_dim, 2 * kv_heads * head_dim if kv_heads and head_dim else None


def _attention_widths(tc: Any, types: tuple[str, ...]) -> tuple[int | None, int | None, int | None, dict[str, int]]:
    """(heads, KV heads, head width for a drafter, cache elements per token by layer type). A heterogeneous
    config (transformers' `per_layer_config`: Gemma 4's full layers) refuses to give a per-layer width for the
    whole model, so each layer's is read; the drafter copies the first layer's."""
    per_layer = getattr(tc, "per_layer_config", None)
    widths = [_layer_widths(per_layer[i] if per_layer is not None else tc) for i in range(len(types))]
    kv_elements: dict[str, int] = {}
    for kind, (*_, elements) in zip(types, widths, strict=True):
        if kind in KV_LAYER_TYPES and elements:
            kv_elements[kind] = max(elements, kv_elements.get(kind, 0))
    return *widths[0][:3], kv_elements


def _linear_state_elements(tc: Any, layers: int) -> int:
    """Gated-DeltaNet: a value-heads x key-dim x value-dim recurrent state plus a causal-conv window, per layer."""
    if not layers or not getattr(tc, "linear_num_value_heads", None):
        return 0
    k_dim, v_dim = tc.linear_key_head_dim, tc.linear_value_head_dim
    recurrent = tc.linear_num_value_heads * k_dim * v_dim
    conv = (2 * tc.linear_num_key_heads * k_dim + tc.linear_num_value_heads * v_dim) * (tc.linear_conv_kernel_dim - 1)
    return layers * (recurrent + conv)


_PARAMETER_COUNTS: dict[str, tuple[int, int]] = {}


def count_parameters(config: Any) -> tuple[int, int]:
    """(total, active) parameters of the causal LM this config builds, counted on the meta device (no memory).

    Routed experts count `num_experts_per_tok / num_experts` towards the active figure; shared experts fully.
    Remembered per config for the process: building a 27B model, even on meta, takes seconds, and plan, tune
    and run each ask for the same target."""
    key = config.to_json_string(use_diff=False)
    if key not in _PARAMETER_COUNTS:
        _PARAMETER_COUNTS[key] = _count_parameters(config)
    return _PARAMETER_COUNTS[key]


def _count_parameters(config: Any) -> tuple[int, int]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tc = text_config_of(config)
    experts = next((getattr(tc, k) for k in _EXPERT_COUNT_KEYS if getattr(tc, k, None)), None)
    top_k = getattr(tc, "num_experts_per_tok", None)
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name and "shared_expert" not in name:
            routed += p.numel()
    active = total - routed + (routed * top_k // experts if experts and top_k else routed)
    return total, active


def shape_from_config(config: Any, source: str, num_parameters: float | None = None,
                      count: bool = True) -> TargetShape:
    """The shape of a transformers config (a wrapper's text part). `count` builds the model on the meta device
    for its parameter counts (a second or two for a 27B target); `num_parameters` overrides the total."""
    tc = text_config_of(config)
    types = _layer_types(tc)
    heads, kv_heads, head_dim, kv_elements = _attention_widths(tc, types)
    total = active = None
    if count:
        total, active = count_parameters(config)
    if num_parameters:
        active = num_parameters * active / total if total else num_parameters
        total = num_parameters
    windowed = SLIDING in types
    return TargetShape(
        model_type=getattr(config, "model_type", None) or tc.model_type,
        num_layers=tc.num_hidden_layers,
        hidden_size=tc.hidden_size,
        vocab_size=getattr(tc, "vocab_size", None),
        intermediate_size=getattr(tc, "intermediate_size", None),
        source=source,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_types=types,
        sliding_window=getattr(tc, "sliding_window", None) if windowed else None,
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))),
        embed_scale=_embed_scale(tc),
        rope=_rope_by_layer_type(tc, set(types)),
        num_parameters=total,
        active_parameters=active,
        kv_elements_per_token=kv_elements,
        state_elements_per_sequence=_linear_state_elements(tc, types.count(LINEAR)),
        config=tc,
    )


def _embed_scale(tc: Any) -> float:
    """Gemma-family models multiply embeddings by sqrt(hidden) inside the embedding module (and in the module's
    own dtype, which rounds it: bf16 makes sqrt(5376) = 73.3 into 73.5)."""
    return float(tc.hidden_size ** 0.5) if tc.model_type.startswith(("gemma", "recurrent_gemma")) else 1.0


def _config_takes(default_text: Any, built_text: Any, key: str) -> bool:
    """Whether the family's config knows `key`: one of its own, or one it consumes into others (Gemma 4's
    `global_head_dim` becomes its per-layer config); a config keeps any other key as a stray attribute."""
    return key in default_text.to_dict() or key not in built_text.to_dict()


def _shape_from_hints(t: TargetConfig) -> TargetShape:
    """`target.*` hints for plan without the model: a transformers config of `target.model_type` built from
    them (its layer pattern, heads and state sizes follow the family's rules), or the bare widths."""
    hints = {"num_hidden_layers": t.num_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
             "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
             "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
             "linear_num_value_heads": t.linear_num_value_heads}
    hints = {k: v for k, v in hints.items() if v is not None}
    if t.config_hints and not t.model_type:
        raise ConfigError("target.config_hints: needs target.model_type (the family whose config takes them)")
    if t.model_type:
        from transformers import AutoConfig

        try:
            family = AutoConfig.for_model(t.model_type)
        except ValueError as err:
            raise ConfigError(f"target.model_type: {err}".splitlines()[0]) from None
        twice = sorted(k for k in hints.keys() & t.config_hints.keys() if hints[k] != t.config_hints[k])
        if twice:
            raise ConfigError(f"target.config_hints: {', '.join(twice)} set otherwise by a target.* hint; give "
                              "each once")
        text = family.get_text_config()
        wrapped = text is not family  # a VLM: the hints are its text_config
        hints = {**t.config_hints, **hints}
        try:
            config = AutoConfig.for_model(t.model_type, **({"text_config": hints} if wrapped else hints))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"target.* hints of model_type {t.model_type}: {err}".splitlines()[0]) from None
        unknown = sorted(k for k in t.config_hints if not _config_takes(text, config.get_text_config(), k))
        if unknown:
            raise ConfigError(f"target.config_hints: {', '.join(unknown)} not a key of transformers' "
                              f"{type(text).__name__} (target.model_type {t.model_type})")
        return shape_from_config(config, f"config hints (target.model_type {t.model_type}, target.num_layers, "
                                 "target.hidden_size, ...)", t.num_parameters)
    return TargetShape(
        model_type="unknown", num_layers=t.num_layers, hidden_size=t.hidden_size, vocab_size=t.vocab_size,
        intermediate_size=t.intermediate_size, source="config (target.num_layers, target.hidden_size)",
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        layer_types=(FULL,) * t.num_layers, num_parameters=t.num_parameters, active_parameters=t.num_parameters,
    )


def target_shape(target: TargetConfig, *, download: bool = False, hints: bool = True,
                 count: bool = True) -> TargetShape:
    """The shape from the model's config when it is a local folder; else from the `target.*` hints (plan without
    the model at hand) unless `hints` is off; else, with `download` (a run that loads the model anyway), from
    the config on the hub. A run passes hints=False: its store must be laid out by the model itself."""
    location, _ = model_location(target)
    if not Path(location).exists():
        if hints and target.num_layers and target.hidden_size:
            return _shape_from_hints(target)
        if not download:
            raise ConfigError(
                f"target.model '{target.model}' is not a local folder: set target.model_type, target.num_layers "
                "and target.hidden_size so that plan needs no download"
            )
    config = load_target_config(target)
    what = f"GGUF header of {target.gguf_file}" if target.gguf_file else str(Path(location) / "config.json")
    return shape_from_config(config, what, target.num_parameters, count=count)


def model_shape(model: Any) -> TargetShape:
    """The shape of an already loaded transformers model."""
    return shape_from_config(model.config, "the loaded model", count=False)
