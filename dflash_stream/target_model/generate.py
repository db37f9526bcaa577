"""data.generation.engine hf: the target answers the prompts in-process, with `model.generate` (DFlash trains
on the target's own outputs; `dflash_stream.regenerate` caches them). `generate_with_states` also keeps the
states of the layers a `LayerCapture` hooks, recorded while the answers are decoded: every kept token passes
through the model once, so the extractor needs no second forward over prompt and answer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from dflash_stream.config import GenerationConfig
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.loading import stop_token_ids


class _EveryStep(StoppingCriteria):
    """Calls `on_step` after each decoding step, in the generating thread; never stops anything."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self.on_step = on_step

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.on_step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _StopOnceFed(StoppingCriteria):
    """A row is done one step after its stop token: that step feeds the stop token through the model, so its
    states are recorded too (transformers' own criterion ends the row as the token is chosen)."""

    def __init__(self, stop_ids: set[int], prompt_width: int, device: torch.device) -> None:
        # The attribute's name tells `generate` to pad the rows that are done, as with its own criterion.
        self.eos_token_id = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if input_ids.shape[1] - self.prompt_width < 2:  # nothing generated has been fed yet
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return torch.isin(input_ids[:, -2], self.eos_token_id)


def _generate(model, tokenizer, prompts: list[np.ndarray], gen: GenerationConfig, max_new_tokens: int,
              criteria: list[StoppingCriteria], **kwargs) -> tuple[list[list[int]], int]:
    """(the tokens generated after each prompt, stop token and what follows it included; the padded prompt
    width) of one batched, left-padded `generate`."""
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
        **({"stopping_criteria": StoppingCriteriaList(criteria)} if criteria else {}), **kwargs,
    )
    return out[:, width:].tolist(), width


def _cut(tokens: list[int], stop_ids: set[int], limit: int) -> list[int]:
    """The response: up to and including the first stop token, at most `limit` tokens."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return tokens[: min(end, limit)]


@torch.inference_mode()
def generate_responses(model, tokenizer, prompts: list[np.ndarray], gen: GenerationConfig,
                       max_new_tokens: int, on_step: Callable[[], None] | None = None) -> list[list[int]]:
    """One response per prompt (token ids up to and including the end-of-turn token), in one batched call.
    `on_step`: called after every decoding step (a CPU extractor takes or returns cores there)."""
    criteria = [_EveryStep(on_step)] if on_step is not None else []
    out, _ = _generate(model, tokenizer, prompts, gen, max_new_tokens, criteria)
    stop_ids = stop_token_ids(model, tokenizer)
    return [_cut(tokens, stop_ids, max_new_tokens) for tokens in out]


@torch.inference_mode()
def generate_with_states(model, tokenizer, prompts: list[np.ndarray], gen: GenerationConfig, max_new_tokens: int,
                         capture: LayerCapture, on_step: Callable[[], None] | None = None,
                         ) -> list[tuple[list[int], torch.Tensor]]:
    """`generate_responses`, with each row's captured states over prompt + response (bf16 [T, K*D] on the host,
    what `capture(prompt + response)` returns to bf16 rounding). One step more than the responses need is
    decoded, so the last kept token is fed through the model as well; the responses are the same."""
    stop_ids = stop_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    criteria: list[StoppingCriteria] = [_StopOnceFed(stop_ids, max(len(p) for p in prompts), device)]
    if on_step is not None:
        criteria.append(_EveryStep(on_step))
    with capture.recording() as recorded:
        # eos_token_id None: rows end by `_StopOnceFed` alone, one step after transformers' criterion would.
        out, width = _generate(model, tokenizer, prompts, gen, max_new_tokens + 1, criteria, eos_token_id=None)
        states = recorded().cpu()
    results = []
    for row, (prompt, tokens) in enumerate(zip(prompts, out, strict=True)):
        response = _cut(tokens, stop_ids, max_new_tokens)
        # Column width + i holds response token i's states: decoding step i + 1 fed it.
        kept = states[row, width - len(prompt): width + len(response)]
        if len(kept) != len(prompt) + len(response):
            raise RuntimeError(f"generate recorded {states.shape[1] - width} decoding steps, fewer than the "
                               f"{len(response)} tokens of a response")
        results.append((response, kept.clone()))
    return results
