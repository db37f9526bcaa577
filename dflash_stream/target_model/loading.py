"""Where the target lives, what shape it has, and loading it (torch is imported only when needed)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.preflight import looks_local

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


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


def load_target_config(target: TargetConfig):
    """The target's transformers config (reads config.json or the GGUF header, not the weights)."""
    from transformers import AutoConfig

    location, kwargs = model_location(target)
    try:
        return AutoConfig.from_pretrained(location, **kwargs)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"target.model: cannot read a model config from '{target.model}': {first}") from None


def resolve_device(target: TargetConfig) -> torch.device:
    """`target.device`, with auto = this process's GPU under a launcher (LOCAL_RANK), else MPS, else CPU."""
    import torch

    if target.device != "auto":
        return torch.device(target.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_dtype(target: TargetConfig, device: torch.device) -> torch.dtype:
    """auto = bf16 on accelerators; float32 on CPU, where bf16 matmuls are slow without AMX."""
    import torch

    if target.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, target.dtype)


def load_target(target: TargetConfig, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of the target, in eval mode on `device`, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, kwargs = model_location(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=resolve_dtype(target, device), **kwargs)
    except OSError as err:
        raise ConfigError(f"target.model: cannot load '{target.model}': {str(err).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out; any id will do, and eos always exists.
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def text_config(model: PreTrainedModel) -> PretrainedConfig:
    """The language model's config (multimodal targets nest it)."""
    return model.config.get_text_config()


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Tokens that end a generated response: the generation config's end-of-sequence ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
