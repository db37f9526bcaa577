"""data.generation.engine hf: the target answers the prompts in-process, with `model.generate` (DFlash trains
on the target's own outputs; `dflash_stream.regenerate` caches them)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from dflash_stream.config import GenerationConfig
from dflash_stream.target_model.loading import stop_token_ids


class _EveryStep(StoppingCriteria):
    """Calls `on_step` after each decoding step, in the generating thread; never stops anything."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self.on_step = on_step

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.on_step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def generate_responses(model, tokenizer, prompts: list[np.ndarray], gen: GenerationConfig,
                       max_new_tokens: int, on_step: Callable[[], None] | None = None) -> list[list[int]]:
    """One response per prompt (token ids up to and including the end-of-turn token), in one batched call.
    `on_step`: called after every decoding step (a CPU extractor takes or returns cores there)."""
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
        **({"stopping_criteria": StoppingCriteriaList([_EveryStep(on_step)])} if on_step is not None else {}),
    )[:, width:].tolist()
    eos = stop_token_ids(model, tokenizer)
    responses = []
    for tokens in out:
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        responses.append(tokens[:end])
    return responses
