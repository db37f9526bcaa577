"""The target model: where it lives, which layers are read, and (extraction) how they are captured."""

from dflash_stream.target.layers import dflash_layer_ids, resolve_layer_ids
from dflash_stream.target.loading import load_target_config, model_location

__all__ = ["dflash_layer_ids", "load_target_config", "model_location", "resolve_layer_ids"]
