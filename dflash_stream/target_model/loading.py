"""Loading the target: device, dtype, tokenizer, weights, stop tokens, and the check for the kernels a hybrid
needs on CUDA (torch is imported only when needed). Where the target lives is `location.py`."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.log import get_logger
from dflash_stream.target_model.gguf_cache import converted, save_converted
from dflash_stream.target_model.location import gguf_source, load_target_config, model_location
from dflash_stream.target_model.shape import LINEAR, TargetShape, model_shape

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GDN_KERNEL_MODULES = ("fla", "causal_conv1d")
"""What transformers imports for fast Gated-DeltaNet layers on CUDA (flash-linear-attention's chunked delta rule,
Dao-AILab's causal conv1d); without them it runs a torch reference path."""
GPU_EXTRA_INSTALL = "pip install 'dflash-stream[gpu]'"
TORCH_GDN_SLOWDOWN = 1.22 / 0.70
"""transformers #48718: a Qwen3.5 step took 1.22 s on the torch path against 0.70 s with the kernels."""


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


def missing_gdn_kernels(device_type: str, shape: TargetShape, importable: Callable[[str], bool]) -> list[str]:
    """The Gated-DeltaNet kernel modules a CUDA run of this target would miss (`importable(module)` says whether
    one imports); empty off CUDA (the kernels are CUDA-only) and for targets without linear-attention layers."""
    if device_type != "cuda" or LINEAR not in shape.layer_type_counts:
        return []
    return [m for m in GDN_KERNEL_MODULES if not importable(m)]


def _importable(module: str) -> bool:
    """Whether `module` imports: transformers' own test (an installed fla without triton falls back too)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def warn_slow_gdn(model: PreTrainedModel, device: torch.device) -> None:
    """One warning line when a hybrid target runs on CUDA without the kernels that make its linear layers fast."""
    missing = missing_gdn_kernels(device.type, model_shape(model), _importable)
    if missing:
        get_logger("target").warning(
            "%s not importable: transformers runs this target's Gated-DeltaNet layers on its torch path, "
            "~%.1fx slower (transformers #48718); %s", " and ".join(missing), TORCH_GDN_SLOWDOWN, GPU_EXTRA_INSTALL)


def load_tokenizer(target: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone (with a pad token: padding positions are masked out, so eos will do)."""
    from transformers import AutoTokenizer

    location, kwargs = model_location(target)
    if (source := gguf_source(target)) is not None and (folder := converted(source)) is not None:
        location, kwargs = str(folder), {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as err:
        raise ConfigError(f"target.model: cannot load the tokenizer of '{target.model}': "
                          f"{str(err).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(target: TargetConfig, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) of the target, in eval mode on `device`, frozen."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(target)
    location, kwargs = model_location(target)
    dtype = resolve_dtype(target, device)
    source = gguf_source(target)
    folder = converted(source, dtype) if source is not None else None
    if folder is not None:
        location, kwargs = str(folder), {}
    # The config this process already read (a run's ranks read it for the store's layout): a GGUF target's
    # header is otherwise parsed again for it, ~5 s of the demo's load.
    config = load_target_config(target)
    try:
        model = AutoModelForCausalLM.from_pretrained(location, config=config, dtype=dtype, **kwargs)
    except OSError as err:
        raise ConfigError(f"target.model: cannot load '{target.model}': {str(err).splitlines()[0]}") from None
    if source is not None and folder is None:
        save_converted(source, model, tokenizer)
    model.to(device).eval().requires_grad_(False)
    warn_slow_gdn(model, device)
    return model, tokenizer


def gguf_conversion(target: TargetConfig, model: PreTrainedModel | None = None,
                    tokenizer: PreTrainedTokenizerBase | None = None, required: bool = False) -> Path | None:
    """A GGUF target's conversion (`gguf_cache`) in the dtype a CPU load gives, made now where there is none: from
    `model` and `tokenizer` (the target loaded on the CPU), else by loading it. None for a target that is not GGUF,
    or when no conversion can be made (ConfigError instead when `required`)."""
    import torch

    source = gguf_source(target)
    if source is None:
        return None
    cpu = torch.device("cpu")
    if (folder := converted(source, resolve_dtype(target, cpu))) is not None:
        return folder
    if model is None:
        model, tokenizer = load_target(target, cpu)  # converts it, where it can
    return converted(source, model.dtype) or save_converted(source, model, tokenizer, required)


def target_stop_ids(target: TargetConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """`stop_token_ids` without the weights: the generation config file beside the target, else the
    tokenizer's end of sequence (a GGUF target carries no generation config)."""
    from transformers import GenerationConfig

    location, kwargs = model_location(target)
    kwargs.pop("gguf_file", None)
    try:
        config = GenerationConfig.from_pretrained(location, **kwargs)
    except (OSError, ValueError):
        config = GenerationConfig()
    return _stop_ids(config.eos_token_id, tokenizer)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Tokens that end a generated response: the generation config's end-of-sequence ids and the tokenizer's."""
    return _stop_ids(model.generation_config.eos_token_id, tokenizer)


def _stop_ids(eos: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
