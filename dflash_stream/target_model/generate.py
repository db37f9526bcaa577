"""data.generation.engine hf: the target answers the prompts in-process, with `model.generate` (DFlash trains
on the target's own outputs; `dflash_stream.regenerate` caches them)."""

from __future__ import annotations

import numpy as np
import torch

from dflash_stream.config import GenerationConfig
from dflash_stream.target_model.loading import stop_token_ids


@torch.inference_mode()
def generate_responses(model, tokenizer, prompts: list[np.ndarray], gen: GenerationConfig,
                       max_new_tokens: int) -> list[list[int]]:
    """One response per prompt (token ids up to and including the end-of-turn token), in one batched call."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    # Left padding: every prompt ends where generation starts.
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.from_numpy(prompt.astype(np.int64))
        mask[row, width - len(prompt):] = 1
    sampling = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p} if gen.temperature > 0 \
        else {"do_sample": False}
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id, **sampling,
    )[:, width:].tolist()
    eos = stop_token_ids(model, tokenizer)
    responses = []
    for tokens in out:
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        responses.append(tokens[:end])
    return responses
