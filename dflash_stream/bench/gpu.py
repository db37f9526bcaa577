"""`dflash-stream bench gpu`: every CUDA path of the project on one GPU, each figure beside its baseline.

The target is a bundled Qwen3-class config (`bench/targets/qwen3-4b.json`, 4.0B parameters) with random weights,
built on the device (no download); the data are the bundled demo files, tokenized by a BPE tokenizer trained on
them (`bench/synthetic.py`). Throughput and memory depend on shapes, not on weight values. Measured:

- extraction: capture hooks + early stop vs a full `output_hidden_states` forward (tok/s, MFU), and how long a
  real `Extractor` into a real store waits on the store, at a forward budget sized from measured peaks;
- device-to-host copies of the captured states: side stream + pinned + non_blocking (what the extractor does)
  vs synchronous `.cpu()` copies, and vs a non_blocking copy on the forward's own stream;
- the drafter's training step: compiled FlexAttention vs eager SDPA (tok/s, MFU, peak memory, the bf16 loss of
  the same first step within `LOSS_RTOL`), and with the chunked LM-head loss when the loss offers one;
- a short `dflash-stream run` with `roles.mode: single` on the GPU: regeneration, extraction, training,
  export, speculative eval, and `audit` ok;
- with `--hybrid` (or alone, `--hybrid-only`): a Qwen3.5/3.6-27B-shaped hybrid target (`bench/targets/
  qwen3.5-27b.json`: 48 Gated-DeltaNet + 16 attention layers, 26.9B parameters, random bf16 weights on one
  H200), extraction and regeneration tok/s with the Gated-DeltaNet kernels (flash-linear-attention,
  causal-conv1d: whichever import) and with them blocked (transformers' torch path), each in a child process.

MFU = model FLOPs / time / `PEAK_BF16_FLOPS`. Forward FLOPs are 2 x multiply-adds of the matmuls that run
(early stop: only the layers up to the deepest captured one) plus causal attention pairs; a training step counts
3 x the drafter's forward and 2 x the frozen LM head (no weight gradient), attention over the pairs its mask allows.

`--rehearse` runs the same code on the CPU with tiny shapes (no CUDA-only part, figures meaningless): a check
of the bench itself where no GPU is at hand.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger, setup_logging

log = get_logger("bench.gpu")

PEAK_BF16_FLOPS = 790e12
"""Dense bf16 matmul peak of the H200 on the GPU machine, as measured there (issue 15)."""
LOSS_RTOL = 2e-2
"""Flex vs SDPA, same weights, same anchors, bf16 autocast: the losses agree to this relative tolerance (both
accumulate in float32; they differ in the order of bf16 roundings only)."""
MEMORY_SHARE = 0.6
"""Share of the device's memory the extraction forward may take at its chosen budget (the rest: the trainer's
side of a single-process run, the allocator's slack)."""
MIN_BATCHES = 8
DEMO_SOURCES = ["sharegpt_chats.jsonl", "openai_messages.jsonl", "alpaca_tasks.json", "mixed_formats.jsonl"]
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 8192}
"""--rehearse shapes (the vocabulary still holds every id of the bench tokenizer)."""


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu", help="every CUDA path on one GPU: extraction, D2H copies, flex vs SDPA step, a run")
    p.add_argument("--target", default="qwen3-4b", help="bundled target config (dflash_stream/bench/targets)")
    p.add_argument("--copies", type=float, default=8.0, help="copies of each demo row (data.sources weight)")
    p.add_argument("--extract-batch-tokens", type=int, default=None, help="default: sized from measured peaks")
    p.add_argument("--train-batch-tokens", type=int, default=4096)
    p.add_argument("--num-anchors", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="timed training steps per variant")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per extraction variant (best is kept)")
    p.add_argument("--skip-run", action="store_true", help="leave out the combined `run`")
    p.add_argument("--run-attention", choices=["auto", "flex", "sdpa"], default="sdpa",
                   help="drafter.attention of the combined run (sdpa: no compile per batch shape; see issue 17)")
    p.add_argument("--workdir", default=None, help="where the store and the run go (default: a temporary folder)")
    p.add_argument("--hybrid", action="store_true",
                   help=f"also the {HYBRID_TARGET} hybrid target: extraction and regeneration with and without the "
                        "Gated-DeltaNet kernels (two child processes, ~2 x 1 min on an H200)")
    p.add_argument("--hybrid-only", action="store_true", help="only the hybrid target's section")
    p.add_argument("--rehearse", action="store_true", help="on the CPU with tiny shapes: checks the bench itself")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=bench_gpu)


# ---------------------------------------------------------------------------------------------------- FLOPs
def _layer_matmul_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate


def target_forward_flops(config, lengths: list[int], layers_run: int, lm_head: bool) -> float:
    """FLOPs of a causal forward over samples of `lengths` tokens through `layers_run` decoder layers."""
    per_layer = _layer_matmul_params(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim, config.intermediate_size)
    tokens = sum(lengths)
    pairs = sum(t * (t + 1) // 2 for t in lengths)
    flops = layers_run * (2 * per_layer * tokens + 4 * config.num_attention_heads * config.head_dim * pairs)
    if lm_head:
        flops += 2 * config.hidden_size * config.vocab_size * tokens
    return float(flops)


def drafter_step_flops(spec, context_tokens: int, anchors: torch.Tensor, valid: torch.Tensor,
                       supervised_rows: int) -> float:
    """FLOPs of one training step on a padded batch: context [N, S] (`context_tokens` = N x S), anchors [N, A]."""
    d, h, g, dh = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    b, layers = spec.block_size, spec.num_layers
    queries = anchors.numel() * b
    per_layer = _layer_matmul_params(d, h, g, dh, spec.intermediate_size)
    forward = 2 * spec.num_context_layers * d * d * context_tokens  # fc over the concatenated target layers
    forward += layers * 2 * (2 * d * g * dh) * context_tokens  # k/v of the context
    forward += layers * 2 * per_layer * queries  # the block tokens through whole layers
    keys = int(((anchors + b) * valid).sum()) * b  # query-key pairs the mask allows (valid blocks)
    forward += layers * 4 * h * dh * keys
    head = 2 * d * spec.vocab_size * supervised_rows
    return float(3 * forward + 2 * head)


# ------------------------------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _mfu(flops: float, seconds: float) -> float:
    return round(flops / seconds / PEAK_BF16_FLOPS, 4)


def _config_tree(args: argparse.Namespace, work: Path, target_dir: str, device: torch.device) -> dict[str, Any]:
    from dflash_stream.bench.synthetic import DEMO_DATA

    return {
        "output_dir": str(work / "bench"),
        "target": {"model": target_dir, "device": str(device), "dtype": "float32" if args.rehearse else "bfloat16"},
        "data": {"sources": [{"path": str(DEMO_DATA / name), "weight": args.copies} for name in DEMO_SOURCES]},
        "extract": {"batch_tokens": args.extract_batch_tokens or 4096},
        "store": {"path": str(work / "bench" / "store"), "budget": "16GB", "segment_bytes": "64MiB"},
        "drafter": {"num_layers": 1 if args.rehearse else 5},
        "train": {"batch_tokens": args.train_batch_tokens, "num_anchors": args.num_anchors},
    }


# --------------------------------------------------------------------------------------------- extraction
def _batch(samples, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask of samples, on the device."""
    import numpy as np

    width = max(s.num_tokens for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : s.num_tokens] = torch.from_numpy(s.input_ids.astype(np.int64))
        mask[row, : s.num_tokens] = 1
    return ids.to(device), mask.to(device)


def _budget_batches(samples, budget: int, device: torch.device) -> list[tuple[list, torch.Tensor, torch.Tensor]]:
    from dflash_stream.data import token_budget_batches

    ordered = sorted(samples, key=lambda s: -s.num_tokens)
    groups = token_budget_batches([s.num_tokens for s in ordered], budget)
    return [([ordered[i] for i in g], *_batch([ordered[i] for i in g], device)) for g in groups]


def choose_batch_tokens(capture, samples, device: torch.device) -> tuple[int, str]:
    """The extraction forward's token budget: peaks measured at two budgets, fitted linearly in the budget, and
    the largest power of two whose predicted peak stays within MEMORY_SHARE of the device, capped so that the
    data still make several batches (overlap and queueing need more than one).

    Issue 10's memory model (plan's `memory.extractor`) is the intended source of this figure; it is not on
    main yet, so the bench measures instead and says so.
    """
    if device.type != "cuda":
        return 4096, "default (no CUDA memory to size against)"
    sizes, peaks = (4096, 8192), []
    for size in sizes:
        _, ids, mask = _budget_batches(samples, size, device)[0]
        torch.cuda.empty_cache()
        _reset_peak(device)
        capture(ids, mask)
        _sync(device)
        peaks.append(_peak(device))
    slope = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
    total = torch.cuda.get_device_properties(device).total_memory
    cap = max(sizes[0], sum(s.num_tokens for s in samples) // MIN_BATCHES)
    budget = sizes[0]
    while 2 * budget <= cap and peaks[0] + slope * (2 * budget - sizes[0]) <= MEMORY_SHARE * total:
        budget *= 2
    return budget, (f"measured peaks {peaks[0] / 2**30:.2f} / {peaks[1] / 2**30:.2f} GiB at {sizes[0]} / {sizes[1]} "
                    f"tokens, linear fit, largest power of two within {MEMORY_SHARE:.0%} of {total / 2**30:.0f} GiB "
                    f"and at most 1/{MIN_BATCHES} of the data")


def bench_extraction(model, config, capture, layer_ids, samples, budget, repeats, device) -> dict[str, Any]:
    batches = _budget_batches(samples, budget, device)
    lengths = [s.num_tokens for s in samples]
    tokens = sum(lengths)

    @torch.inference_mode()
    def full_forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16)

    def loop(fn) -> Callable[[], None]:
        return lambda: [fn(ids, mask) for _, ids, mask in batches]

    for fn in (capture, full_forward):  # warm-up: kernels, allocator
        fn(*batches[0][1:])
    _reset_peak(device)
    hooks = min(_timed(loop(capture), device) for _ in range(repeats))
    hooks_peak = _peak(device)
    _reset_peak(device)
    full = min(_timed(loop(full_forward), device) for _ in range(repeats))
    full_peak = _peak(device)
    hooks_flops = target_forward_flops(config, lengths, max(layer_ids) + 1, lm_head=False)
    full_flops = target_forward_flops(config, lengths, config.num_hidden_layers, lm_head=True)
    return {
        "batch_tokens": budget, "batches": len(batches), "tokens": tokens,
        "hooks_tok_s": round(tokens / hooks, 1), "full_forward_tok_s": round(tokens / full, 1),
        "speedup": round(full / hooks, 3),
        "hooks_mfu": _mfu(hooks_flops, hooks), "full_forward_mfu": _mfu(full_flops, full),
        "hooks_peak_bytes": hooks_peak, "full_forward_peak_bytes": full_peak,
    }


def bench_store_wait(cfg, model, tokenizer, device) -> dict[str, Any]:
    """A real Extractor (forward loop, sink thread, encoding, store writes) into a real store with room."""
    from dflash_stream.observe.metrics import MetricsWriter
    from dflash_stream.pipeline.common import open_store
    from dflash_stream.pipeline.extractor import Extractor
    from dflash_stream.pipeline.roles import RoleInfo
    from dflash_stream.target_model import resolve_layer_ids

    layer_ids = resolve_layer_ids(model.config.num_hidden_layers, cfg.target)
    store = open_store(cfg, layer_ids, model.config.hidden_size)
    metrics = MetricsWriter(cfg.output_dir, "extractor", 0)
    try:
        extractor = Extractor(cfg, RoleInfo("extractor", 0, 1, 0, 1), store, metrics, device, target=(model, tokenizer))
        extractor.run()
        extractor.capture.close()
    finally:
        metrics.close()
    status = store.status()
    shutil.rmtree(cfg.store.path, ignore_errors=True)
    return {
        "extract_tok_s": round(extractor.tokens_written / extractor.extract_seconds, 1),
        "store_wait_seconds": round(extractor.backpressure_seconds, 3),
        "store_wait_fraction": round(extractor.backpressure_seconds / extractor.extract_seconds, 4),
        "store_bytes": status["used_bytes"], "codec": cfg.store.codec,
    }


# ------------------------------------------------------------------------------------------ host copies
def bench_host_copies(capture, samples, budget, repeats, device, queue_size: int) -> dict[str, Any]:
    """Forward + copy of every batch, three ways; at most `queue_size` copies in flight (the extractor's queue)."""
    from dflash_stream.target_model.host_copy import HostCopier

    batches = _budget_batches(samples, budget, device)
    tokens = sum(s.num_tokens for group, _, _ in batches for s in group)
    copier = HostCopier(device)
    last: dict[str, torch.Tensor] = {}

    def run(mode: str) -> None:
        in_flight: list[tuple[torch.Tensor, Any]] = []
        for _, ids, mask in batches:
            states = capture(ids, mask)
            if mode == "synchronous":
                host, ready = states.cpu(), None
            elif mode == "forward_stream":
                host = states.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host, ready = copier.copy(states)
            in_flight.append((host, ready))
            if len(in_flight) > queue_size:
                _wait(in_flight.pop(0))
            last[mode] = host
        for item in in_flight:
            _wait(item)
        if mode == "side_stream":
            last["check"] = states.cpu()

    def _wait(item: tuple[torch.Tensor, Any]) -> None:
        if item[1] is not None:
            item[1].synchronize()

    modes = ["synchronous", "side_stream"] + (["forward_stream"] if device.type == "cuda" else [])
    run(modes[0])  # warm-up: the pinned blocks get allocated
    run(modes[1])
    seconds = {m: min(_timed(lambda m=m: run(m), device) for _ in range(repeats)) for m in modes}
    bytes_per_batch = max(b[1].numel() for b in batches) * last["check"].shape[-1] * 2
    out = {f"{m}_tok_s": round(tokens / s, 1) for m, s in seconds.items()}
    out.update({
        "speedup": round(seconds["synchronous"] / seconds["side_stream"], 3),
        "copies_equal": bool(torch.equal(last["side_stream"], last["check"])),
        "largest_copy_bytes": bytes_per_batch, "in_flight": queue_size,
    })
    return out


# ----------------------------------------------------------------------------------------- training step
def _loss_variants() -> tuple[dict[str, Any], dict[str, Any] | None]:
    """HOOK (issue 10): `dflash_loss` keyword arguments for the plain LM-head loss and for the chunked one (None
    while the loss has no chunking). Issue 10 adds `chunk_rows` (None = one pass over all rows)."""
    from dflash_stream.drafter import dflash_loss

    if "chunk_rows" in inspect.signature(dflash_loss).parameters:
        from dflash_stream.drafter import loss

        return {"chunk_rows": None}, {"chunk_rows": getattr(loss, "DEFAULT_CHUNK_ROWS", 2048)}
    return {}, None


def _train_batch(capture, samples, budget: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One training micro-batch as the trainer builds it (similar lengths, from the median length up), with
    states captured by the target now."""
    ordered = sorted(samples, key=lambda s: s.num_tokens)
    chosen, width = [], 0
    for s in ordered[len(ordered) // 2:] + ordered[: len(ordered) // 2][::-1]:
        if chosen and (len(chosen) + 1) * max(width, s.num_tokens) > budget:
            break
        chosen.append(s)
        width = max(width, s.num_tokens)
    ids, mask = _batch(chosen, device)
    states = capture(ids, mask).clone()  # a normal tensor: autograd may not save inference-mode ones
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, s in enumerate(chosen):
        loss_mask[row, : s.num_tokens] = torch.from_numpy(s.loss_mask).to(device)
    lengths = torch.tensor([s.num_tokens for s in chosen], device=device)
    return {"hidden_states": states, "input_ids": ids, "loss_mask": loss_mask, "lengths": lengths}


def bench_train_step(spec, head, batch, initial: dict, variant: str, steps: int, num_anchors: int,
                     bf16: bool, device: torch.device, loss_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`steps` timed optimizer steps of a fresh drafter (weights `initial`), after one untimed (compiling) step."""
    from dflash_stream.drafter import DFlashDrafter, dflash_loss, sample_anchors

    drafter = DFlashDrafter(spec, attention=variant).to(device)
    drafter.load_state_dict(initial)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    generator = torch.Generator(device=device)

    def step() -> tuple[float, int]:
        generator.manual_seed(0)  # the same anchors every step and in every variant
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = dflash_loss(drafter, head, batch, num_anchors=num_anchors, gamma=7.0, generator=generator,
                              **loss_kwargs)
        (out.loss * out.weight).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(out.loss.detach()), int(out.count.sum())

    _sync(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    started = time.perf_counter()
    first_loss, rows = step()
    _sync(device)
    first_seconds = time.perf_counter() - started
    _reset_peak(device)
    seconds = _timed(lambda: [step() for _ in range(steps)], device) / steps
    peak = _peak(device)
    anchors, valid = sample_anchors(batch["loss_mask"].bool(), num_anchors, generator.manual_seed(0))
    flops = drafter_step_flops(spec, batch["input_ids"].numel(), anchors, valid, rows)
    tokens = int(batch["lengths"].sum())
    return {
        "first_step_seconds": round(first_seconds, 2), "step_seconds": round(seconds, 4),
        "tok_s": round(tokens / seconds, 1), "mfu": _mfu(flops, seconds), "first_loss": first_loss,
        "peak_bytes": peak, "step_working_set_bytes": None if peak is None else peak - before,
    }


def bench_training(capture, model, cfg, config, layer_ids, tokenizer, samples, args, device) -> dict[str, Any]:
    from dflash_stream.drafter import DFlashDrafter, TargetHead, build_spec
    from dflash_stream.target_model import shape_from_config

    spec = build_spec(cfg, shape_from_config(config, "bench", count=False), layer_ids, tokenizer)
    head = TargetHead.from_model(model)
    batch = _train_batch(capture, samples, args.train_batch_tokens, device)
    torch.manual_seed(0)
    initial = copy.deepcopy(DFlashDrafter(spec).state_dict())
    bf16 = device.type == "cuda"
    plain, chunk = _loss_variants()
    variants = {"sdpa_eager": ("sdpa", plain)}
    if device.type == "cuda":  # FlexAttention has no CPU backward
        variants = {"flex_compiled": ("flex", plain), **variants}
    if chunk is not None:
        variants.update({f"{name}_chunked_loss": (attn, chunk) for name, (attn, _) in list(variants.items())})
    results = {}
    for name, (attention, kwargs) in variants.items():
        log.info("training step: %s", name)
        try:
            results[name] = bench_train_step(spec, head, batch, initial, attention, args.steps, args.num_anchors,
                                             bf16, device, kwargs)
        except torch.OutOfMemoryError as err:  # a figure too: the unchunked LM-head loss at this batch
            results[name] = {"out_of_memory": str(err).splitlines()[0][:200], "peak_bytes": _peak(device)}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out: dict[str, Any] = {
        "batch": {"samples": int(batch["input_ids"].shape[0]), "context_width": int(batch["input_ids"].shape[1]),
                  "tokens": int(batch["lengths"].sum()), "num_anchors": args.num_anchors,
                  "block_size": spec.block_size, "drafter_layers": spec.num_layers},
        "autocast_bf16": bf16, "variants": results,
        "chunked_loss": chunk if chunk is not None else "not available: issue 10's chunked loss is not in "
                                                        "drafter/loss.py yet (hook: bench/gpu.py _loss_variants)",
    }
    flex, sdpa = results.get("flex_compiled", {}), results["sdpa_eager"]
    if "first_loss" in flex and "first_loss" in sdpa:
        rel = abs(flex["first_loss"] - sdpa["first_loss"]) / abs(sdpa["first_loss"])
        out.update({"flex_vs_sdpa_speedup": round(sdpa["step_seconds"] / flex["step_seconds"], 3),
                    "loss_rel_diff": round(rel, 6), "loss_rtol": LOSS_RTOL, "loss_equal": rel <= LOSS_RTOL})
    return out


# ------------------------------------------------------------------------------------------- combined run
def bench_run(args: argparse.Namespace, work: Path, tokenizer, device: torch.device) -> dict[str, Any]:
    """`dflash-stream run` in a child process, roles.mode single, on a shallow copy of the target saved to disk."""
    from dflash_stream.bench.synthetic import DEMO_DATA, save_target, target_config
    from dflash_stream.pipeline.audit import audit_run

    shallow = {**(TINY if args.rehearse else {}), "num_hidden_layers": 8}
    folder = save_target(work / "run-target", target_config(args.target, **shallow), tokenizer, device,
                         torch.float32 if args.rehearse else torch.bfloat16)
    output = work / "run"
    rows = 12 if args.rehearse else None  # a CPU generates slowly
    tree = {
        "output_dir": str(output),
        "target": {"model": str(folder), "device": str(device), "dtype": "float32" if args.rehearse else "bfloat16"},
        "data": {"sources": [{"path": str(DEMO_DATA / "sharegpt_chats.jsonl"), "limit": rows},
                             {"path": str(DEMO_DATA / "openai_messages.jsonl"), "limit": rows},
                             {"path": str(DEMO_DATA / "alpaca_tasks.json"), "limit": rows or 40}],
                 "max_length": 512, "regenerate": True,
                 "generation": {"max_new_tokens": 40, "batch_size": 64}},
        "extract": {"batch_tokens": 16384},
        "store": {"path": str(output / "store"), "budget": "96MB", "segment_bytes": "8MiB"},
        "drafter": {"num_layers": 1, "attention": args.run_attention},
        "train": {"batch_tokens": 4096, "num_anchors": 64, "checkpoint_every": 4},
        "roles": {"mode": "single"},
        "eval": {"prompts": str(DEMO_DATA / "heldout_prompts.jsonl"), "num_prompts": 2, "max_new_tokens": 16},
    }
    config_path = work / "run.yaml"
    config_path.write_text(yaml.safe_dump(tree, sort_keys=False))
    started = time.perf_counter()
    with (work / "run.log").open("w") as log_file:
        done = subprocess.run([sys.executable, "-m", "dflash_stream", "run", "--config", str(config_path)],
                              stdout=log_file, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = (work / "run.log").read_text().strip().splitlines()[-3:]
        return {"ok": False, "returncode": done.returncode, "seconds": round(seconds, 1), "log_tail": tail}
    summary = json.loads((output / "summary.json").read_text())
    audit = audit_run(output)
    export = output / "drafter"
    return {
        "ok": audit["ok"] and (export / "config.json").is_file() and (export / "model.safetensors").is_file(),
        "seconds": round(seconds, 1), "attention": args.run_attention, "audit_ok": audit["ok"],
        "exported": sorted(p.name for p in export.iterdir()),
        **{k: summary[k] for k in ("samples_extracted", "tokens_extracted", "samples_trained", "steps",
                                   "peak_store_bytes", "budget_bytes", "final_loss", "eval")},
    }


# ----------------------------------------------------------------------------------------------- hybrid target
HYBRID_TARGET = "qwen3.5-27b"
"""Qwen3.5/3.6-27B's text model (64 layers: 48 Gated-DeltaNet + 16 full attention, hidden 5120, 26.9B parameters,
53.8 GB in bf16): fits one H200 with room for the forwards and a generation batch."""
HYBRID_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 8192}
HYBRID_SIZES = {"extract_rows": 4, "extract_length": 2048, "gen_rows": 16, "prompt": 256, "new_tokens": 64}
HYBRID_SIZES_TINY = {"extract_rows": 2, "extract_length": 128, "gen_rows": 2, "prompt": 16, "new_tokens": 8}
BLOCK_KERNELS = """
import importlib.abc, sys
class _NoKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {modules!r}:
            raise ImportError(name + " is blocked: the torch path is measured")
sys.meta_path.insert(0, _NoKernels())
"""


def hybrid_child(mode: str, rehearse: bool) -> dict[str, Any]:
    """One side of the hybrid comparison, in its own process (transformers binds the Gated-DeltaNet kernels when
    it first imports the model's module): extraction tok/s of the capture forward (hooks + early stop at the
    DFlash layers) and regeneration tok/s of `model.generate` (greedy, a fixed number of new tokens)."""
    from dflash_stream.bench.synthetic import build_target, target_config
    from dflash_stream.target_model import dflash_layer_ids
    from dflash_stream.target_model.capture import LayerCapture
    from dflash_stream.target_model.loading import GDN_KERNEL_MODULES, _importable

    device = torch.device("cpu") if rehearse else torch.device("cuda", torch.cuda.current_device())
    sizes = HYBRID_SIZES_TINY if rehearse else HYBRID_SIZES
    config = target_config(HYBRID_TARGET, **(HYBRID_TINY if rehearse else {}))
    model = build_target(config, device, torch.float32 if rehearse else torch.bfloat16)
    layer_ids = dflash_layer_ids(config.num_hidden_layers, 5)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (sizes["extract_rows"], sizes["extract_length"]), generator=generator)
    ids, mask = ids.to(device), torch.ones_like(ids, device=device)
    capture = LayerCapture(model, layer_ids)
    capture(ids, mask)  # warm-up: kernels (Triton compiles here), allocator
    _reset_peak(device)
    extract_s = min(_timed(lambda: capture(ids, mask), device) for _ in range(3))
    extract_peak = _peak(device)
    capture.close()

    prompts = torch.randint(3, config.vocab_size, (sizes["gen_rows"], sizes["prompt"]), generator=generator)
    prompts = prompts.to(device)
    new = sizes["new_tokens"]

    @torch.inference_mode()
    def generate(tokens: int) -> torch.Tensor:
        return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, pad_token_id=0)

    generate(2)  # warm-up: the decode kernels and the cache's first allocation
    _reset_peak(device)
    gen_s = _timed(lambda: generate(new), device)
    return {
        "mode": mode, "kernels_importable": {m: _importable(m) for m in GDN_KERNEL_MODULES},
        "parameters": sum(p.numel() for p in model.parameters()),
        "layer_types": dict(Counter(config.layer_types)),
        "extract": {"rows": sizes["extract_rows"], "length": sizes["extract_length"], "layer_ids": layer_ids,
                    "tok_s": round(ids.numel() / extract_s, 1), "peak_bytes": extract_peak},
        "regenerate": {"rows": sizes["gen_rows"], "prompt_tokens": sizes["prompt"], "new_tokens": new,
                       "tok_s": round(sizes["gen_rows"] * new / gen_s, 1),
                       "step_ms": round(gen_s / new * 1e3, 2), "peak_bytes": _peak(device)},
    }


def bench_hybrid(rehearse: bool, timeout: float = 240.0) -> dict[str, Any]:
    """The Qwen3.5-27B-shaped hybrid target (random weights) with the Gated-DeltaNet kernels importable and
    with them blocked (transformers' torch path), each in a child process; the kernels' speedup per phase."""
    from dflash_stream.target_model.loading import GDN_KERNEL_MODULES

    out: dict[str, Any] = {"target": HYBRID_TARGET + (" (tiny, --rehearse)" if rehearse else "")}
    for mode in ("kernels", "torch"):
        block = BLOCK_KERNELS.format(modules=set(GDN_KERNEL_MODULES)) if mode == "torch" else ""
        code = (block + "import json\nfrom dflash_stream.bench.gpu import hybrid_child\n"
                f"print(json.dumps(hybrid_child({mode!r}, {rehearse!r})))")
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            out[mode] = {"ok": False, "error": f"timed out after {timeout:.0f} s"}
            continue
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            out[mode] = {"ok": False, "error": tail[0][:300]}
            continue
        out[mode] = {"ok": True, **json.loads(done.stdout.strip().splitlines()[-1])}
    fast, slow = out["kernels"], out["torch"]
    out["ok"] = fast["ok"] and slow["ok"]
    if out["ok"]:
        # With no kernel importable on the "kernels" side both sides ran the torch path: say so, not 1.0x.
        out["kernels_measured"] = any(fast["kernels_importable"].values())
        out["speedup"] = {phase: round(fast[phase]["tok_s"] / slow[phase]["tok_s"], 3)
                          for phase in ("extract", "regenerate")}
    return out


# ------------------------------------------------------------------------------------------------- command
def bench_gpu(args: argparse.Namespace) -> int:
    if not args.rehearse and not torch.cuda.is_available():
        raise DFlashError("bench gpu needs a CUDA device (torch.cuda.is_available() is False here); "
                          "--rehearse checks the bench on the CPU")
    setup_logging("bench", 0, show_bar=False)
    from dflash_stream.bench.synthetic import build_target, build_tokenizer, target_config
    from dflash_stream.config import config_from_dict
    from dflash_stream.data import prepare_shard
    from dflash_stream.target_model import dflash_layer_ids
    from dflash_stream.target_model.capture import LayerCapture

    started = time.perf_counter()
    device = torch.device("cpu") if args.rehearse else torch.device("cuda", torch.cuda.current_device())
    if args.hybrid_only:
        log.info("hybrid target %s: with and without the Gated-DeltaNet kernels", HYBRID_TARGET)
        hybrid = bench_hybrid(args.rehearse)
        result = {"rehearsal": args.rehearse, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "hybrid": hybrid,
                  "ok": hybrid["ok"], "seconds": round(time.perf_counter() - started, 1)}
        print(json.dumps(result, indent=2) if args.json else _hybrid_table(hybrid))
        return 0 if result["ok"] else 1
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    config = target_config(args.target, **(TINY if args.rehearse else {}))
    tokenizer = build_tokenizer()
    log.info("building %s (random weights) on %s", args.target, device)
    model = build_target(config, device, torch.float32 if args.rehearse else torch.bfloat16)
    layer_ids = dflash_layer_ids(config.num_hidden_layers, 5)
    cfg = config_from_dict(_config_tree(args, work, "unused", device))
    samples, _ = prepare_shard(cfg, tokenizer, 0, 1)
    capture = LayerCapture(model, layer_ids)
    result: dict[str, Any] = {
        "rehearsal": args.rehearse,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "peak_bf16_tflops": PEAK_BF16_FLOPS / 1e12,
        "target": {"config": args.target, "parameters": sum(p.numel() for p in model.parameters()),
                   "layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "layer_ids": layer_ids},
        "data": {"samples": len(samples), "tokens": sum(s.num_tokens for s in samples),
                 "mean_tokens": round(sum(s.num_tokens for s in samples) / len(samples), 1)},
    }

    budget, why = ((args.extract_batch_tokens, "--extract-batch-tokens") if args.extract_batch_tokens
                   else choose_batch_tokens(capture, samples, device))
    log.info("extraction: hooks + early stop vs output_hidden_states at %d tokens (%s)", budget, why)
    result["extract"] = {**bench_extraction(model, config, capture, layer_ids, samples, budget, args.repeats, device),
                         "batch_tokens_rule": why}
    log.info("extraction into a real store")
    store_cfg = config_from_dict({**_config_tree(args, work, "unused", device), "extract": {"batch_tokens": budget}})
    result["extract"].update(bench_store_wait(store_cfg, model, tokenizer, device))
    log.info("device-to-host copies")
    result["host_copies"] = bench_host_copies(capture, samples, budget, args.repeats, device,
                                              cfg.extract.queue_size)
    log.info("drafter training step")
    result["train_step"] = bench_training(capture, model, cfg, config, layer_ids, tokenizer, samples, args, device)
    capture.close()
    del model, capture
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_run:
        log.info("combined run (roles.mode single)")
        result["run"] = bench_run(args, work, tokenizer, device)
    if args.hybrid:
        log.info("hybrid target %s: with and without the Gated-DeltaNet kernels", HYBRID_TARGET)
        result["hybrid"] = bench_hybrid(args.rehearse)
    t = result["train_step"]
    result["checks"] = {
        "flex_loss_equals_sdpa": t.get("loss_equal"),  # None where FlexAttention cannot train (CPU)
        "host_copies_equal": result["host_copies"]["copies_equal"],
        "train_steps_fit": not any("out_of_memory" in v for v in t["variants"].values()),
        "run_ok": result["run"]["ok"] if "run" in result else None,
        "hybrid_ok": result["hybrid"]["ok"] if "hybrid" in result else None,
    }
    result["ok"] = all(v is not False for v in result["checks"].values())
    result["seconds"] = round(time.perf_counter() - started, 1)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if result["ok"] else 1


def _table(r: dict[str, Any]) -> str:
    e, c, t = r["extract"], r["host_copies"], r["train_step"]
    lines = [f"{r['device']} (torch {r['torch']}, CUDA {r['cuda']}); target {r['target']['config']} "
             f"{r['target']['parameters'] / 1e9:.2f}B random weights; {r['data']['samples']} samples, "
             f"{r['data']['tokens']} tokens" + ("  [REHEARSAL on CPU: figures meaningless]" if r["rehearsal"] else ""),
             f"extract   hooks+early stop {e['hooks_tok_s']:>10} tok/s (MFU {e['hooks_mfu']})  vs  "
             f"output_hidden_states {e['full_forward_tok_s']} tok/s (MFU {e['full_forward_mfu']}): {e['speedup']}x "
             f"at {e['batch_tokens']} tokens",
             f"          Extractor into the store {e['extract_tok_s']} tok/s, store wait {e['store_wait_fraction']:.1%}",
             f"D2H       side stream {c['side_stream_tok_s']} tok/s vs synchronous {c['synchronous_tok_s']} tok/s: "
             f"{c['speedup']}x, copies equal: {c['copies_equal']}"]
    for name, v in t["variants"].items():
        if "out_of_memory" in v:
            lines.append(f"train     {name:<28} OUT OF MEMORY (peak {v['peak_bytes']}): {v['out_of_memory']}")
            continue
        lines.append(f"train     {name:<28} {v['tok_s']:>10} tok/s  MFU {v['mfu']}  peak {v['peak_bytes']}  "
                     f"first loss {v['first_loss']:.5f}  (first step {v['first_step_seconds']} s)")
    if "loss_equal" in t:
        lines.append(f"          flex vs sdpa {t['flex_vs_sdpa_speedup']}x, loss rel diff {t['loss_rel_diff']} "
                     f"(tolerance {t['loss_rtol']}): {'equal' if t['loss_equal'] else 'DIFFERENT'}")
    if isinstance(t["chunked_loss"], str):
        lines.append(f"          chunked loss: {t['chunked_loss']}")
    if "run" in r:
        lines.append(f"run       {json.dumps(r['run'])}")
    if "hybrid" in r:
        lines.append(_hybrid_table(r["hybrid"]))
    lines.append(f"checks {json.dumps(r['checks'])}: {'ok' if r['ok'] else 'FAILED'}; total {r['seconds']} s")
    return "\n".join(lines)


def _hybrid_table(h: dict[str, Any]) -> str:
    lines = [f"hybrid    {h['target']}: extraction (capture forward) and regeneration (generate) tok/s"]
    for mode in ("kernels", "torch"):
        v = h[mode]
        if not v["ok"]:
            lines.append(f"          {mode:<8} FAILED: {v['error']}")
            continue
        have = ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in v["kernels_importable"].items())
        lines.append(f"          {mode:<8} extract {v['extract']['tok_s']:>10} tok/s   regenerate "
                     f"{v['regenerate']['tok_s']:>8} tok/s ({v['regenerate']['step_ms']} ms per step)   [{have}]")
    if h["ok"]:
        note = "" if h["kernels_measured"] else "  (no kernel importable: both sides ran the torch path)"
        lines.append(f"          kernels vs torch path: extract {h['speedup']['extract']}x, regenerate "
                     f"{h['speedup']['regenerate']}x{note}")
    return "\n".join(lines)
