"""The compiled FlexAttention the trainer runs on CUDA, compiled here by inductor for the CPU: its forward equals
SDPA with the dense mask (FlexAttention has no CPU backward). Inductor's CPU code generation needs a C compiler."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from dflash_stream.drafter import DFlashDrafter, DrafterSpec
from dflash_stream.drafter.model import _compiled_flex

COMPILER = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.mark.slow
@pytest.mark.skipif(COMPILER is None, reason="torch.compile (inductor) on the CPU needs a C compiler: "
                                             "install one (apt-get install gcc) to run this test")
@torch.no_grad()
def test_compiled_flex_attention_equals_sdpa_on_cpu():
    # head_dim 64 (drafters use 128): torch 2.13's CPU kernel gave zero or NaN rows at head_dim 16 with 56 keys.
    spec = DrafterSpec(hidden_size=256, intermediate_size=512, num_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, vocab_size=100,
                       block_size=4, mask_token_id=99, target_layer_ids=[0, 1], num_target_layers=4)
    drafter = DFlashDrafter(spec, attention="flex")
    g = torch.Generator().manual_seed(0)
    n, s, heads, kv_heads, dh = 2, 40, 4, 2, 64
    anchors = torch.tensor([[3, 9, 15, 30], [5, 6, 20, 33]])
    q_len = anchors.shape[1] * spec.block_size
    q = torch.randn(n, heads, q_len, dh, generator=g)
    k = torch.randn(n, kv_heads, s + q_len, dh, generator=g)
    v = torch.randn(n, kv_heads, s + q_len, dh, generator=g)
    block_mask = drafter.block_mask(anchors, s)  # FlexAttention's BlockMask (attention="flex")
    drafter.attention = "sdpa"
    dense = drafter.block_mask(anchors, s)  # the same mask_mod on a dense grid

    compiled = _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)  # inductor, CPU template
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(compiled, reference, atol=1e-5, rtol=1e-5)
    # Not a silent eager fallback: the compiled function went through dynamo and produced a graph.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
