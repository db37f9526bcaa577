"""Run by `.venv-vllm/bin/python` (tests/test_dflash2.py): vLLM 0.32's DFlash2 model (qwen3_dflash2.py) built from an
exported DFlash2 drafter folder, against dflash-stream's own numbers in a .pt file the test wrote.

    python tests/vllm_dflash2_check.py TARGET_DIR DRAFTER_DIR CASE.pt OUT.json

CASE.pt holds the inputs (the target's states of a context, the block, their positions, conv and selector inputs)
and dflash-stream's outputs on them. This script (which imports nothing of dflash-stream: vLLM's environment is its
own) writes OUT.json with what vLLM's code gives: its parameters' names and shapes, whether every exported tensor
loaded into them unchanged, its pure functions `_grouped_conv` and `_score_edges` on the same inputs, and its
model's forward of the block with the candidate selector.

vLLM's CPU build refuses a DFlash2 drafter at config time (its V1 runner has no candidate-head speculator, its V2
runner needs Triton), so the config is made with the folder's architecture read as DFlashDraftModel and
DFlash2Qwen3ForCausalLM is then built from it directly: the module and its weight loading are vLLM's own. The
one piece its forward needs from the serving runtime, the attention kernel over the KV cache, is replaced by
scaled dot-product attention over the context keys/values that vLLM's own projection path computes
(`_project_context_kv`, `_normalize_context_k`, its RoPE op): everything DFlash2 adds runs as vLLM runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
SHARED = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")
"""vLLM parameters that come from the target (embedding, LM head) or an optional file, not from the drafter."""


def vllm_config(target: str, drafter: Path, block_size: int):
    from vllm.engine.arg_utils import EngineArgs

    readable = Path(tempfile.mkdtemp()) / "drafter"
    shutil.copytree(drafter, readable)
    config = json.loads((readable / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]  # past the CPU runner check; the module is built below
    (readable / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=target, dtype="float32", max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": str(readable),
                                          "num_speculative_tokens": block_size - 1})
    return args.create_engine_config()


def expected_parameters(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors under vLLM's parameter names, the stacked projections concatenated as its loader stacks them."""
    out: dict[str, list] = {}
    for name, tensor in ours.items():
        parts = name.split(".")
        stacked = next(((i, STACKED[p]) for i, p in enumerate(parts) if p in STACKED), None)
        if stacked is None:
            out["model." + name] = [(0, tensor)]
        else:
            i, (fused, order) = stacked
            out.setdefault("model." + ".".join([*parts[:i], fused, *parts[i + 1:]]), []).append((order, tensor))
    return {name: torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]) for name, pieces in out.items()}


class ContextAttention(nn.Module):
    """Stands for vLLM's KV-cache attention kernel: block queries over [context keys/values ; block's own]."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = self.context  # [S, G, Dh]
        q = q.view(-1, self.heads, self.head_dim).transpose(0, 1)[None]
        k = torch.cat((ck, k.view(-1, self.kv_heads, self.head_dim))).transpose(0, 1)[None]
        v = torch.cat((cv, v.view(-1, self.kv_heads, self.head_dim))).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return out[0].transpose(0, 1).flatten(1)


def context_kv(model, states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [S, G, Dh] of the context, as vLLM's precompute_and_store_context_kv makes them
    before it writes them into the cache."""
    from vllm import _custom_ops as ops

    inner = model.model
    features = model.combine_hidden_states(states)
    n, layers = features.shape[0], inner._num_attn_layers
    keys, values = inner._project_context_kv(features, n, layers, inner._num_kv_heads, inner._head_dim)
    keys = inner._normalize_context_k(keys)
    flat = keys.reshape(layers * n, inner._kv_size)
    ops.rotary_embedding(positions.repeat(layers), flat, None, inner._rope_head_size,
                         inner._rope_cos_sin_cache.to(flat.dtype), inner._rope_is_neox)
    keys = flat.view(layers, n, inner._num_kv_heads, inner._head_dim)
    return [(keys[i], values[i]) for i in range(layers)]


def main(target: str, drafter: str, case_path: str, out_path: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models import qwen3_dflash2 as vllm_dflash2

    case = torch.load(case_path)
    vc = vllm_config(target, Path(drafter), case["block_size"])
    report: dict = {}
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{case['port']}")
        ensure_model_parallel_initialized(1, 1)
        model = vllm_dflash2.DFlash2Qwen3ForCausalLM(vllm_config=vc).eval()
        names = {n: list(p.shape) for n, p in model.named_parameters()}
        report["parameters"] = names

        ours = load_file(Path(drafter) / "model.safetensors")
        expected = expected_parameters(ours)
        report["missing_in_vllm"] = sorted(set(expected) - set(names))
        report["not_in_export"] = sorted(set(names) - set(expected) - set(SHARED))
        report["shape_mismatch"] = sorted(n for n in expected.keys() & names.keys()
                                          if list(expected[n].shape) != names[n])
        model.load_weights(ours.items())
        params = dict(model.named_parameters())
        report["loaded_equal"] = all(torch.equal(params[n].data, t.to(params[n].dtype)) for n, t in expected.items()
                                     if n in params)
        try:
            model.load_weights([("layers.0.not_a_parameter", torch.zeros(1))])
            report["rejects_unknown_tensor"] = False
        except (KeyError, ValueError, AssertionError):
            report["rejects_unknown_tensor"] = True

        # The target's embedding and LM head (tied in the tiny target), then vLLM's own post-load processing.
        embedding = case["embedding"]
        model.model.embed_tokens.weight.data.copy_(embedding)
        model.lm_head.weight.data.copy_(embedding)
        process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))

        # vLLM's pure functions on our inputs
        conv = case["conv"]
        report["grouped_conv"] = vllm_dflash2._grouped_conv(
            conv["x"], conv["delta"], conv["base"], case["block_size"], conv["x"].shape[-1] // conv["group_size"],
            conv["group_size"], conv["base"].shape[0]).tolist()
        edges = case["edges"]
        report["score_edges"] = vllm_dflash2._score_edges(
            edges["predecessor"], edges["successor"], edges["candidates"], edges["unary"], edges["hidden"],
            edges["anchors"], edges["candidates"].shape[-1]).tolist()

        # The model's forward of one block after the context, then the candidates and their edge scores.
        spec = case["spec"]
        kv = context_kv(model, case["states"], case["context_positions"])
        for layer, layer_kv in zip(model.model.layers, kv, strict=True):
            attention = ContextAttention(spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"])
            attention.context = layer_kv
            layer.self_attn.attn = attention
        with torch.no_grad():
            hidden = model.model(case["block"], case["block_positions"])
            candidates, unary = model.compute_candidates(hidden[1:])
            scores = model.model.candidate_selector(candidates[None], unary[None], hidden[1:][None], case["block"][:1])
        report["hidden"] = hidden.tolist()
        report["candidates"] = candidates.tolist()
        report["unary"] = unary.tolist()
        report["scores"] = scores.tolist()
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main(*sys.argv[1:5])
