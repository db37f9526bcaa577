"""Tiny random-weight targets of every family DFlash drafters are published for, built from transformers' own
config classes (no download) and saved like hub checkpoints: the class a hub checkpoint of that family is
saved as (VLM wrappers included), safetensors, and the demo tokenizer beside it. The tests and `bench
eval-engines` build them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

VOCAB = 49152  # the demo tokenizer's
# Small enough to run a whole `run` in seconds, deep enough for 3 distinct DFlash layer ids (1, L//2, L-3).
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 3}
WINDOW = 16  # sliding windows far shorter than the prompts, so that eval must roll windowed caches back
SERVED = {"hidden_size": 128, "head_dim": 32, "global_head_dim": 64, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
"""Wider heads for the targets served with vLLM: its CPU attention takes head sizes 32 to 512 only, its CPU
Gated-DeltaNet kernel ("Unexpected head dim size, 32") the real models' 128, its CPU latent attention (MLA) the
DeepSeek latent of 512 + 64 only ("Head dimension 32 is not supported by MLA")."""


QWEN_VL_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                     "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
IMAGE_PROCESSORS = {"qwen3_5": QWEN_VL_PROCESSOR, "qwen3_5_moe": QWEN_VL_PROCESSOR}
"""The image processor a wrapper's hub checkpoint carries (the sizes come from its vision config)."""


def _drop(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


GEMMA4 = {**TEXT, "sliding_window": WINDOW,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
          "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0}
"""As Gemma 4 31B: full layers with heads of their own, wider and fewer, whose keys are their values; a logit
softcap; no per-layer input embeddings (the small E2B/E4B's)."""


FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (model_type, config kwargs); wrappers take the text settings under text_config.
    "llama": ("llama", _drop(TEXT, "head_dim")),
    "qwen3": ("qwen3", TEXT),
    "qwen3_moe": ("qwen3_moe", {**TEXT, **MOE}),
    "glm4_moe": ("glm4_moe", {**_drop(TEXT, "head_dim"), "n_routed_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                              "topk_group": 1, "n_shared_experts": 1}),
    "gpt_oss": ("gpt_oss", {**TEXT, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                            "intermediate_size": 32}),
    "deepseek_v3": ("deepseek_v3", {**_drop(TEXT, "head_dim"), "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                                    "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
                                    "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
                                    # as the hub's config.json has them (vLLM builds the router's bias from them)
                                    "topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    "qwen3_5": ("qwen3_5", {"text_config": {**TEXT, **GDN}, "vision_config": {"depth": 1, "hidden_size": 32,
                            "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}}),
    # As the hub's Qwen3.5/3.6-MoE configs: experts' and shared expert's widths, no dense `intermediate_size`.
    "qwen3_5_moe": ("qwen3_5_moe", {"text_config": {**_drop(TEXT, "intermediate_size"), **GDN, **MOE,
                                                    "shared_expert_intermediate_size": 32},
                                    "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                                      "out_hidden_size": 64}}),
    "gemma3": ("gemma3", {"text_config": {**TEXT, "sliding_window": WINDOW, "sliding_window_pattern": 2},
                          "vision_config": {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
                          "mm_tokens_per_image": 4}),
    "qwen3_5_text": ("qwen3_5_text", {**TEXT, **GDN}),
    "qwen3_next": ("qwen3_next", {**TEXT, **GDN, **MOE, "shared_expert_intermediate_size": 32}),
    "mistral": ("mistral", {**TEXT, "sliding_window": WINDOW}),
    "gemma3_text": ("gemma3_text", {**TEXT, "sliding_window": WINDOW, "sliding_window_pattern": 2}),
    "gemma4_text": ("gemma4_text", GEMMA4),
    "gemma4": ("gemma4", {"text_config": GEMMA4, "vision_config": {
        "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16}}),
}


def build_config(family: str, served: bool = False, vocab_size: int = VOCAB) -> Any:
    """The family's tiny config; `served`: with SERVED's widths (a text config's own keys only); `vocab_size`:
    another tokenizer's (the ids 1 and 2 of bos and eos stay)."""
    from transformers import AutoConfig

    model_type, kwargs = FAMILIES[family]
    text = {**kwargs.get("text_config", kwargs), "vocab_size": vocab_size}
    if served:
        text.update({k: v for k, v in SERVED.items() if k in text or k in ("hidden_size", "head_dim")})
        if "qk_rope_head_dim" in text:  # latent attention: transformers reads head_dim as the rotary part
            text["head_dim"] = text["qk_rope_head_dim"]
    if "text_config" in kwargs:
        vision = kwargs["vision_config"]
        if served:
            vision = {**vision, "out_hidden_size": SERVED["hidden_size"]}
        kwargs = {**kwargs, "text_config": text, "vision_config": vision}
    else:
        kwargs = text
    return AutoConfig.for_model(model_type, **kwargs)


def save_target(family: str, out: Path, tokenizer_dir: Path, seed: int = 0, served: bool = False,
                vocab_size: int = VOCAB, weight_scale: float = 1.0) -> Path:
    """The family's tiny model saved as its hub checkpoints are: a wrapper class where the hub has one.
    `weight_scale`: every matrix multiplied by it (at the default init a tiny random model greedily repeats a few
    tokens with nearly flat next-token distributions; scaled, its answers vary and its distributions are peaked)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = build_config(family, served, vocab_size)
    torch.manual_seed(seed)
    wrapped = config.get_text_config() is not config
    model = (AutoModelForImageTextToText if wrapped else AutoModelForCausalLM).from_config(config)
    if weight_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.mul_(weight_scale)
    model.save_pretrained(out, safe_serialization=True)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    if served and family in IMAGE_PROCESSORS:  # vLLM loads a VLM's processor even to serve text
        vision = config.vision_config
        processor = {**IMAGE_PROCESSORS[family], "patch_size": vision.patch_size,
                     "temporal_patch_size": vision.temporal_patch_size, "merge_size": vision.spatial_merge_size}
        (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return out
