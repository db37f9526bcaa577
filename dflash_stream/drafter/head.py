"""The target's embedding and LM head, frozen, read straight from its weight files (never the whole target)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.target_model.location import model_location
from dflash_stream.target_model.shape import model_shape, target_shape


class TargetHead(nn.Module):
    """Frozen `embed` (token ids -> target embeddings) and `logits` (hidden -> vocabulary), shared when tied."""

    def __init__(self, embed_weight: Tensor, lm_head_weight: Tensor | None = None, embed_scale: float = 1.0) -> None:
        super().__init__()
        self.embed_scale = embed_scale
        self.embed_weight = nn.Parameter(embed_weight, requires_grad=False)
        self.lm_head_weight = (
            self.embed_weight if lm_head_weight is None else nn.Parameter(lm_head_weight, requires_grad=False)
        )

    @classmethod
    def from_model(cls, model: nn.Module) -> TargetHead:
        """Shares the tensors of an already loaded transformers model (no copy)."""
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        return cls(embed.detach(), None if head is embed else head.detach(), model_shape(model).embed_scale)

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


def _from_gguf(path: Path) -> tuple[Tensor, Tensor | None]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(path).tensors if t.name in ("token_embd.weight", "output.weight")}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"target.gguf_file: {path.name} has no token_embd.weight tensor")

    def read(name: str) -> Tensor:
        t = tensors[name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy())

    return read("token_embd.weight"), read("output.weight") if "output.weight" in tensors else None


def _from_safetensors(location: str, revision: str | None, tied: bool) -> tuple[Tensor, Tensor | None]:
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
    return read(embeds[0]), head


def load_target_head(target: TargetConfig, device: torch.device | str, dtype: torch.dtype = torch.float32) -> TargetHead:
    """The target's embedding and LM head, honouring `tie_word_embeddings`, as a frozen module on `device`."""
    location, kwargs = model_location(target)
    shape = target_shape(target, download=True, hints=False, count=False)
    if target.gguf_file:
        embed, head = _from_gguf(Path(location) / kwargs["gguf_file"])
    else:
        embed, head = _from_safetensors(location, target.revision, shape.tie_word_embeddings)
    convert = {"device": device, "dtype": dtype}
    return TargetHead(embed.to(**convert), None if head is None else head.to(**convert), shape.embed_scale)
