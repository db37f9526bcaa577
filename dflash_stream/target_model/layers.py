"""Which target layers the drafter reads (the DFlash rule), and which ones the store holds (those, and the
verifier's last layer when the run learns from the target's distribution)."""

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


def verifier_layer_id(num_layers: int) -> int:
    """The verifier's state: the output of the last decoder layer, before the final norm (vLLM's aux layer id
    num_layers; applying the target's final norm and LM head to it gives the target's logits)."""
    return num_layers - 1


def stored_layer_ids(num_layers: int, target: TargetConfig, verifier: bool) -> list[int]:
    """The layers an extraction engine captures and the store holds, side by side per token in this order: the
    drafter's (`resolve_layer_ids`), then, with `verifier`, the last decoder layer (`verifier_layer_id`), even if
    the drafter reads it too. An engine captures these ids and nothing else."""
    ids = resolve_layer_ids(num_layers, target)
    return [*ids, verifier_layer_id(num_layers)] if verifier else ids
