"""`dflash-stream bench compile`: the trainer's real batcher over the demo data's real sample lengths, through
the compiled FlexAttention forward, counting the graphs torch.compile builds and the compute padding wastes.

The samples are the demo config's rows tokenized with the demo target's tokenizer (their own responses, not
regenerated), packed into segments as the extractor packs them (length-sorted windows of 4 segments of
`store.segment_bytes`) and streamed through `TokenBatcher` pass after pass (the epochs) until `--batches`
batches went out. Each batch is padded to its bucket's shape (`drafter/shapes.py`) and runs the real loss
(`dflash_loss`) with the demo drafter's widths under `torch.no_grad()`: the CPU compiler has no FlexAttention
backward. Hidden states and the LM head are random (a 1,024-row head: the vocabulary does not shape attention).

padding_waste = (tokens computed on) / (real tokens) - 1, counting the context positions (N x S) and the block
tokens (N x A x B) against each sample's length and its min(num_anchors, eligible anchors) blocks. Beside it:
the same for today's per-batch shapes (samples in arrival order, each batch padded to its own longest and most
anchors: the baseline), and both on a synthetic stream shaped like the headline job (see `headline_lengths`).

`compile_check(device, backward=True)` is the same run on CUDA with forward and backward, for the GPU check.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch._dynamo

from dflash_stream.config import Config, config_from_dict, load_config
from dflash_stream.drafter.batches import Member, TokenBatcher, collate
from dflash_stream.drafter.shapes import CompileWatch, Shape, ShapePlan
from dflash_stream.store.segment import StoredSample

HEAD_ROWS = 1024
WINDOW_SEGMENTS = 4  # as the extractor's length-sorted windows
HEADLINE = {"config": "configs/qwen3.6-27b-4gpu.yaml", "samples": 20000, "bytes_per_token": 5 * 5120 * 2}


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compiled attention graphs and padding waste of the trainer's batch shapes")
    p.add_argument("--config", default="configs/demo.yaml", help="run config whose data, train and drafter are used")
    p.add_argument("--batches", type=int, default=60, help="batches to run (at least; whole passes over the data)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=bench_compile)


def demo_samples(cfg: Config, tokenizer) -> list[StoredSample]:  # noqa: ANN001 - a transformers tokenizer
    """The config's rows as samples (ids, loss mask) with their own responses; no states yet."""
    from dflash_stream.data import prepare_shard

    with tempfile.TemporaryDirectory() as out:
        tree = cfg.model_dump(mode="json")
        tree["output_dir"], tree["data"]["regenerate"] = out, False
        prepared, _ = prepare_shard(config_from_dict(tree), tokenizer, 0, 1)
    return [StoredSample(s.sample_id, torch.from_numpy(s.input_ids.astype(np.int64)), torch.from_numpy(s.loss_mask),
                    torch.empty(0)) for s in prepared]


def headline_lengths(count: int, max_length: int, min_supervised: int, seed: int = 0) -> list[StoredSample]:
    """A stream like the headline job's (stated, not measured): prompts lognormal with median 300 tokens and
    sigma 1.0, regenerated responses lognormal with median 600 and sigma 0.8 capped at 2,048 new tokens, cut to
    max_length; mean ~1.2k tokens a sample. Only lengths and loss masks are made."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        prompt = max(8, int(rng.lognormal(np.log(300), 1.0)))
        response = min(2048, max(1, int(rng.lognormal(np.log(600), 0.8))))
        length = min(max_length, prompt + response)
        if length - prompt < min_supervised:
            continue
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt:] = True
        out.append(StoredSample(len(out), torch.zeros(length, dtype=torch.long), mask, torch.empty(0)))
    return out


def segments(samples: list[StoredSample], segment_tokens: int) -> list[list[StoredSample]]:
    """Segments as the extractor writes them: windows of WINDOW_SEGMENTS segments sorted longest first."""
    out, window = [], []
    for i, sample in enumerate(samples):
        window.append(sample)
        if sum(len(s.input_ids) for s in window) >= WINDOW_SEGMENTS * segment_tokens or i == len(samples) - 1:
            window.sort(key=lambda s: -len(s.input_ids))
            current, size = [], 0
            for s in window:
                current.append(s)
                size += len(s.input_ids)
                if size >= segment_tokens:
                    out.append(current)
                    current, size = [], 0
            if current:
                out.append(current)
            window = []
    return out


def bucketed(plan: ShapePlan, segs: list[list[StoredSample]], min_batches: int) -> list[tuple[list[Member], Shape]]:
    """Batches of the real TokenBatcher, fed segment by segment as a trainer whose reader keeps up feeds it,
    pass after pass (the epochs of store.reuse), until at least `min_batches`; then the end of data."""
    batcher, out = TokenBatcher(plan), []
    while len(out) < min_batches:
        for number, seg in enumerate(segs):
            batcher.add(f"s{number}", seg)
            while batcher.full_batch_ready():
                batch = batcher.next_batch()
                out.append((batch, batcher.shape(batch)))
    while batch := batcher.next_batch():  # end of data
        out.append((batch, batcher.shape(batch)))
    return out


def per_batch(batch_tokens: int, segs: list[list[StoredSample]], passes: int) -> list[list[StoredSample]]:
    """Today's batches: arrival order (each segment shortest first), each within batch_tokens counting its own
    longest: the baseline."""
    out, current = [], []
    for _ in range(passes):
        for seg in segs:
            for sample in sorted(seg, key=lambda s: len(s.input_ids)):
                longest = max([len(s.input_ids) for s in current] + [len(sample.input_ids)])
                if current and (len(current) + 1) * longest > batch_tokens:
                    out.append(current)
                    current = []
                current.append(sample)
    return [*out, current] if current else out


def _real_blocks(sample: StoredSample, num_anchors: int) -> int:
    mask = sample.loss_mask
    return min(num_anchors, int((mask[:-1] & mask[1:]).sum()))


def waste(batches: list[tuple[list[int], list[int], Shape]], block_size: int) -> float:
    """(computed - real) / real tokens over batches of (lengths, real blocks, computed shape)."""
    real = sum(sum(lengths) + block_size * sum(blocks) for lengths, blocks, _ in batches)
    done = sum(s.rows * (s.length + block_size * s.blocks) for _, _, s in batches)
    return round(done / real - 1, 3)


def wastes(cfg: Config, samples: list[StoredSample], segment_tokens: int, min_batches: int) -> dict:
    """padding_waste of the bucketed shapes and of today's per-batch shapes over the same stream."""
    tc, bs = cfg.train, cfg.drafter.block_size
    plan = ShapePlan.from_config(cfg)
    segs = segments(samples, segment_tokens)
    new = bucketed(plan, segs, min_batches)
    passes = max(1, round(sum(len(b) for b, _ in new) / len(samples)))
    blocks = {id(s): _real_blocks(s, tc.num_anchors) for s in samples}
    old = []
    for batch in per_batch(tc.batch_tokens, segs, passes):
        lengths, real = [len(s.input_ids) for s in batch], [blocks[id(s)] for s in batch]
        old.append((lengths, real, Shape(len(batch), max(lengths), max(1, max(real)))))
    return {
        "batches": len(new),
        "padding_waste": waste([([m.length for m in b], [blocks[id(m.sample)] for m in b], s) for b, s in new], bs),
        "baseline_padding_waste": waste(old, bs),
        "plan": plan,
        "new": new,
    }


def compile_run(cfg: Config, device: torch.device, *, backward: bool, min_batches: int = 60) -> dict:
    """Real batches of the demo data through the loss with compiled FlexAttention on `device`: distinct shapes,
    graphs compiled, compile seconds, padding waste. With `backward`, also the backward pass (CUDA only)."""
    from transformers import AutoTokenizer

    from dflash_stream.drafter import DFlashDrafter, TargetHead, build_spec, dflash_loss
    from dflash_stream.drafter import model as drafter_model
    from dflash_stream.pipeline.common import store_layout
    from dflash_stream.target_model import target_shape
    from dflash_stream.target_model.location import model_location

    layer_ids, hidden = store_layout(cfg)
    location, kwargs = model_location(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    samples = demo_samples(cfg, tokenizer)
    width = len(layer_ids) * hidden
    segment_tokens = max(1, int(cfg.store.segment_bytes) // (2 * width))
    result = wastes(cfg, samples, segment_tokens, min_batches)
    spec = build_spec(cfg, target_shape(cfg.target, count=False), layer_ids, tokenizer)
    spec = replace(spec, vocab_size=HEAD_ROWS, mask_token_id=HEAD_ROWS - 1)
    drafter = DFlashDrafter(spec, attention="flex").to(device)
    head = TargetHead(torch.randn(HEAD_ROWS, hidden, device=device) * 0.02)
    gen = torch.Generator().manual_seed(0)
    states = {s.sample_id: torch.randn(len(s.input_ids), width, generator=gen) for s in samples}
    watch = CompileWatch(len(result["plan"]))
    compile_seconds, started = 0.0, time.perf_counter()
    bf16 = cfg.train.bf16_autocast(device.type)
    compiled_here = device.type not in drafter_model.COMPILED_FLEX_DEVICES
    drafter_model.COMPILED_FLEX_DEVICES.add(device.type)
    try:
        for members, shape in result["new"]:
            members = [Member(m.segment_id, replace(m.sample, input_ids=m.sample.input_ids % HEAD_ROWS,
                                                    hidden_states=states[m.sample.sample_id])) for m in members]
            batch = collate(members, device, shape)
            before, t0 = watch.graphs_compiled, time.perf_counter()
            with torch.set_grad_enabled(backward), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = dflash_loss(drafter, head, batch, num_anchors=cfg.train.num_anchors, gamma=cfg.train.gamma,
                                  num_blocks=shape.blocks)
            if backward:
                out.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            watch.observe(tuple(batch["input_ids"].shape))
            if watch.graphs_compiled > before:
                compile_seconds += time.perf_counter() - t0
    finally:
        if compiled_here:
            drafter_model.COMPILED_FLEX_DEVICES.discard(device.type)
    return {
        "batches": result["batches"],
        "distinct_shapes": len(watch.shapes),
        "graphs_compiled": watch.graphs_compiled,
        "compile_seconds": round(compile_seconds, 1),
        "padding_waste": result["padding_waste"],
        "buckets": result["plan"].buckets,
        "baseline_padding_waste": result["baseline_padding_waste"],
        "seconds": round(time.perf_counter() - started, 1),
        "device": str(device),
        "backward": backward,
    }


def compile_check(device: str | torch.device = "cuda", *, backward: bool = True, config: str = "configs/demo.yaml",
                  min_batches: int = 60) -> dict:
    """For the GPU readiness check: `compile_run` of the demo config on `device` with forward and backward.
    Passes when `result["graphs_compiled"] <= len(result["buckets"])`."""
    return compile_run(load_config(config), torch.device(device), backward=backward, min_batches=min_batches)


def _headline(min_batches: int) -> dict:
    cfg = load_config(HEADLINE["config"]) if Path(HEADLINE["config"]).is_file() else None
    if cfg is None:
        return {}
    samples = headline_lengths(HEADLINE["samples"], cfg.data.max_length, cfg.min_supervised_tokens)
    segment_tokens = int(cfg.store.segment_bytes) // HEADLINE["bytes_per_token"]
    result = wastes(cfg, samples, segment_tokens, min_batches)
    return {"config": HEADLINE["config"], "lengths": "synthetic lognormal (bench/compile.py: headline_lengths)",
            "buckets": result["plan"].buckets, "batches": result["batches"],
            "padding_waste": result["padding_waste"], "baseline_padding_waste": result["baseline_padding_waste"]}


def bench_compile(args: argparse.Namespace) -> int:
    from dflash_stream.log import setup_logging

    setup_logging("bench", 0, show_bar=False)
    torch._dynamo.reset()
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        # A cold compiler cache: the compile time a fresh machine (or a new shape) pays, not a cache hit.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            result = compile_run(load_config(args.config), torch.device("cpu"), backward=False,
                                 min_batches=args.batches)
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    result["headline"] = _headline(args.batches)
    result["target"] = {"graphs_compiled": f"<= {len(result['buckets'])} buckets and <= 8"}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['batches']} batches, {result['distinct_shapes']} distinct shapes, {result['graphs_compiled']} "
          f"graphs compiled in {result['compile_seconds']} s (buckets {result['buckets']})")
    print(f"padding waste: {result['padding_waste']:.1%} (today's per-batch shapes: "
          f"{result['baseline_padding_waste']:.1%})")
    if result["headline"]:
        h = result["headline"]
        print(f"headline-like lengths ({h['config']}): {h['padding_waste']:.1%} "
              f"(per-batch shapes: {h['baseline_padding_waste']:.1%}), buckets {h['buckets']}")
    return 0
