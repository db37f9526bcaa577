"""Where the target lives: a local folder, an installed package's folder, or a hub id, and its transformers config.

Below `loading.py` (the weights) and `shape.py` (the figures read from this config), which both ask here.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.preflight import looks_local
from dflash_stream.target_model.gguf_cache import converted


def model_location(target: TargetConfig) -> tuple[str, dict[str, Any]]:
    """(path or hub id, extra `from_pretrained` kwargs) for the target named in the config."""
    location = target.model
    if location.startswith("package:"):
        package = location.removeprefix("package:")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"target.model: package '{package}' is not installed (pip install it first)")
        location = spec.submodule_search_locations[0]
    elif not Path(location).expanduser().exists() and looks_local(location):
        # Said here, or transformers takes the path for a hub repo id and complains about its spelling.
        raise ConfigError(f"target.model: local folder '{location}' does not exist")
    kwargs: dict[str, Any] = {"trust_remote_code": target.trust_remote_code}
    if target.gguf_file:
        if not (Path(location) / target.gguf_file).is_file():
            raise ConfigError(f"target.gguf_file: {target.gguf_file} not found in {location}")
        kwargs["gguf_file"] = target.gguf_file
    if target.revision:
        kwargs["revision"] = target.revision
    return location, kwargs


def gguf_source(target: TargetConfig) -> Path | None:
    """The target's GGUF file (resolved), or None for a folder of safetensors."""
    if not target.gguf_file:
        return None
    location, kwargs = model_location(target)
    return (Path(location) / kwargs["gguf_file"]).resolve()


_GGUF_CONFIGS: dict[tuple, Any] = {}


def load_target_config(target: TargetConfig):
    """The target's transformers config (reads config.json or the GGUF header, not the weights). A GGUF file's
    header is parsed whole (its vocabulary too: ~5 s for the demo's), so its config is read from the file's
    conversion where there is one (`gguf_cache`), and kept for the process while the file is unchanged; callers
    get their own copy."""
    from transformers import AutoConfig

    location, kwargs = model_location(target)
    key = None
    if (source := gguf_source(target)) is not None:
        stat = source.stat()
        key = (str(source), tuple(sorted(kwargs.items())), stat.st_size, stat.st_mtime_ns)
        if key in _GGUF_CONFIGS:
            return copy.deepcopy(_GGUF_CONFIGS[key])
        if (folder := converted(source)) is not None:
            location, kwargs = str(folder), {}
    try:
        config = AutoConfig.from_pretrained(location, **kwargs)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"target.model: cannot read a model config from '{target.model}': {first}") from None
    if key is not None:
        _GGUF_CONFIGS[key] = copy.deepcopy(config)
    return config
