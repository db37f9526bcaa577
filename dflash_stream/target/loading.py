"""Where the target lives and what shape it has, without loading its weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from dflash_stream.config import ConfigError, TargetConfig


def model_location(target: TargetConfig) -> tuple[str, dict[str, Any]]:
    """(path or hub id, extra `from_pretrained` kwargs) for the target named in the config."""
    location = target.model
    if location.startswith("package:"):
        package = location.removeprefix("package:")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"target.model: package '{package}' is not installed (pip install it first)")
        location = spec.submodule_search_locations[0]
    kwargs: dict[str, Any] = {"trust_remote_code": target.trust_remote_code}
    if target.gguf_file:
        if not (Path(location) / target.gguf_file).is_file():
            raise ConfigError(f"target.gguf_file: {target.gguf_file} not found in {location}")
        kwargs["gguf_file"] = target.gguf_file
    if target.revision:
        kwargs["revision"] = target.revision
    return location, kwargs


def load_target_config(target: TargetConfig):
    """The target's transformers config (reads config.json or the GGUF header, not the weights)."""
    from transformers import AutoConfig

    location, kwargs = model_location(target)
    try:
        return AutoConfig.from_pretrained(location, **kwargs)
    except OSError as err:
        raise ConfigError(f"target.model: cannot read a model config from '{target.model}': {err}") from None
