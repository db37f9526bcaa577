"""The target's shape read once, from transformers' own config classes of every family (no download)."""

from __future__ import annotations

import pytest
import torch

from dflash_stream.bench.tiny_targets import build_config
from dflash_stream.config import ConfigError, TargetConfig
from dflash_stream.drafter.head import TargetHead
from dflash_stream.target_model.shape import model_shape, shape_from_config, target_shape


def test_a_vlm_wrapper_is_read_through_its_text_config():
    shape = shape_from_config(build_config("qwen3_5"), "test")
    assert (shape.model_type, shape.num_layers, shape.hidden_size, shape.vocab_size) == ("qwen3_5", 6, 64, 49152)
    assert shape.layer_type_counts == {"linear_attention": 4, "full_attention": 2}
    assert shape.kv_layers == 2 and shape.is_hybrid
    # Gated-DeltaNet: 4 value heads x 16 x 16 recurrent state + a 3-step conv window over q, k and v, per layer.
    assert shape.state_elements_per_sequence == 4 * (4 * 16 * 16 + (2 * 2 * 16 + 4 * 16) * 3)
    # The vision tower is not part of what extraction loads.
    from transformers import AutoModelForCausalLM

    text_model = AutoModelForCausalLM.from_config(build_config("qwen3_5"))
    assert shape.num_parameters == sum(p.numel() for p in text_model.parameters())


def test_moe_active_parameters_count_routed_experts_top_k_of_n():
    config = build_config("qwen3_moe")  # 4 experts, 2 per token
    shape = shape_from_config(config, "test")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert routed > 0 and shape.num_parameters == sum(p.numel() for p in model.parameters())
    assert shape.active_parameters == shape.num_parameters - routed // 2
    dense = shape_from_config(build_config("qwen3"), "test")
    assert dense.active_parameters == dense.num_parameters


def test_per_layer_type_rope_and_gemma_embedding_scale():
    shape = shape_from_config(build_config("gemma3"), "test")
    assert shape.layer_type_counts == {"sliding_attention": 3, "full_attention": 3}
    assert shape.rope_for("full_attention")["rope_theta"] == 1_000_000
    assert shape.rope_for("sliding_attention")["rope_theta"] == 10_000
    assert shape.embed_scale == pytest.approx(64**0.5) and shape.tie_word_embeddings
    assert shape_from_config(build_config("llama"), "test").embed_scale == 1.0


def test_the_drafter_head_embeds_as_the_target_module_does():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("gemma3_text")).eval()
    ids = torch.tensor([[5, 900, 17, 3]])
    head = TargetHead.from_model(model)
    assert head.embed_scale == model_shape(model).embed_scale != 1.0
    torch.testing.assert_close(head.embed(ids), model.get_input_embeddings()(ids), rtol=0, atol=0)


def test_sliding_and_mla_attention_widths():
    mistral = shape_from_config(build_config("mistral"), "test")
    assert mistral.layer_type_counts == {"sliding_attention": 6} and mistral.sliding_window == 16
    deepseek = shape_from_config(build_config("deepseek_v3"), "test")
    # `head_dim` of a DeepSeek config aliases the narrow RoPE part (16): the drafter takes the value heads' 32.
    assert deepseek.config.head_dim == 16 and deepseek.head_dim == 32
    assert deepseek.kv_elements_per_token == {"full_attention": 16 + 16}  # the compressed latent + the shared RoPE key


def test_gemma4_full_layers_have_heads_of_their_own():
    """A heterogeneous config (transformers' per_layer_config) refuses a model-wide head count: each layer's is
    read, the drafter copies the first's, and each layer type's cache is sized by its own heads."""
    from dflash_stream.sizing.memory import target_dims

    shape = shape_from_config(build_config("gemma4_text"), "test")
    assert shape.layer_type_counts == {"sliding_attention": 4, "full_attention": 2}
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (4, 2, 16)
    # Sliding: 2 KV heads of 16; full: 1 KV head of 32 whose keys are its values (the cache holds both).
    assert shape.kv_elements_per_token == {"sliding_attention": 2 * 2 * 16, "full_attention": 2 * 1 * 32}
    assert shape.embed_scale == pytest.approx(64**0.5)
    # 100 tokens: the sliding layers hold their window of 16, the full layers all.
    assert target_dims(shape).kv_cache_bytes(100, 2) == (4 * 16 * 64 + 2 * 100 * 64) * 2
    # Its full layers' proportional RoPE turns the first quarter of each head at default frequencies; a drafter
    # turns whole heads at those (z-lab's Gemma 4 31B drafter: rope_theta 1e6, plain RoPE).
    from dflash_stream.drafter.spec import target_rope

    assert shape.rope_for("full_attention")["rope_type"] == "proportional"
    assert target_rope(shape) == (1e6, None)


def test_plan_hints_build_the_family_config_when_the_model_is_not_at_hand():
    hints = TargetConfig(model="Qwen/Qwen3.6-27B", model_type="qwen3_5", num_layers=64, hidden_size=5120,
                         vocab_size=248320, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                         intermediate_size=17408)
    shape = target_shape(hints, count=False)
    assert shape.layer_type_counts == {"linear_attention": 48, "full_attention": 16}
    assert shape.vocab_size == 248320 and shape.head_dim == 256 and "target.model_type" in shape.source
    bare = target_shape(TargetConfig(model="org/m", num_layers=36, hidden_size=4096))
    assert bare.layer_type_counts == {"full_attention": 36} and bare.model_type == "unknown"
    with pytest.raises(ConfigError, match="target.model_type"):
        target_shape(TargetConfig(model="org/m", model_type="no_such_family", num_layers=2, hidden_size=8))
    with pytest.raises(ConfigError, match="target.config_hints: global_head_dim not a key of transformers' "
                                          "Qwen3_5TextConfig"):
        target_shape(hints.model_copy(update={"config_hints": {"global_head_dim": 512}}))


def test_config_hints_state_what_the_named_hints_cannot():
    """Gemma 4's full layers have heads of their own, which no target.* hint names: `target.config_hints` takes
    them, and plan sizes the caches from hints alone as from the config.json itself."""
    from dflash_stream.bench.tiny_targets import GEMMA4

    named = {"num_layers": 6, "hidden_size": 64, "vocab_size": 2048, "intermediate_size": 96,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    extra = {k: GEMMA4[k] for k in ("layer_types", "global_head_dim", "num_global_key_value_heads",
                                     "attention_k_eq_v", "sliding_window")}
    hints = TargetConfig(model="google/gemma-4-31B-it", model_type="gemma4", config_hints=extra, **named)
    shape = target_shape(hints, count=False)
    assert shape.kv_elements_per_token == shape_from_config(build_config("gemma4_text"), "test").kv_elements_per_token
    assert shape.layer_type_counts == {"sliding_attention": 4, "full_attention": 2} and shape.sliding_window == 16
    without = target_shape(hints.model_copy(update={"config_hints": {}}), count=False)
    assert without.kv_elements_per_token != shape.kv_elements_per_token
    with pytest.raises(ConfigError, match="target.config_hints: global_head_dimm not a key of transformers' "
                                          "Gemma4TextConfig"):  # a config would keep it as a stray attribute
        target_shape(hints.model_copy(update={"config_hints": {**extra, "global_head_dimm": 512}}))
    with pytest.raises(ConfigError, match="target.config_hints: needs target.model_type"):
        target_shape(TargetConfig(model="org/m", num_layers=2, hidden_size=8, config_hints={"head_dim": 3}))
    with pytest.raises(ConfigError, match="target.config_hints: hidden_size set otherwise by a target.. hint"):
        target_shape(hints.model_copy(update={"config_hints": {**extra, "hidden_size": 128}}))
    with pytest.raises(ConfigError, match="target.num_layers"):
        target_shape(TargetConfig(model="org/m"))
