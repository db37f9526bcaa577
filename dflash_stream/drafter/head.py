"""The target's embedding and LM head, frozen, read straight from its weight files (never the whole target); and,
for training on the verifier's distribution, its final norm beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.target_model.gguf_cache import converted
from dflash_stream.target_model.location import gguf_source, model_location
from dflash_stream.target_model.shape import model_shape, target_shape, text_config_of


class TargetHead(nn.Module):
    """Frozen `embed` (token ids -> target embeddings) and `logits` (hidden -> vocabulary), shared when tied; with a
    `final_norm`, also `verifier_normed`: the target's final norm of its last layer's output, whose `logits` are
    the target's own (after its `logit_softcap`, Gemma 2's final_logit_softcapping, when it has one)."""

    def __init__(self, embed_weight: Tensor, lm_head_weight: Tensor | None = None, embed_scale: float = 1.0,
                 final_norm: nn.Module | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.embed_scale = embed_scale
        self.embed_weight = nn.Parameter(embed_weight, requires_grad=False)
        self.lm_head_weight = (
            self.embed_weight if lm_head_weight is None else nn.Parameter(lm_head_weight, requires_grad=False)
        )
        self.final_norm = final_norm.requires_grad_(False) if final_norm is not None else None
        self.logit_softcap = logit_softcap

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetHead:
        """Shares the tensors of an already loaded transformers model (no copy)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        return cls(embed.detach(), None if head is embed else head.detach(), model_shape(model).embed_scale,
                   model.get_decoder().norm, _softcap(model.config))

    def verifier_normed(self, states: Tensor) -> Tensor:
        """The target's final norm of its last decoder layer's output [*, D]: what its LM head turns into its
        next-token logits (see `teacher_logits`)."""
        if self.final_norm is None:
            raise ValueError("this TargetHead has no final norm: load it with load_target_head(..., verifier=True)")
        return self.final_norm(states.to(self.lm_head_weight.dtype))

    def teacher_logits(self, normed: Tensor) -> Tensor:
        """float32 logits of the target itself from `verifier_normed` rows, softcapped as the target's are."""
        logits = F.linear(normed.to(self.lm_head_weight.dtype), self.lm_head_weight).float()
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def embed(self, ids: Tensor) -> Tensor:
        """The target's input embeddings as its own embedding module gives them (Gemma scales by sqrt(hidden) in
        the weight's dtype; serving engines feed the drafter the same)."""
        rows = F.embedding(ids, self.embed_weight)
        if self.embed_scale != 1.0:
            rows = rows * torch.tensor(self.embed_scale, dtype=rows.dtype)
        return rows

    def logits(self, hidden: Tensor) -> Tensor:
        # Casting the activations, not the [vocab, D] weight, keeps a bf16 head from being copied every call.
        return F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)


def _file(location: str, name: str, revision: str | None) -> Path | None:
    """A file of the model: from its local folder, or downloaded alone from the hub; None if it has none."""
    if Path(location).is_dir():
        path = Path(location) / name
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(location, name, revision=revision))
    except EntryNotFoundError:
        return None


def _softcap(config: Any) -> float | None:
    """The target's final_logit_softcapping (Gemma 2), None when it has none."""
    return getattr(text_config_of(config), "final_logit_softcapping", None) or None


def _final_norm(config: Any, weight: Tensor) -> nn.Module:
    """The target's own final norm module (its class: Gemma's and Qwen3.5's scale by 1 + weight, computed in
    float32) holding `weight`: built on the meta device from the config, like transformers builds it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        norm = AutoModelForCausalLM.from_config(config).get_decoder().norm
    norm = norm.to_empty(device=weight.device)
    if norm.weight.shape != weight.shape:
        raise ConfigError(f"target.model: its final norm weight is {list(weight.shape)}, the config builds "
                          f"{list(norm.weight.shape)}")
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def _from_gguf(path: Path, verifier: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(embedding, LM head or None when tied, final norm weight or None unless `verifier`) of a GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    wanted = ("token_embd.weight", "output.weight", "output_norm.weight")
    tensors = {t.name: t for t in GGUFReader(path).tensors if t.name in wanted}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"target.gguf_file: {path.name} has no token_embd.weight tensor")
    if verifier and "output_norm.weight" not in tensors:
        raise ConfigError(f"target.gguf_file: {path.name} has no output_norm.weight tensor (the final norm)")

    def read(name: str) -> Tensor:
        t = tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy())

    return (read("token_embd.weight"), read("output.weight") if "output.weight" in tensors else None,
            read("output_norm.weight") if verifier else None)


def _from_safetensors(location: str, revision: str | None, tied: bool, verifier: bool = False
                      ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(embedding, LM head or None when tied, final norm weight or None unless `verifier`) of a checkpoint."""
    from safetensors import safe_open

    index = _file(location, "model.safetensors.index.json", revision)
    if index is not None:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (single := _file(location, "model.safetensors", revision)) is not None:
        with safe_open(single, "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise ConfigError(f"target.model: no model.safetensors(.index.json) in '{location}'")
    # Multimodal checkpoints nest the language model; the shortest matching name is the text embedding.
    embeds = sorted((k for k in weight_map if k.endswith("embed_tokens.weight")), key=len)
    if not embeds:
        raise ConfigError(f"target.model: no *embed_tokens.weight tensor in '{location}'")
    heads = sorted((k for k in weight_map if k.endswith("lm_head.weight")), key=len)

    def read(name: str) -> Tensor:
        with safe_open(_file(location, weight_map[name], revision), "pt") as f:
            return f.get_tensor(name)

    head = None if tied or not heads else read(heads[0])
    norm = None
    if verifier:
        # The final norm sits beside the embedding in the decoder (model.norm, model.language_model.norm).
        name = embeds[0].removesuffix("embed_tokens.weight") + "norm.weight"
        if name not in weight_map:
            raise ConfigError(f"target.model: no {name} tensor (the final norm beside {embeds[0]}) in '{location}'")
        norm = read(name)
    return read(embeds[0]), head, norm


def load_target_head(target: TargetConfig, device: torch.device | str, dtype: torch.dtype = torch.float32,
                     verifier: bool = False) -> TargetHead:
    """The target's embedding and LM head, honouring `tie_word_embeddings`, as a frozen module on `device`; with
    `verifier`, its final norm too (for the logits of the stored verifier states)."""
    location, _ = model_location(target)
    shape = target_shape(target, download=True, hints=False, count=False)
    if (source := gguf_source(target)) is not None:
        # A conversion holds the dequantized weights exactly in float32, else rounded to its own dtype.
        folder = converted(source, torch.float32) or converted(source, dtype)
        if folder is None:
            embed, head, norm = _from_gguf(source, verifier)
        else:
            embed, head, norm = _from_safetensors(str(folder), None, shape.tie_word_embeddings, verifier)
    else:
        embed, head, norm = _from_safetensors(location, target.revision, shape.tie_word_embeddings, verifier)
    convert = {"device": device, "dtype": dtype}
    final_norm = _final_norm(shape.config, norm.to(**convert)) if norm is not None else None
    return TargetHead(embed.to(**convert), None if head is None else head.to(**convert), shape.embed_scale,
                      final_norm, _softcap(shape.config))
