"""The target model: where it lives, which layers are read, and how they are captured (hooks + early stop)."""

from dflash_stream.target_model.layers import (
    dflash_layer_ids,
    resolve_layer_ids,
    stored_layer_ids,
    verifier_layer_id,
)
from dflash_stream.target_model.loading import load_target, resolve_device, resolve_dtype, stop_token_ids
from dflash_stream.target_model.location import load_target_config, model_location
from dflash_stream.target_model.shape import TargetShape, model_shape, shape_from_config, target_shape

__all__ = [
    "dflash_layer_ids", "load_target", "load_target_config", "model_location", "resolve_device",
    "resolve_dtype", "resolve_layer_ids", "stop_token_ids", "stored_layer_ids", "TargetShape", "model_shape",
    "shape_from_config", "target_shape", "verifier_layer_id",
]
