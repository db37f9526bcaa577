"""Drafter files: the z-lab export that vLLM and SGLang load, and the two files a trainer checkpoint holds."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from dflash_stream.config import ConfigError
from dflash_stream.drafter.dflash2 import build_drafter
from dflash_stream.drafter.model import DFlashDrafter
from dflash_stream.drafter.spec import (
    ARCHITECTURES,
    CONFIG,
    DFLASH,
    DFLASH2,
    DFLASH2_FIELDS,
    WEIGHTS,
    DrafterSpec,
    spec_from_zlab_config,
)
from dflash_stream.log import get_logger

log = get_logger(__name__)

SPEC = "drafter_spec.json"
MODELING = "dflash.py"
"""The self-contained modeling file `auto_map` points at (a copy of drafter/hf_modeling.py)."""
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
OWN_EMBEDDING = "embed_tokens.weight"
"""The drafter's own copy of the target's embedding table, scaled as the target scales it (`export --embedding
own`): vLLM then embeds the drafter's inputs with it instead of the target's unscaled table; SGLang and z-lab's code
ignore it."""


def drafter_state(drafter: DFlashDrafter) -> dict[str, Tensor]:
    """The drafter's weights under the z-lab names (`layers.N...`, `fc`, `hidden_norm`, `norm`; DFlash2 adds
    `layers.N.attention_conv/mlp_conv.*` and `candidate_selector.*`, vLLM's names)."""
    return {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}


def _str_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def zlab_config(spec: DrafterSpec, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """`config.json` of a z-lab DFlash checkpoint: a Qwen3 config plus the DFlash fields; a DFlash2 drafter's as vLLM's
    qwen3_dflash2.py reads it (architectures DFlash2DraftModel, its fields in dflash_config), without `auto_map`:
    the transformers modeling file (`dflash.py`) is DFlash's."""
    dflash2 = spec.kind == DFLASH2
    return {
        "architectures": [ARCHITECTURES[spec.kind]],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        # Both spellings: transformers 4 and older servers read rope_scaling, transformers 5 rope_parameters.
        "rope_scaling": spec.rope_scaling,
        "rope_parameters": {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta},
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        **_layout_fields(spec),
        "dtype": _str_dtype(dtype),
        "block_size": spec.block_size,
        "num_target_layers": spec.num_target_layers,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids),
                          **_embedding_scale(spec), **_full_layer_window(spec),
                          **(_dflash2_fields(spec) if dflash2 else {})},
        **({} if dflash2 else {"auto_map": AUTO_MAP}),
    }


def _embedding_scale(spec: DrafterSpec) -> dict[str, float]:
    """The target's embedding scale under the name vLLM's DFlash2 reads (its DFlash model, SGLang and z-lab's code
    ignore it: they get the scale from the target's embedding module, or not at all; `docs/engines.md`)."""
    return {} if spec.embed_scale == 1.0 else {"input_embedding_scale": spec.embed_scale}


def _full_layer_window(spec: DrafterSpec) -> dict[str, Any]:
    """The full layers' window under the names vLLM's DFlash model reads (`use_swa` puts every layer on
    `swa_window_size`, `causal` keeps them non-causal), where the target's every layer slides
    (`DrafterSpec.full_layer_window`); SGLang and z-lab's code read `layer_types` and ignore these."""
    if spec.full_layer_window is None:
        return {}
    return {"use_swa": True, "swa_window_size": spec.full_layer_window, "causal": False}


def _dflash2_fields(spec: DrafterSpec) -> dict[str, Any]:
    """dflash_config's DFlash2 fields; the candidates' logits are the target's LM head's as training scored them
    (no output multiplier, no softcap)."""
    return {**{name: getattr(spec, name) for name in DFLASH2_FIELDS}, "input_embedding_scale": spec.embed_scale,
            "output_multiplier": 1.0, "final_logit_softcapping": None}


def _layout_fields(spec: DrafterSpec) -> dict[str, Any]:
    """The attention layout as z-lab's published Qwen3.6 drafter config writes it: transformers' Qwen3Config
    drops `sliding_window` unless `use_sliding_window` is true, and `max_window_layers` = all layers (z-lab's
    value) leaves the explicit `layer_types` as the only source of the layout. No `is_causal`: z-lab's default
    (sliding layers causal, full layers not) is what the drafter trains."""
    if spec.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None, "layer_types": list(spec.layer_types)}
    return {"use_sliding_window": True, "sliding_window": spec.sliding_window, "max_window_layers": spec.num_layers,
            "layer_types": list(spec.layer_types)}


def vllm_embedding_note(embed_scale: float, own_embedding: bool, kind: str = DFLASH) -> str | None:
    """One line when vLLM would feed a drafter other embeddings than it was trained with, else None: vLLM's DFlash
    model embeds through the target's table without the scale some families apply inside their embedding module
    (Gemma: √hidden), unless the export carries its own scaled table."""
    if embed_scale == 1.0 or own_embedding or kind == DFLASH2:  # vLLM's DFlash2 reads input_embedding_scale
        return None
    return (f"vLLM's DFlash model feeds this drafter the target's embedding rows unscaled, {embed_scale:.4g}x smaller "
            "than in training (the target scales them inside its embedding module): its tau there drops; SGLang and "
            "transformers feed them scaled; `dflash-stream export --embedding own` serves it right in vLLM "
            "(docs/engines.md)")


def export_drafter(drafter: DFlashDrafter, spec: DrafterSpec, out_dir: str | Path,
                   embedding: Tensor | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (no LM head; no embedding unless `embedding`, the target's table
    as the target scales it, is given) in the drafter's own dtype, and the modeling file `dflash.py` that
    `auto_map` names, so that transformers' `AutoModel` loads the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = drafter_state(drafter)
    dtype = next(iter(state.values())).dtype
    if embedding is not None:
        state[OWN_EMBEDDING] = embedding.detach().to(dtype).contiguous()
    elif note := vllm_embedding_note(spec.embed_scale, False, spec.kind):
        log.warning("export %s: %s", out, note)
    save_file(state, out / WEIGHTS, metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(zlab_config(spec, dtype), indent=2) + "\n")
    if spec.kind != DFLASH2:
        shutil.copyfile(Path(__file__).with_name("hf_modeling.py"), out / MODELING)
    return out


def _build(spec: DrafterSpec, weights: Path, device: torch.device | str | None) -> DFlashDrafter:
    state = load_file(weights, device=str(device or "cpu"))
    state.pop(OWN_EMBEDDING, None)  # for vLLM; the drafter embeds through the target's head
    drafter = build_drafter(spec).to(device=device, dtype=next(iter(state.values())).dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter


def load_init_weights(drafter: DFlashDrafter, folder: str | Path) -> None:
    """Copy the weights of a z-lab drafter folder (`drafter.init_from`) into `drafter`, every tensor exactly:
    the same names and shapes or a ConfigError naming the first difference."""
    path = Path(folder).expanduser() / WEIGHTS
    state = load_file(path, device=str(drafter.fc.weight.device))
    state.pop(OWN_EMBEDDING, None)
    ours = drafter.state_dict()
    missing, extra = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    if missing or extra:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"has extra tensors {', '.join(extra[:3])}"
        raise ConfigError(f"drafter.init_from: {path} {what}; it is not a {drafter.spec.kind} drafter of this "
                          "architecture")
    for name, t in state.items():
        if t.shape != ours[name].shape:
            raise ConfigError(f"drafter.init_from: {name} is {list(t.shape)} in {path}, "
                              f"this run {list(ours[name].shape)}")
    drafter.load_state_dict(state, strict=True)


def load_drafter(path: str | Path, device: torch.device | str | None = None) -> tuple[DFlashDrafter, DrafterSpec]:
    """Load an export written by `export_drafter` (or any z-lab DFlash checkpoint of this architecture)."""
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a drafter export: {name} is missing")
    spec = spec_from_zlab_config(json.loads((path / CONFIG).read_text()))
    return _build(spec, path / WEIGHTS, device), spec


def save_checkpoint_drafter(drafter: DFlashDrafter, spec: DrafterSpec, ckpt_dir: str | Path) -> None:
    """The drafter's part of a trainer checkpoint: `model.safetensors` + `drafter_spec.json`."""
    save_checkpoint_weights(drafter_state(drafter), spec, ckpt_dir)


def save_checkpoint_weights(weights: dict[str, Tensor], spec: DrafterSpec, ckpt_dir: str | Path) -> None:
    """`save_checkpoint_drafter` from a copy of the weights (a background checkpoint writes its host snapshot)."""
    ckpt = Path(ckpt_dir)
    save_file(weights, ckpt / WEIGHTS, metadata={"format": "pt"})
    (ckpt / SPEC).write_text(json.dumps(dataclasses.asdict(spec), indent=2) + "\n")


def load_checkpoint_drafter(
    ckpt_dir: str | Path, device: torch.device | str | None = None
) -> tuple[DFlashDrafter, DrafterSpec]:
    ckpt = Path(ckpt_dir)
    for name in (SPEC, WEIGHTS):
        if not (ckpt / name).is_file():
            raise FileNotFoundError(f"{ckpt} is not a trainer checkpoint: {name} is missing")
    spec = DrafterSpec(**json.loads((ckpt / SPEC).read_text()))
    return _build(spec, ckpt / WEIGHTS, device), spec
