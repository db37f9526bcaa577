"""A target that needs no download: a bundled Qwen3-class config with random weights, and a byte-level BPE
tokenizer with a ChatML template trained on the bundled demo data.

For GPU benchmarks and tests on machines with neither the hub nor the demo model: throughput and memory depend
on shapes, not on weight values. Nothing here judges quality (acceptance needs the real target).
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

TARGETS = Path(str(files("dflash_stream") / "bench" / "targets"))
DEMO_DATA = Path(str(files("dflash_stream") / "demo_data"))
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (pad, turn start, eos)
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def target_config(name: str = "qwen3-4b", **overrides: Any):
    """The bundled transformers config `targets/<name>.json`, with fields overridden (e.g. num_hidden_layers)."""
    from transformers import AutoConfig

    path = TARGETS / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TARGETS.glob("*.json")))
        raise ValueError(f"no bundled target config '{name}' (known: {known})")
    fields = {**json.loads(path.read_text()), **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def demo_texts() -> list[str]:
    """Every string of the bundled demo data files."""
    texts = []
    for path in sorted(DEMO_DATA.iterdir()):
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        elif path.suffix == ".json":
            rows = json.loads(path.read_text())
        else:
            continue
        texts += _strings(rows)
    return texts


def build_tokenizer(vocab_size: int = 8192):
    """A fast byte-level BPE tokenizer trained on the demo data (deterministic), with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(demo_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def build_target(config, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The model of `config` with random weights, created directly on `device`, in eval mode and frozen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def save_target(folder: str | Path, config, tokenizer, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """A random-weight target as a model folder (config.json, safetensors, tokenizer) that `target.model` loads."""
    folder = Path(folder)
    model = build_target(config, device, dtype, seed)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model
    return folder
