"""τ as SGLang measures it: the exported drafter served as SGLang's DFLASH draft model, at a server the user started.

The same prompts as our own eval (token ids rendered by our encoder, sent to SGLang's native `/generate` as
`input_ids`), the same token budget, greedy, one request at a time. SGLang counts per request, in the answer's
`meta_info`: verification steps (`spec_verify_ct`), drafted tokens the target accepted (`spec_num_correct_drafts`)
and the steps by how many they accepted (`spec_correct_drafts_histogram`); τ = 1 + accepted / steps, as for vLLM
(`served.acceptance_figures`). Being per request, the counts need no idle server. `/server_info` says which
speculator the server runs and how many tokens it verifies per step: a server that is not drafting with DFLASH in
blocks of this drafter's size is refused.

SGLang has no CPU build that drafts with DFLASH (0.5.23 refuses the device), so this is for a server on a GPU;
`docs/engines.md` has the one check made here, on a CPU SGLang patched to run.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from dflash_stream.config import TargetConfig
from dflash_stream.drafter.served import (
    EngineError,
    ServedEval,
    histogram_figures,
)
from dflash_stream.log import get_logger

log = get_logger(__name__)

REQUEST_TIMEOUT_S = 900.0
"""One answer of the eval's budget; a server on a busy GPU may queue it."""


def sglang_eval(job: ServedEval, endpoint: str, block_size: int, max_new_tokens: int) -> dict[str, Any]:
    """The drafter's τ in the SGLang server at `endpoint` (its base URL, with or without /v1), which the user started
    with this drafter as its DFLASH draft model: the entry `vllm_eval` gives, with `draft_model` as the server
    names it."""
    root = server_root(endpoint)
    draft_model = check_server(root, block_size)
    notes = sglang_notes(job.target)
    for note in notes.values():
        log.warning("eval: %s", note)
    _generate(root, job.prompts[0], 2, job.stops)  # warm-up: one-off start-up costs land outside the timing
    histogram, new_tokens, seconds, prompts = [0] * block_size, 0, 0.0, []
    for index, ids in enumerate(job.prompts):
        started = time.perf_counter()
        tokens, info = _generate(root, ids, max_new_tokens, job.stops)
        seconds += time.perf_counter() - started
        steps, hits, counts = spec_counts(info, block_size, index)
        for n, c in enumerate(counts):
            histogram[n] += c
        new_tokens += len(tokens)
        prompts.append({"index": index, "verify_steps": steps, "accepted": hits,
                        "as_target": tokens == job.references[index], "answer": tokens})
    same = sum(p["as_target"] for p in prompts)
    return {**histogram_figures(histogram),  # spec_counts checked each answer's steps and accepted against it
            "new_tokens": new_tokens, "matches_target": same == len(job.references), "answers_as_target": same,
            "seconds": round(seconds, 3), "tokens_per_s": round(new_tokens / seconds, 2) if seconds else None,
            "prompts": prompts, "server": endpoint, "draft_model": draft_model, **({"notes": notes} if notes else {})}


def sglang_notes(target: TargetConfig) -> dict[str, str]:
    """Where SGLang serves the target otherwise than it is, by kind: `sliding_target`, a target whose every layer
    slides, which SGLang 0.5.23's Llama, Mistral, Qwen2 and StarCoder2 models run without a window (a tiny
    Mistral of window 16: its answers were those of the same model without the window, from the first token on)."""
    from dflash_stream.target_model.shape import target_shape

    shape = target_shape(target, download=True, count=False)  # eval has loaded the target: its config is here
    if not shape.slides_everywhere:
        return {}
    return {"sliding_target": f"every layer of the target is sliding-window (window {shape.sliding_window}): "
                              "SGLang 0.5.23's Llama, Mistral, Qwen2 and StarCoder2 models attend without a window, so "
                              "past it SGLang's answers, and the tau drafted on them, are another model's"}


def server_root(endpoint: str) -> str:
    """`http(s)://host:port` of a base URL: SGLang's native API lives at the root, its OpenAI one under /v1."""
    parts = urlsplit(endpoint)
    return f"{parts.scheme}://{parts.netloc}"


def check_server(root: str, block_size: int) -> str:
    """The draft model the server names, once it is known to draft with DFLASH in blocks of `block_size`."""
    try:
        info = _get(root, "/server_info")
    except EngineError:  # SGLang before /server_info (0.5.x) answers the same at /get_server_info
        info = _get(root, "/get_server_info")
    algorithm, tokens = info.get("speculative_algorithm"), info.get("speculative_num_draft_tokens")
    if str(algorithm).upper() != "DFLASH":
        raise EngineError(f"eval --engine sglang: the server at {root} drafts with {algorithm}, not DFLASH: start it "
                          "with --speculative-algorithm DFLASH --speculative-draft-model-path DRAFTER")
    if tokens != block_size:
        raise EngineError(f"eval --engine sglang: the server at {root} verifies {tokens} tokens per step, this "
                          f"drafter's block is {block_size}: serve it with --speculative-num-draft-tokens "
                          f"{block_size}")
    return str(info.get("speculative_draft_model_path"))


def spec_counts(info: dict[str, Any], block_size: int, index: int) -> tuple[int, int, list[int]]:
    """(verification steps, accepted drafted tokens, steps by tokens accepted 0 .. B-1) of one answer's meta_info."""
    try:
        steps, accepted = int(info["spec_verify_ct"]), int(info["spec_num_correct_drafts"])
        counts = [int(c) for c in info.get("spec_correct_drafts_histogram") or []]
    except (KeyError, TypeError, ValueError):
        raise EngineError(f"eval --engine sglang: prompt {index}'s meta_info has no spec_verify_ct and "
                          "spec_num_correct_drafts: the server drafts nothing") from None
    if len(counts) > block_size or sum(counts) != steps or sum(n * c for n, c in enumerate(counts)) != accepted:
        raise EngineError(f"eval --engine sglang: prompt {index}'s counts do not add up for a block of {block_size} "
                          f"({steps} steps, {accepted} accepted, histogram {counts})")
    return steps, accepted, counts + [0] * (block_size - len(counts))


def _generate(root: str, ids: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], dict[str, Any]]:
    """(the answer's token ids, stop token included as our loop keeps it; its meta_info) for one greedy request."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                  "stop_token_ids": sorted(stops), "skip_special_tokens": False}}
    answer = _post(root, "/generate", body)
    try:
        tokens, info = [int(t) for t in answer["output_ids"]][:max_new_tokens], dict(answer["meta_info"])
    except (KeyError, TypeError, ValueError):
        raise EngineError(f"eval --engine sglang: {root}/generate gave no output_ids and meta_info: "
                          f"{str(answer)[:200]!r}") from None
    finish = info.get("finish_reason") or {}
    matched = finish.get("matched") if isinstance(finish, dict) else None
    if isinstance(matched, int) and matched in stops and (not tokens or tokens[-1] != matched):
        tokens.append(matched)  # SGLang 0.5.23 keeps it in output_ids, as our loop does; a server that does not
    return tokens, info


def _get(root: str, path: str) -> dict[str, Any]:
    return _json(root + path, lambda url: httpx.get(url, timeout=30.0))


def _post(root: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return _json(root + path, lambda url: httpx.post(url, json=body, timeout=REQUEST_TIMEOUT_S))


def _json(url: str, call) -> dict[str, Any]:
    try:
        response = call(url)
    except httpx.HTTPError as err:
        raise EngineError(f"eval --engine sglang: cannot reach {url}: {type(err).__name__}: {err}") from None
    if response.status_code != 200:
        raise EngineError(f"eval --engine sglang: {url} answered HTTP {response.status_code}: "
                          f"{response.text[:200]!r}")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise EngineError(f"eval --engine sglang: {url} did not answer a JSON object: {response.text[:200]!r}")
    return body
