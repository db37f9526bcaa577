"""What each role does per second and per sample, and the split of a launch into extractors and trainers.

Rates come from, in order: the config (`extract.tokens_per_s`, `train.tokens_per_s`,
`data.generation.tokens_per_s`), `tune`'s measurements (OUTPUT/tune.json), else FLOP and bandwidth counts at an
assumed effective device throughput, each labelled with where it came from. `plan` shows them with every split of
the launch; `run` takes the split with the shortest estimated wall time for `roles.trainers: auto`
(`pipeline.roles.resolve_trainers` through `plan_roles`).
"""

from __future__ import annotations

from typing import Any

from dflash_stream.config import Config, ConfigError
from dflash_stream.sizing.inputs import plan_mean_tokens, read_tune
from dflash_stream.sizing.memory import (
    USABLE_FRACTION,
    TargetDims,
    device_memory,
    drafter_dims,
    records_while_generating,
    target_dims,
    target_dtype_bytes,
)
from dflash_stream.target_model.layers import stored_layer_ids
from dflash_stream.target_model.shape import TargetShape, target_shape
from dflash_stream.units import fmt_bytes, fmt_duration

# Effective (not peak) throughput of one process when nothing was measured: H100-class bf16 at ~40 % MFU,
# or two CPU cores (SmolLM2-135M forwards ~700 tokens/s there, `bench extract`).
ASSUMED_FLOPS = {"gpu": 4.0e14, "cpu": 1.9e11}
# Effective memory bandwidth of one process, for bandwidth-bound decoding: ~70 % of an H100's 3.35 TB/s HBM3
# (96 GB-class parts such as H100 NVL and GH200 are faster), or two-channel DDR on a CPU.
ASSUMED_BANDWIDTH = {"gpu": 2.4e12, "cpu": 2.0e10}
# Share of the ideal N-fold speed a server split over N GPUs (tensor parallel) reaches: the per-layer all-reduces.
TP_EFFICIENCY = 0.8
MEASURED_SERVER_RATE = "data.generation.tokens_per_s (measured, e.g. by `dflash-stream bench regenerate`)"
MEASURED_EXTRACTION_RATE = "extract.tokens_per_s (measured per vLLM server, e.g. by `dflash-stream bench extract`)"
PROMPT_SHARE = 1 / 3  # assumed prompt part of a regenerated sample's tokens (chat and code answers run long)


def device_kind(cfg: Config) -> str:
    return "cpu" if cfg.target.device == "cpu" else "gpu"


def estimated_rates(cfg: Config, shape: TargetShape, layer_ids: list[int], mean_tokens: float) -> dict[str, Any]:
    """Tokens/s of one extractor and one trainer from FLOP counts at an assumed effective device throughput."""
    kind = device_kind(cfg)
    flops = ASSUMED_FLOPS[kind]
    dims = target_dims(shape)
    # Early stop: the forward runs only up to the deepest captured layer (the last one with the verifier's
    # state), through each layer's active parameters (MoE: the routed experts top-k of n).
    deepest = max(stored_layer_ids(shape.num_layers, cfg.target, cfg.verifier_states))
    extract_per_token = 2 * dims.active_layer_parameters * (deepest + 1)
    drafter = drafter_dims(cfg, dims, len(layer_ids))
    d, vocab = drafter.hidden_size, dims.vocab_size
    blocks = min(cfg.train.num_anchors, mean_tokens)
    # Per block token: drafter layers forward+backward (6·P) and the frozen LM head: forward and the input's
    # gradient (4·V·D), and its logits once more in backward (2·V·D) unless a micro-batch's rows fit one chunk
    # of train.loss_chunk_rows and the loss is cross-entropy alone (`drafter/loss.py` then keeps the softmax).
    # A KL loss runs the head on the verifier's state too, in forward and again in backward (4·V·D).
    rows = max(1.0, cfg.train.batch_tokens / mean_tokens) * blocks * (cfg.drafter.block_size - 1)
    chunk_rows = cfg.train.loss_chunk_rows
    recomputed = cfg.train.loss != "ce" or (chunk_rows is not None and rows > chunk_rows)
    head = (6 if recomputed else 4) * vocab * d
    teacher = 4 * vocab * d if cfg.train.loss != "ce" else 0
    per_block_token = 6 * (drafter.linear_parameters - drafter.context_layers * d * d) + head + teacher
    per_sample = blocks * cfg.drafter.block_size * per_block_token + 6 * len(layer_ids) * shape.hidden_size * d * mean_tokens
    note = f"estimated: FLOP count at an assumed {flops / 1e12:g} TFLOP/s effective per {kind.upper()} process"
    return {
        "extract_tok_s": flops / extract_per_token,
        "train_tok_s": flops * mean_tokens / per_sample,
        "note": note + ("" if shape.vocab_size else f", vocab assumed {vocab:,}"),
    }


def _rate(cfg_value: float | None, tuned: float | None, estimate: float, tune_note: str, est_note: str
          ) -> tuple[float, str]:
    """The first known of: a configured throughput, tune's measurement, the FLOP estimate."""
    if cfg_value:
        return cfg_value, "config"
    if tuned:
        return tuned, tune_note
    return estimate, est_note


def regeneration_estimate(cfg: Config, dims: TargetDims, mean: float, kind: str) -> dict[str, Any]:
    """What regenerating the answers costs, by `data.generation.engine`: hf on the extractors
    (`seconds_per_sample` on one process, see `_hf_regeneration`), openai on the servers beside the launch
    (`seconds_per_sample` on all the endpoints together, see `_server_regeneration`)."""
    if cfg.data.generation.engine == "openai":
        return _server_regeneration(cfg, dims, mean, kind)
    return _hf_regeneration(cfg, dims, mean, kind)


def _hf_regeneration(cfg: Config, dims: TargetDims, mean: float, kind: str) -> dict[str, Any]:
    """Seconds per sample to regenerate its response on one process. Decoding is memory-bandwidth bound: each
    step reads all the weights and the batch's cache once, and yields one token per row of the batch. The cache
    follows the layer types: K/V on attention layers only (sliding ones up to their window), and on
    linear-attention layers a fixed-size state that each step reads and writes back."""
    gen = cfg.data.generation
    prompt = mean * PROMPT_SHARE
    steps = max(1.0, min(gen.max_new_tokens, cfg.data.max_length - prompt))
    dtype_bytes = target_dtype_bytes(cfg, kind)
    # All the weights: a MoE batch of rows x top-k routes touches most experts every step.
    weights = dims.num_parameters * dtype_bytes
    kv_read = gen.batch_size * dims.mean_kv_cache_bytes(prompt, prompt + steps, dtype_bytes)
    state_traffic = gen.batch_size * 2 * dims.state_bytes
    bandwidth, flops = ASSUMED_BANDWIDTH[kind], ASSUMED_FLOPS[kind]
    step = max((weights + kv_read + state_traffic) / bandwidth, 2 * dims.active_parameters * gen.batch_size / flops)
    prefill = prompt * 2 * dims.active_parameters / flops  # compute bound, like extraction
    records = cfg.extract.engine == "hf" and records_while_generating(gen.batch_size, round(prompt), round(steps),
                                                                      cfg.extract.batch_tokens)
    cache = f"the batch's mean KV cache ({fmt_bytes(kv_read)})"
    if state_traffic:
        cache += f" and its linear-attention state, read and written ({fmt_bytes(state_traffic)})"
    return {
        "engine": "hf", "seconds_per_sample": steps * step / gen.batch_size + prefill,
        "step_seconds": step, "decode_steps_per_batch": steps, "batch_size": gen.batch_size,
        "prompt_tokens": prompt, "response_tokens": mean - prompt,
        "weight_bytes": weights, "kv_bytes_read_per_step": kv_read, "state_bytes_per_step": state_traffic,
        "bandwidth_bytes_per_s": bandwidth,
        # The extractors keep the states as the answers decode: the first pass needs no capture forward.
        "records_states": records,
        "assumptions": [
            f"prompt/response split {PROMPT_SHARE:.0%}/{1 - PROMPT_SHARE:.0%} of the {mean:,.0f} tokens per sample "
            f"(prompt {prompt:,.0f}, response {mean - prompt:,.0f})",
            f"a batch of {gen.batch_size} decodes {steps:,.0f} steps (until its longest response: assumed to run "
            "to data.generation.max_new_tokens or max_length)",
            f"each step reads the weights ({fmt_bytes(weights)}) and {cache} at an assumed "
            f"{bandwidth / 1e12:g} TB/s effective per {kind.upper()} process",
            f"prefill compute bound at {flops / 1e12:g} TFLOP/s effective",
            "the states are kept as the answers decode (a batch's fit extract.batch_tokens): the first pass needs no "
            "capture forward" if records else
            "the states come from a capture forward after decoding (a batch's would not fit extract.batch_tokens)",
        ],
    }


def _server_regeneration(cfg: Config, dims: TargetDims, mean: float, kind: str) -> dict[str, Any]:
    """Regeneration on serving engines (engine openai): the endpoints generate `tokens_per_s` each, so all the
    answers take samples x response tokens / (tokens_per_s x endpoints); `seconds_per_sample` is that per
    sample, on all the endpoints together. tokens_per_s is data.generation.tokens_per_s when measured, else
    `_server_tokens_per_s`'s estimate."""
    gen = cfg.data.generation
    prompt = mean * PROMPT_SHARE
    response = mean - prompt
    endpoints = len(gen.endpoints)
    out: dict[str, Any] = {
        "engine": "openai", "endpoints": endpoints, "concurrency": gen.concurrency,
        "gpus_per_endpoint": gen.gpus_per_endpoint, "prompt_tokens": prompt, "response_tokens": response,
        "assumptions": [f"prompt/response split {PROMPT_SHARE:.0%}/{1 - PROMPT_SHARE:.0%} of the {mean:,.0f} "
                        f"tokens per sample (prompt {prompt:,.0f}, response {response:,.0f})"],
    }
    if gen.tokens_per_s:
        out.update(tokens_per_s=gen.tokens_per_s, tokens_per_s_source=MEASURED_SERVER_RATE)
    else:
        out.update(_server_tokens_per_s(cfg, dims, prompt, response, kind))
        out["assumptions"] += out.pop("estimate_assumptions")
    out["seconds_per_sample"] = response / (out["tokens_per_s"] * endpoints)
    return out


def _server_tokens_per_s(cfg: Config, dims: TargetDims, prompt: float, response: float, kind: str
                         ) -> dict[str, Any]:
    """Generated tokens/s of one endpoint, estimated like `_hf_regeneration` (bandwidth-bound decoding) but with
    a serving engine's continuous batching: every step decodes `concurrency` sequences (fewer when the server's
    memory holds fewer), a finished answer's slot is refilled at once, so no row waits for the batch's longest
    answer, and the paged KV cache holds what the running answers have, on average prompt + half an answer.
    Chunked prefill runs inside the decode steps: its FLOPs are added to theirs. A server spans
    `gpus_per_endpoint` devices of the launch's kind (tensor parallel: each reads its share of the weights and
    cache, at TP_EFFICIENCY for the all-reduces)."""
    gen = cfg.data.generation
    gpus = gen.gpus_per_endpoint
    dtype_bytes = target_dtype_bytes(cfg, kind)
    weights = dims.num_parameters * dtype_bytes
    kv_per_sequence = dims.mean_kv_cache_bytes(prompt, prompt + response, dtype_bytes)
    # The server keeps as many sequences running as its memory (after the weights) holds: vLLM's default
    # gpu_memory_utilization is the same 0.9 as the memory plan's usable share.
    device, device_source = device_memory(cfg, kind, None, 1)
    room = gpus * device * USABLE_FRACTION - weights
    fit = int(room // (kv_per_sequence + dims.state_bytes)) if room > 0 else 0
    running = max(1, min(gen.concurrency, fit))
    kv_read = running * kv_per_sequence
    state_traffic = running * 2 * dims.state_bytes
    efficiency = TP_EFFICIENCY if gpus > 1 else 1.0
    bandwidth, flops = ASSUMED_BANDWIDTH[kind] * gpus * efficiency, ASSUMED_FLOPS[kind] * gpus * efficiency
    # Per step: `running` tokens decoded, and the prefill of the answers they finish (running / response of them).
    step_flops = 2 * dims.active_parameters * running * (1 + prompt / response)
    step = max((weights + kv_read + state_traffic) / bandwidth, step_flops / flops)
    cache = f"the running answers' mean paged KV cache ({fmt_bytes(kv_read)})"
    if state_traffic:
        cache += f" and their linear-attention state, read and written ({fmt_bytes(state_traffic)})"
    per_device = f"{ASSUMED_BANDWIDTH[kind] / 1e12:g} TB/s and {ASSUMED_FLOPS[kind] / 1e12:g} TFLOP/s effective per "
    per_device += f"{kind.upper()} (a device of the launch's kind)"
    tp = f", {gpus} per server at {TP_EFFICIENCY:.0%} tensor-parallel efficiency" if gpus > 1 else ", one per server"
    running_note = (f"{running} sequences decoded per step (data.generation.concurrency)" if running == gen.concurrency
                    else f"{running} sequences decoded per step: the server's memory ({gpus} x {fmt_bytes(device)}, "
                    f"{device_source}) holds only {fit} of the {gen.concurrency} requests in flight beside the weights")
    return {
        "tokens_per_s": running / step,
        "tokens_per_s_source": "estimated (no data.generation.tokens_per_s; measure it with `dflash-stream bench "
                               "regenerate`)",
        "running_sequences": running, "sequences_that_fit": fit, "step_seconds": step, "weight_bytes": weights,
        "kv_bytes_read_per_step": kv_read, "state_bytes_per_step": state_traffic,
        "bandwidth_bytes_per_s": bandwidth, "weights_fit": room > 0,
        "estimate_assumptions": [
            f"continuous batching: {running_note}; no padding to the longest answer",
            f"each step reads the weights ({fmt_bytes(weights)}) and {cache}, with chunked prefill's FLOPs, at "
            f"{per_device}{tp}",
        ],
    }


def forward_passes(passes: int, regen: dict[str, Any] | None) -> int:
    """How many of `passes` extraction passes run the capture forward: all, but the first when the answers' states
    are kept as they decode (`_hf_regeneration`'s records_states)."""
    return passes - (1 if regen and regen.get("records_states") else 0)


def role_work(cfg: Config, shape: TargetShape, layer_ids: list[int], mean: float, tune: dict | None
              ) -> dict[str, Any]:
    """Per-process rates of each role and the seconds of work one sample costs each role on one process."""
    est = estimated_rates(cfg, shape, layer_ids, mean)
    tune_note = f"measured by tune ({tune.get('device', '?')})" if tune else ""
    served = served_extraction(cfg, target_dims(shape), device_kind(cfg))
    if served["engine"] == "vllm":  # the servers' rate, whatever the number of extractors asking them
        ext_rate, ext_src = served["tokens_per_s_per_server"], served["tokens_per_s_source"]
        tune = None if tune is None else {k: v for k, v in tune.items() if k != "extract_tok_s"}
    else:
        ext_rate, ext_src = _rate(cfg.extract.tokens_per_s, (tune or {}).get("extract_tok_s"),
                                  est["extract_tok_s"], tune_note, est["note"])
    train_rate, train_src = _rate(cfg.train.tokens_per_s, (tune or {}).get("train_tok_s"),
                                  est["train_tok_s"], tune_note, est["note"])
    regen = regeneration_estimate(cfg, target_dims(shape), mean, device_kind(cfg)) if cfg.data.regenerate else None
    # Engine hf decodes on the extractors; engine openai on the servers beside the launch, so the split of the
    # launch is chosen without it (`_time_plan` overlaps it with extraction).
    on_extractors = regen["seconds_per_sample"] if regen and regen["engine"] == "hf" else 0.0
    # With engine vllm all the servers extract for however many extractors ask them.
    servers = served["servers"] if served["engine"] == "vllm" else 1
    return {
        "extract_tok_s": ext_rate, "extract_source": ext_src, "train_tok_s": train_rate, "train_source": train_src,
        "regenerate": regen, "extract": served,
        # One sample's work per role on one process: regeneration happens once (responses are cached), the
        # forward once per extraction pass that needs it, the drafter step once per epoch.
        "extractor_seconds_per_sample": on_extractors + mean * forward_passes(cfg.extraction_passes, regen) / (ext_rate * servers),
        "trainer_seconds_per_sample": mean * cfg.train.epochs / train_rate,
    }


def served_extraction(cfg: Config, dims: TargetDims, kind: str) -> dict[str, Any]:
    """Where the states are computed. Engine hf: in the extractors. Engine vllm: on extract.endpoints' servers of
    tensor_parallel_size GPUs each, at extract.tokens_per_s per server when measured, else prefill at an assumed
    effective FLOP rate through every layer (vLLM runs the whole forward: no early stop after the deepest captured
    layer), the servers' devices of the launch's kind, at TP_EFFICIENCY when split over several."""
    ext = cfg.extract
    if ext.engine != "vllm":
        return {"engine": "hf", "servers": 0, "tensor_parallel_size": 1, "spool_bytes": 0}
    tp, servers = ext.tensor_parallel_size, len(ext.endpoints)
    if ext.tokens_per_s:
        rate, source = ext.tokens_per_s, MEASURED_EXTRACTION_RATE
    else:
        efficiency = TP_EFFICIENCY if tp > 1 else 1.0
        rate = ASSUMED_FLOPS[kind] * tp * efficiency / (2 * dims.active_layer_parameters * dims.num_layers)
        source = (f"estimated per vLLM server: the whole forward at an assumed {ASSUMED_FLOPS[kind] / 1e12:g} TFLOP/s "
                  f"effective per {kind.upper()}" + (f" x {tp} at {TP_EFFICIENCY:.0%} tensor-parallel efficiency"
                                                     if tp > 1 else "") + " (measure it: `bench extract`)")
    gen = cfg.data.generation
    shared = cfg.data.regenerate and gen.engine == "openai" and bool(set(gen.endpoints) & set(ext.endpoints))
    return {"engine": "vllm", "servers": servers, "tensor_parallel_size": tp, "spool_bytes": int(ext.spool_bytes),
            "serving_gpus": servers * tp, "tokens_per_s_per_server": rate, "tokens_per_s_source": source,
            "regenerates_too": shared}


def split_alternatives(processes: int, extract_seconds: float, train_seconds: float, extractors_share: bool = True
                       ) -> list[dict[str, Any]]:
    """Wall time of every split of `processes`. `extract_seconds` and `train_seconds` are the whole run's work
    of each role on one process (regeneration included with engine hf); a role's processes share it evenly (data shards for
    extractors, data parallelism for trainers), and the slower role sets the pace. Without `extractors_share`
    (engine vllm: the servers do the work) more extractors do not make extraction faster."""
    return [
        {"extractors": processes - t, "trainers": t,
         "wall_seconds": max(extract_seconds / (processes - t if extractors_share else 1), train_seconds / t)}
        for t in range(1, processes)
    ]


def best_split(alternatives: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest split; on a tie the one with fewer trainers (fewer ranks in the trainers' collectives)."""
    return min(alternatives, key=lambda a: (round(a["wall_seconds"], 6), a["trainers"]))


def split_plan(cfg: Config, processes: int, work: dict[str, Any], samples: int | None) -> dict[str, Any]:
    """The roles of a launch of `processes`: the chosen split, and the wall time of every split."""
    scale = samples or 1  # the best split depends only on the ratio of the roles' work
    ext, train = work["extractor_seconds_per_sample"] * scale, work["trainer_seconds_per_sample"] * scale
    source = f"extract {work['extract_source']}; train {work['train_source']}"
    if processes == 1 or cfg.roles.mode == "single":
        return {"mode": "single", "extractors": 1, "trainers": 1, "chosen_by": "one process alternates",
                "wall_seconds": ext + train if samples else None, "alternatives": [], "source": source}
    alternatives = split_alternatives(processes, ext, train, extractors_share=work["extract"]["engine"] == "hf")
    best = best_split(alternatives)
    configured = cfg.roles.trainers
    chosen = best if configured == "auto" else next((a for a in alternatives if a["trainers"] == configured), None)
    if chosen is None:
        raise ConfigError(f"roles.trainers={configured} leaves no extractor in a launch of {processes} process(es); "
                          f"allowed: 1..{processes - 1} or auto")
    out = {"mode": "split", "extractors": chosen["extractors"], "trainers": chosen["trainers"],
           "chosen_by": "roles.trainers: auto (shortest wall time)" if configured == "auto" else "roles.trainers",
           "wall_seconds": chosen["wall_seconds"] if samples else None,
           "alternatives": [{**a, "wall_seconds": a["wall_seconds"] if samples else None} for a in alternatives],
           "best_trainers": best["trainers"], "source": source}
    out["alternatives_relative"] = [a["wall_seconds"] / best["wall_seconds"] for a in alternatives]
    if chosen is not best and chosen["wall_seconds"] > best["wall_seconds"] * 1.05:
        out["better"] = (f"roles.trainers={configured} takes {_fmt_relative(chosen, best, samples)}; "
                         f"{best['trainers']} trainer(s) would be faster (set roles.trainers: auto)")
    return out


def _fmt_relative(chosen: dict, best: dict, samples: int | None) -> str:
    if samples:
        return f"{fmt_duration(chosen['wall_seconds'])} against {fmt_duration(best['wall_seconds'])}"
    return f"{chosen['wall_seconds'] / best['wall_seconds']:.1f}x as long"


def plan_roles(cfg: Config, processes: int, allow_download: bool = False) -> dict[str, Any]:
    """The split `plan` would choose for a launch of `processes` (what `run` uses for roles.trainers: auto)."""
    from dflash_stream.target_model import resolve_layer_ids

    shape = target_shape(cfg.target, download=allow_download)
    layer_ids = resolve_layer_ids(shape.num_layers, cfg.target)
    tune, _ = read_tune(cfg, shape, layer_ids)
    mean, _ = plan_mean_tokens(cfg, None, tune)
    return split_plan(cfg, processes, role_work(cfg, shape, layer_ids, mean, tune), None)
