"""The drafter's shape: everything needed to rebuild it and to write its `config.json`, from the run's config or from
a z-lab drafter's `config.json` (`spec_from_zlab_config`, what `drafter.init_from` and `load_drafter` read)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_stream.config import Config, ConfigError
from dflash_stream.log import get_logger
from dflash_stream.target_model.loading import load_tokenizer
from dflash_stream.target_model.shape import (
    FULL,
    MLP_PER_HIDDEN,
    SLIDING,
    TargetShape,
    default_intermediate_size,
)

log = get_logger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
"""The two files of a z-lab drafter folder: what `export.export_drafter` writes and `drafter.init_from` reads."""

DFLASH, DFLASH2 = "dflash", "dflash2"
KINDS = (DFLASH, DFLASH2)
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}
"""config.json's `architectures` of each kind: what vLLM picks its model (qwen3_dflash, qwen3_dflash2) by."""
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The spec fields of a dflash2 drafter, kept in config.json's dflash_config under these names (vLLM's); its
`input_embedding_scale` is `embed_scale`, which every kind records."""

LAYER_TYPES = (FULL, SLIDING)
"""Drafter layer types. Sliding layers follow z-lab's dflash (model.py, `_attention_mask`): a block token at
absolute position p sees the keys at positions p - sliding_window + 1 .. p, so its window ends at itself and it is
causal inside its block; full-attention layers see all the context before the anchor and the whole block."""


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
    layer_types: list[str] | None = None
    """One of LAYER_TYPES per drafter layer; None (spec files written before layer types) means all full."""
    sliding_window: int | None = None
    """Keys a sliding layer's query sees, itself included; None without sliding layers."""
    full_layer_window: int | None = None
    """A window past every position (`reach`) that the export names for the full-attention layers
    when every layer of the target slides: vLLM gives a drafter layer that names no window the target's, which
    would cut those layers' context to it (`vllm_names_full_windows`). None elsewhere."""
    embed_scale: float = 1.0
    """The scale the target applies inside its embedding module (Gemma: √hidden), which the drafter's inputs were
    trained with: an engine that embeds without it serves the drafter wrongly (`docs/engines.md`); vLLM's DFlash2
    reads it as `input_embedding_scale`."""
    kind: str = DFLASH
    """dflash, or dflash2 (drafter/dflash2.py: the fields below); spec files written before it are dflash."""
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_layers
        check_layout(self.layer_types, self.sliding_window, self.num_layers)
        if self.kind not in KINDS:
            raise ConfigError(f"drafter.kind: unknown {self.kind}; allowed: {', '.join(KINDS)}")
        if self.kind == DFLASH2:
            if self.hidden_size % self.conv_group_size:
                raise ConfigError(f"drafter.conv_group_size={self.conv_group_size} must divide the hidden size "
                                  f"{self.hidden_size}")
            if self.conv_kernel_size > self.block_size:
                raise ConfigError(f"drafter.conv_kernel_size={self.conv_kernel_size} exceeds drafter.block_size="
                                  f"{self.block_size}")
            if self.selector_top_k > self.vocab_size:
                raise ConfigError(f"drafter.selector_top_k={self.selector_top_k} exceeds the vocabulary "
                                  f"({self.vocab_size})")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer: its sliding window, or None for a full-attention layer."""
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]


def check_layout(layer_types: list[str], sliding_window: int | None, num_layers: int) -> None:
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"drafter.layer_types has {len(layer_types)} entries, drafter.num_layers is {num_layers}: "
            "give one per layer"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"drafter.layer_types: unknown {', '.join(unknown)}; allowed: {', '.join(LAYER_TYPES)}")
    if SLIDING in layer_types and (sliding_window is None or sliding_window < 1):
        raise ConfigError(
            f"drafter.sliding_window is required (a positive number of tokens) when a layer is {SLIDING}; "
            f"got {sliding_window}"
        )


SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")
"""Scalings whose frequencies depend on the config alone; `dynamic`/`longrope` change with the sequence length."""


def target_rope(shape: TargetShape, layer_type: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) of the target's layers of `layer_type` as the drafter must reproduce them (z-lab's
    loader builds the drafter's rotary embedding from its config the same way); scaling None for plain RoPE."""
    params = shape.rope_for(layer_type)
    theta = float(params.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "proportional":
        # Gemma 4's full layers rotate only the first part of each head at default frequencies (divided by
        # `factor`); a drafter rotating whole heads takes those frequencies, as z-lab's Gemma 4 31B drafter does
        # (rope_theta 1e6, plain RoPE).
        factor = float(params.get("factor", 1.0))
        return theta, None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    if rope_type == "default":
        return theta, None
    if rope_type not in SCALED_ROPE_TYPES:
        raise ConfigError(
            f"target rope_scaling type '{rope_type}' is not supported by the drafter; "
            f"supported: default, {', '.join(SCALED_ROPE_TYPES)}"
        )
    # rope_theta has its own spec field; the drafter's attention rotates whole heads (no partial rotary).
    drop = ("rope_theta", "type", "rope_type", "partial_rotary_factor")
    return theta, {"rope_type": rope_type, **{k: v for k, v in params.items() if k not in drop}}


def vllm_names_full_windows(tc: TargetShape, layer_types: list[str]) -> bool:
    """Whether the export must name its full layers' window for vLLM: where every target layer slides, vLLM sets
    the target's window as the default of every attention layer (`CacheConfig.sliding_window`) and its DFlash model
    leaves a full layer's unset, so they would attend to the target's last window only (a tiny Mistral of window
    16: τ -10.9 %, docs/engines.md). A drafter that mixes both kinds cannot be helped so: vLLM then reads its
    layer_types alone."""
    return tc.slides_everywhere and SLIDING not in layer_types


def reach(positions: int, rope_scaling: dict[str, Any] | None) -> int:
    """The longest sequence a server may run the drafter on: its positions, times a RoPE scaling's factor."""
    return positions * math.ceil(float((rope_scaling or {}).get("factor", 1.0)))


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


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _layout(config: dict[str, Any]) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of a z-lab config, read as transformers' Qwen3Config reads them."""
    n = config["num_hidden_layers"]
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    types = config.get("layer_types") or [
        SLIDING if window is not None and i >= config.get("max_window_layers", 28) else FULL for i in range(n)
    ]
    _check_causality(types, config.get("is_causal"), "is_causal")
    _check_causality(types, config.get("dflash_config", {}).get("causal"), "dflash_config.causal")
    return list(types), window if SLIDING in types else None


def _check_causality(types: list[str], causal: Any, key: str) -> None:
    # z-lab's dflash: causality unset makes sliding layers causal and full layers not; set, it forces all.
    if causal is not None and any((t == SLIDING) != bool(causal) for t in types):
        raise ConfigError(
            f"a DFlash config with {key}={causal} and layer_types {types} is not supported: dflash-stream's "
            "drafter has causal sliding layers and non-causal full layers (z-lab's default, is_causal unset)"
        )


def _full_layer_window(config: dict[str, Any], types: list[str]) -> int | None:
    """The window an export names for its full layers (`DrafterSpec.full_layer_window`); a window that cuts
    their context (dflash_config.use_swa, as MiMo's drafters use it) is refused."""
    dflash = config["dflash_config"]
    if not dflash.get("use_swa"):
        return None
    window = dflash.get("swa_window_size", config.get("sliding_window"))
    if SLIDING in types or window is None or window < config["max_position_embeddings"]:
        raise ConfigError(
            f"a DFlash config with dflash_config.use_swa and a window of {window} (layer_types {types}) is not "
            "supported: dflash-stream's full-attention layers see the whole context"
        )
    return int(window)


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """rope_scaling of a z-lab config, or the scaled part of its rope_parameters (transformers 5 writes those)."""
    if config.get("rope_scaling"):
        return dict(config["rope_scaling"])
    params = dict(config.get("rope_parameters") or {})
    if params.get("rope_type", "default") == "default":
        return None
    params.pop("rope_theta", None)
    return params


def _kind(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or [ARCHITECTURES[DFLASH]]
    for kind, name in ARCHITECTURES.items():
        if name in architectures:
            return kind
    raise ConfigError(f"architectures {architectures}: not a drafter dflash-stream builds; allowed: "
                      f"{', '.join(ARCHITECTURES.values())}")


def spec_from_zlab_config(config: dict[str, Any]) -> DrafterSpec:
    dflash = config["dflash_config"]
    layer_types, window = _layout(config)
    kind = _kind(config)
    dflash2 = {name: dflash[name] for name in DFLASH2_FIELDS if name in dflash} if kind == DFLASH2 else {}
    return DrafterSpec(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rope_theta=config.get("rope_theta") or config["rope_parameters"]["rope_theta"],
        rms_norm_eps=config["rms_norm_eps"],
        vocab_size=config["vocab_size"],
        block_size=config["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=list(dflash["target_layer_ids"]),
        num_target_layers=config["num_target_layers"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_scaling=_rope_scaling(config),
        layer_types=layer_types,
        sliding_window=window,
        full_layer_window=_full_layer_window(config, layer_types),
        embed_scale=float(dflash.get("input_embedding_scale", 1.0)),
        kind=kind,
        **dflash2,
    )


def read_init_from(path: str) -> tuple[Path, DrafterSpec]:
    """(its config.json, its spec) of the z-lab drafter folder that `drafter.init_from` names."""
    folder = Path(path).expanduser()
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise ConfigError(
                f"drafter.init_from: {folder / name} not found; expected a z-lab drafter folder "
                f"({CONFIG} + {WEIGHTS}) such as `dflash-stream export` writes"
            )
    config_path = folder / CONFIG
    try:
        return config_path, spec_from_zlab_config(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ConfigError) as err:
        raise ConfigError(f"drafter.init_from: {config_path} is not a DFlash drafter config: {err!r}") from None


def build_spec(cfg: Config, tc: TargetShape, layer_ids: list[int], tokenizer: Any = None) -> DrafterSpec:
    """Widths, heads and MLP default from the target; depth, block size and mask token from `cfg.drafter`.

    With `drafter.init_from` the architecture (heads, MLP, layer types, window, mask token, RoPE) defaults to that
    drafter's instead, so that pointing at a published drafter is enough; what its weights cannot serve (another
    vocabulary, width, block size, target layers, depth or layout) is refused with both values named.
    """
    d = cfg.drafter
    init_path, init = read_init_from(d.init_from) if d.init_from else (None, None)

    def from_init(name: str) -> Any:
        return getattr(init, name) if init is not None else None

    hidden = tc.hidden_size
    # The drafter reads the target's embeddings and feeds the target's LM head, so its width is the target's.
    if d.hidden_size is not None and d.hidden_size != hidden:
        raise ConfigError(
            f"drafter.hidden_size={d.hidden_size} must equal the target's hidden size {hidden} "
            "(the drafter shares the target's embedding and LM head); leave it unset"
        )
    heads = _first(d.num_attention_heads, from_init("num_attention_heads"), tc.num_attention_heads)
    kv_heads = _first(d.num_key_value_heads, from_init("num_key_value_heads"), tc.num_key_value_heads) or heads
    if heads % kv_heads:
        raise ConfigError(
            f"drafter.num_key_value_heads={kv_heads} must divide drafter.num_attention_heads={heads}"
        )
    head_dim = _first(d.head_dim, from_init("head_dim"), tc.head_dim) or hidden // heads
    intermediate = _first(d.intermediate_size, from_init("intermediate_size"), default_intermediate_size(tc))
    if intermediate != tc.intermediate_size and d.intermediate_size is None and init is None:
        log.info("drafter MLP width %d (%d x hidden): the target has no dense MLP to copy (a MoE-only family); "
                 "set drafter.intermediate_size to choose another", intermediate, MLP_PER_HIDDEN)
    layer_types = list(_first(d.layer_types, from_init("layer_types")) or [FULL] * d.num_layers)
    window = _first(d.sliding_window, from_init("sliding_window")) if SLIDING in layer_types else None
    vocab = tc.vocab_size
    # dflash2's keys have defaults (speculators'); a DFlash2 drafter to continue brings its own unless set.
    dflash2 = {}
    if d.kind == DFLASH2:
        defaults = type(d).model_fields
        dflash2 = {name: getattr(d, name) if init is None or getattr(d, name) != defaults[name].default
                   else getattr(init, name) for name in DFLASH2_FIELDS}
    if init is not None:
        run = {
            "vocab_size": vocab, "hidden_size": hidden, "block_size": d.block_size,
            "target_layer_ids": list(layer_ids), "num_hidden_layers": d.num_layers, "layer_types": layer_types,
            "sliding_window": window, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": intermediate, "kind": d.kind, **dflash2,
        }
        for key, ours in run.items():
            theirs = getattr(init, "num_layers" if key == "num_hidden_layers" else key)
            if theirs != ours:
                raise ConfigError(f"drafter.init_from: {key} {theirs} in {init_path}, this run {ours}")
    mask = _first(d.mask_token_id, from_init("mask_token_id"))
    if mask is None:
        mask = default_mask_token_id(tokenizer if tokenizer is not None else load_tokenizer(cfg.target), vocab)
    if not 0 <= mask < vocab:
        raise ConfigError(
            f"drafter.mask_token_id={mask} has no embedding row in the target (vocab_size {vocab}); "
            f"allowed: 0..{vocab - 1}"
        )
    # A drafter to continue keeps the RoPE it was trained with; a new one copies the target's.
    theta, scaling = (init.rope_theta, init.rope_scaling) if init is not None else target_rope(tc)
    positions = _first(from_init("max_position_embeddings"), getattr(tc.config, "max_position_embeddings", None),
                       32768)
    return DrafterSpec(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=d.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=d.rope_theta or theta,
        rms_norm_eps=_first(from_init("rms_norm_eps"), float(getattr(tc.config, "rms_norm_eps", None) or 1e-6)),
        vocab_size=vocab,
        block_size=d.block_size,
        mask_token_id=mask,
        target_layer_ids=list(layer_ids),
        num_target_layers=tc.num_layers,
        max_position_embeddings=positions,
        rope_scaling=scaling,
        layer_types=layer_types,
        sliding_window=window,
        full_layer_window=reach(positions, scaling) if vllm_names_full_windows(tc, layer_types) else None,
        embed_scale=tc.embed_scale,
        kind=d.kind,
        **dflash2,
    )
