"""Which target layers the drafter reads (the DFlash rule)."""

from __future__ import annotations

from dflash_stream.config import ConfigError, TargetConfig


def dflash_layer_ids(num_layers: int, count: int) -> list[int]:
    """Layer id i is the output of decoder layer i (= transformers' hidden_states[i + 1])."""
    if count == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [round(start + i * (end - start) / (count - 1)) for i in range(count)]


def resolve_layer_ids(num_layers: int, target: TargetConfig) -> list[int]:
    """The explicit `target.layer_ids`, or the DFlash rule over `target.num_capture_layers`, checked against depth."""
    ids = list(target.layer_ids) if target.layer_ids is not None else dflash_layer_ids(num_layers, target.num_capture_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"target.layer_ids {bad} out of range: the target has {num_layers} decoder layers (allowed 0..{num_layers - 1})"
        )
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        raise ConfigError(f"target.layer_ids must be strictly increasing, got {ids}")
    return ids
