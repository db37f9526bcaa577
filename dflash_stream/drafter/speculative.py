"""Greedy speculative decoding with a DFlash drafter, and the target-only greedy decoder it must reproduce.

Both decoders keep the target's KV cache, so the speedup they measure compares like with like. They use the
transformers 5 cache API (`cache=` argument, `crop(-n)` removes the last n tokens).

Rolling a rejected draft back is easy for full-attention layers (slice the KV cache) but not for the layers of
hybrid targets: a sliding-window layer keeps only its last `window - 1` keys and a Gated-DeltaNet layer
(Qwen3.5/3.6, Qwen3-Next) keeps one fixed-size recurrent state plus a short convolution window, so what the
rejected tokens overwrote is gone. `enable_rollback` switches on transformers' past recording for exactly those
layers: during a verification forward they keep the evicted keys and one recurrent state per block token, and
`crop` restores the state after the accepted prefix and trims back to minimal size. The alternative, a
snapshot of those states before verifying, restored before re-running the accepted tokens, keeps one state
instead of B but runs the accepted tokens twice: on tiny CPU targets (issue 23) a verification step took
5.3 vs 8.5 ms (Qwen3.5, B = 4), 11.8 vs 12.1 ms (B = 16) and 3.3 vs 5.3 ms (Gemma 3, B = 4) with recording vs
snapshots. Targets with full attention only are unaffected: their layers record nothing (same time as before).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import Cache, DynamicCache

from dflash_stream.drafter.head import TargetHead
from dflash_stream.drafter.model import KV, DFlashDrafter


@dataclass
class Generation:
    tokens: list[int]
    """New tokens (the prompt excluded), cut after the first stop token and at max_new_tokens."""
    seconds: float
    accepted: list[int] = field(default_factory=list)
    """Per target verification step: how many drafted tokens the target accepted (0 .. B-1)."""

    @property
    def acceptance_length(self) -> float | None:
        """Tokens emitted per verification step (the first token comes from the prefill, as without drafting)."""
        return (len(self.tokens) - 1) / len(self.accepted) if self.accepted else None


def _finish(tokens: list[int], max_new_tokens: int, stop_ids: Collection[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    return tokens if stop is None else tokens[: stop + 1]


@torch.inference_mode()
def greedy_generate(target: nn.Module, input_ids: Tensor, max_new_tokens: int, stop_ids: Collection[int],
                    verify_block: int | None = None) -> Generation:
    """The target's own greedy output, one cached forward per token.

    `verify_block`: call the target as `speculative_generate`'s verification forward does for blocks of that size
    (hidden states out, rollback recording on, a crop after every forward), one token per call: the baseline a
    speedup is measured against. A plain decoding loop can take other kernels than the verification loop (a
    Gated-DeltaNet layer decodes one token through its convolution-update path unless it records its states),
    and its timing would then credit the drafter with the difference."""
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    hidden = verify_block is not None
    out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=hidden, logits_to_keep=1)
    if verify_block is not None:
        enable_rollback(cache, verify_block)
    tok = int(out.logits[0, -1].argmax())
    tokens = [tok]
    while len(tokens) < max_new_tokens and tok not in stop_ids:
        out = target(input_ids.new_tensor([[tok]]), cache=cache, use_cache=True, output_hidden_states=hidden)
        if verify_block is not None:
            cache.crop(0)  # as after a verification that accepted every draft: ends this step's recording
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
    return Generation(_finish(tokens, max_new_tokens, stop_ids), time.perf_counter() - start)


def enable_rollback(cache: Cache, block_size: int) -> None:
    """Let `cache.crop(-n)` undo up to `block_size - 1` tokens of the next forward in every kind of layer.

    Call it after the prefill: recording during the prefill would keep every prompt token's window keys and
    convolution inputs until the first crop. Full-attention layers do not record (a crop slices them anyway);
    linear-attention layers record the recurrent state after each of the last `block_size` tokens of a forward,
    which makes transformers run those tokens through the step-by-step kernel instead of the chunked one.
    Keeping `block_size` states, not B-1: the history must reach back to the state after the block's first
    token, which is where a block whose drafts are all rejected resumes (with B-1 the output diverges).
    After every verification forward call `cache.crop(-rejected)`, also with 0: it drops the recorded states."""
    cache.activate_past_recording(recurrent_states_to_keep=block_size)


def _features(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    # Layer id i is the output of decoder layer i, i.e. hidden_states[i + 1] (index 0 is the embedding).
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _append(context: list[KV], new: list[KV]) -> list[KV]:
    return [(torch.cat((k, k2), dim=2), torch.cat((v, v2), dim=2)) for (k, v), (k2, v2) in zip(context, new, strict=True)]


def _draft(drafter: DFlashDrafter, head: TargetHead, block: Tensor, positions: Tensor, context: list[KV]) -> Tensor:
    """The drafter's greedy guesses [B-1] for the block's masked slots (tests replace this with an oracle): the
    head's argmax, or a DFlash2 drafter's walk through its reranked candidates."""
    return drafter.propose(head, block, positions, context)[0]


def _drafted_block(drafter: DFlashDrafter, head: TargetHead, last: int, length: int, offsets: Tensor,
                   context: list[KV]) -> tuple[Tensor, Tensor]:
    """The next block to verify, [1, B], and its positions: the last kept token, then the drafter's B-1 guesses."""
    spec = drafter.spec
    block = offsets.new_full((1, spec.block_size), spec.mask_token_id)
    block[0, 0] = last
    block_pos = length + offsets
    block[0, 1:] = _draft(drafter, head, block, block_pos, context)
    return block, block_pos


def _accepted(block: Tensor, verdict: Tensor) -> int:
    """How many of the block's drafts agree with the verdicts before the first that does not."""
    return int((block[0, 1:] == verdict[:-1]).cumprod(0).sum())


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    input_ids: Tensor,
    max_new_tokens: int,
    stop_ids: Collection[int],
) -> Generation:
    """Greedy block drafting: the drafter proposes B-1 tokens after the last accepted one, the target checks
    the whole block in one forward, and the longest agreeing prefix plus the target's own next token is kept.
    The output equals `greedy_generate` token for token (up to floating-point ties)."""
    start = time.perf_counter()
    spec = drafter.spec
    layer_ids = spec.target_layer_ids
    cache = DynamicCache(config=target.config)
    out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    length = input_ids.shape[1]  # tokens in the target's cache = position of the next token to feed it
    positions = torch.arange(length, device=input_ids.device)[None]
    context = drafter.context_kv(_features(out.hidden_states, layer_ids), positions)
    enable_rollback(cache, spec.block_size)
    tokens = [int(out.logits[0, -1].argmax())]
    accepted: list[int] = []
    offsets = torch.arange(spec.block_size, device=input_ids.device)[None]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        block, block_pos = _drafted_block(drafter, head, tokens[-1], length, offsets, context)
        out = target(block, cache=cache, use_cache=True, output_hidden_states=True)
        verdict = out.logits[0].argmax(-1)  # the target's next token after each block position
        n = _accepted(block, verdict)
        tokens += block[0, 1 : n + 1].tolist() + [int(verdict[n])]
        accepted.append(n)

        # Keep the states of the block's first token and the accepted drafts; the rest were guesses. Crop even
        # when nothing was rejected: crop(0) ends the recording of this step's windowed and recurrent states.
        length += n + 1
        cache.crop(-(spec.block_size - n - 1))
        new_states = _features(out.hidden_states, layer_ids)[:, : n + 1]
        context = _append(context, drafter.context_kv(new_states, block_pos[:, : n + 1]))
        if any(t in stop_ids for t in tokens[-(n + 1) :]):
            break
    return Generation(_finish(tokens, max_new_tokens, stop_ids), time.perf_counter() - start, accepted)


@torch.inference_mode()
def replay_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    input_ids: Tensor,
    answer: list[int],
    max_new_tokens: int,
    stop_ids: Collection[int],
) -> Generation:
    """`speculative_generate` on a given answer: the drafter drafts as there, but each verdict is the next token of
    `answer` (another engine's greedy answer to the same prompt) instead of this target's argmax, and the target's
    states come from one forward over the prompt and the answer. Where an engine's answer parts from ours (a
    near-tie its kernels round the other way), our τ on its answer is the figure to hold its τ against: the same
    text drafted on in both. On our own answer it gives `speculative_generate`'s steps (up to rounding).

    A last block can reach past the answer's end (its accepted drafts are counted as both engines count them):
    there the path goes on with this target's greedy continuation."""
    start = time.perf_counter()
    spec = drafter.spec
    if not answer:
        return Generation([], time.perf_counter() - start)
    answer = answer[:max_new_tokens]
    prompt_and_answer = torch.cat((input_ids, input_ids.new_tensor([answer])), dim=1)
    path = answer + greedy_generate(target, prompt_and_answer, spec.block_size, ()).tokens
    ids = torch.cat((input_ids, input_ids.new_tensor([path[:-1]])), dim=1)
    out = target(ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    states = _features(out.hidden_states, spec.target_layer_ids)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    length = input_ids.shape[1]
    context = drafter.context_kv(states[:, :length], positions[:, :length])
    tokens = [path[0]]
    accepted: list[int] = []
    offsets = torch.arange(spec.block_size, device=ids.device)[None]
    while len(tokens) < min(max_new_tokens, len(answer)) and tokens[-1] not in stop_ids:
        block, _ = _drafted_block(drafter, head, tokens[-1], length, offsets, context)
        verdict = ids.new_tensor(path[len(tokens) : len(tokens) + spec.block_size])  # B long: path runs on
        n = _accepted(block, verdict)
        tokens += verdict[: n + 1].tolist()
        accepted.append(n)
        context = _append(context, drafter.context_kv(states[:, length : length + n + 1],
                                                      positions[:, length : length + n + 1]))
        length += n + 1
        if any(t in stop_ids for t in tokens[-(n + 1) :]):
            break
    return Generation(_finish(tokens, max_new_tokens, stop_ids), time.perf_counter() - start, accepted)
