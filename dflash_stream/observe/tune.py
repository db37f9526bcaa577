"""`dflash-stream tune`: measure this target on a few real samples, then size the buffer for this disk.

Runs the real target over N samples (capture hooks + early stop, as the extractor does), writes the captured
states as one segment per store codec through the store's own writer, trains the real drafter for a few steps, and writes OUTPUT/tune.json, which
`plan` reads. The recommendation trades disk for slack: a bigger buffer lets extraction run further ahead, so
a slow patch on either side does not stall the other.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash_stream.config import Config, ConfigError
from dflash_stream.observe.plan import disk_space
from dflash_stream.units import fmt_bytes, fmt_duration

if TYPE_CHECKING:
    from dflash_stream.data import PreparedSample

MIB = 2**20
HEADROOM = 0.5  # never recommend more than this fraction of the free disk: checkpoints and logs need room
SEGMENT_SECONDS = 30.0  # aim for a segment to be ~30 s of training: frequent releases, few files
BUFFER_MINUTES = (2, 5, 10, 30, 60)  # training minutes a buffer option holds


def _samples(cfg: Config, tokenizer, model, count: int) -> list[PreparedSample]:
    """The first `count` samples of the configured data (responses regenerated when data.regenerate)."""
    from dflash_stream.data import prepare_shard

    # Read only a few rows (filtering may drop some), and keep tune's data report out of the run's folder.
    sources = [s.model_copy(update={"limit": min(s.limit or 4 * count, 4 * count)}) for s in cfg.data.sources]
    data = cfg.data.model_copy(update={"sources": sources})
    with tempfile.TemporaryDirectory() as scratch:
        samples, _ = prepare_shard(cfg.model_copy(update={"data": data, "output_dir": scratch}), tokenizer, 0, 1)
    samples = samples[:count]
    if cfg.data.regenerate:
        from dflash_stream.target_model.generate import generate_responses

        gen = cfg.data.generation
        responses = generate_responses(model, tokenizer, [s.input_ids for s in samples], gen, gen.max_new_tokens)
        samples = [s.with_response(r, cfg.data.max_length) for s, r in zip(samples, responses, strict=True)]
    return samples


def _extract(model, layer_ids: list[int], samples: list[PreparedSample], batch_tokens: int, pad_id: int,
             device: torch.device) -> tuple[list[torch.Tensor], float]:
    """Captured states per sample and the extraction tokens/s (after one warm-up batch)."""
    from dflash_stream.data import token_budget_batches
    from dflash_stream.target_model.capture import LayerCapture

    capture = LayerCapture(model, layer_ids)
    order = sorted(range(len(samples)), key=lambda i: samples[i].num_tokens)
    batches = [[order[j] for j in b] for b in token_budget_batches([samples[i].num_tokens for i in order], batch_tokens)]
    states: dict[int, torch.Tensor] = {}
    timed_tokens, timed_s = 0, 0.0
    for n, batch in enumerate(batches):
        width = max(samples[i].num_tokens for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : samples[i].num_tokens] = torch.from_numpy(samples[i].input_ids.astype(np.int64))
            mask[row, : samples[i].num_tokens] = 1
        start = time.perf_counter()
        out = capture(ids.to(device), mask.to(device)).cpu()
        elapsed = time.perf_counter() - start
        if n or len(batches) == 1:  # the first batch pays for kernel selection and allocation
            timed_tokens += int(mask.sum())
            timed_s += elapsed
        for row, i in enumerate(batch):
            states[i] = out[row, : samples[i].num_tokens]
    capture.close()
    return [states[i] for i in range(len(samples))], timed_tokens / timed_s


def _compression(samples: list[PreparedSample], states: list[torch.Tensor], layer_ids: list[int],
                 hidden_size: int) -> dict[str, dict[str, float]]:
    """Each codec's on-disk ratio against raw bf16 and its write speed: one real segment per codec, written
    through the store's own writer into a scratch store."""
    from dflash_stream.store import Sample, Store, codecs, sizes

    segment = [Sample(s.sample_id, s.input_ids, s.loss_mask, h) for s, h in zip(samples, states, strict=True)]
    raw = sizes.raw_bytes(sum(h.shape[0] for h in states), len(states), states[0].shape[1])
    out = {}
    for codec in codecs.names():
        with tempfile.TemporaryDirectory() as tmp:
            store = Store.open(Path(tmp) / "store", budget=4 * raw + 64 * MIB, codec=codec, reuse=1,
                               fingerprint={"layer_ids": layer_ids, "hidden_size": hidden_size},
                               max_segment_raw_bytes=raw)
            start, cpu = time.perf_counter(), time.process_time()
            info = store.writer("tune").write(segment)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        # Per core: raw bytes per CPU-second of all the writer's threads (what `plan` sizes the store's cores by).
        out[codec] = {"ratio": info.raw_bytes / info.bytes, "write_bytes_per_s": info.raw_bytes / elapsed,
                      "encode_bytes_per_core_s": info.raw_bytes / max(cpu, 1e-9)}
    return out


def _train(cfg: Config, model, tokenizer, layer_ids: list[int], samples: list[PreparedSample],
           states: list[torch.Tensor], steps: int, device: torch.device) -> float:
    """Training tokens/s of the real drafter on these samples (after one warm-up step)."""
    from dflash_stream.drafter import Objective, TargetHead, build_drafter, build_spec, dflash_loss
    from dflash_stream.drafter.batches import TokenBatcher, collate
    from dflash_stream.drafter.shapes import ShapePlan, fixed_shapes_on
    from dflash_stream.store.segment import StoredSample
    from dflash_stream.target_model import model_shape

    spec = build_spec(cfg, model_shape(model), layer_ids, tokenizer)
    drafter = build_drafter(spec, attention=cfg.drafter.attention).to(device)
    head = TargetHead.from_model(model)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr)
    autocast = cfg.train.bf16_autocast(device.type)
    stored = [StoredSample(s.sample_id, torch.from_numpy(s.input_ids.astype(np.int64)),
                           torch.from_numpy(s.loss_mask), h) for s, h in zip(samples, states, strict=True)]
    batcher = TokenBatcher(ShapePlan.from_config(cfg))
    timed_tokens, timed_s = 0, 0.0
    for step in range(steps + 1):
        if not len(batcher):
            batcher.add("tune", stored)
        members = batcher.next_batch()
        shape = batcher.shape(members) if fixed_shapes_on(cfg, drafter.uses_flex(device)) else None
        batch = collate(members, device, shape)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = dflash_loss(drafter, head, batch, num_anchors=cfg.train.num_anchors, gamma=cfg.train.gamma,
                              num_blocks=shape.blocks if shape else None,
                              chunk_rows=cfg.train.loss_chunk_rows, objective=Objective.from_config(cfg.train))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            timed_tokens += int(batch["lengths"].sum())
            timed_s += time.perf_counter() - start
    return timed_tokens / timed_s


def recommend(free_bytes: int, stored_bytes_per_token: float, raw_bytes_per_token: int, train_tok_s: float,
              extract_tok_s: float, min_segment_raw: int) -> dict[str, Any]:
    """Buffer options by how many minutes of training they hold, and the recommended budget and segment size."""
    # A segment of ~SEGMENT_SECONDS of training, in whole MiB, never below one longest sample.
    segment = max(min_segment_raw, int(SEGMENT_SECONDS * train_tok_s * raw_bytes_per_token) // MIB * MIB)
    segment_stored = segment / raw_bytes_per_token * stored_bytes_per_token
    options = []
    for minutes in BUFFER_MINUTES:
        bytes_needed = max(minutes * 60 * train_tok_s * stored_bytes_per_token, 4 * segment_stored)
        budget = math.ceil(bytes_needed / MIB) * MIB  # whole MiB: a budget a person can read and type
        options.append({
            "minutes_of_training": minutes, "budget_bytes": budget,
            "segments": int(budget // segment_stored), "fraction_of_free_disk": budget / free_bytes,
            "fits": budget <= HEADROOM * free_bytes,
        })
    fitting = [o for o in options if o["fits"]]
    # Ten minutes rides out a checkpoint, an eval or a slow batch on either side; more only costs disk.
    chosen = next((o for o in fitting if o["minutes_of_training"] >= 10), fitting[-1] if fitting else None)
    return {
        "segment_bytes": segment, "segment_stored_bytes": segment_stored, "options": options,
        "budget_bytes": chosen["budget_bytes"] if chosen else None,
        "bottleneck": "train" if train_tok_s < extract_tok_s else "extract",
    }


def _device_name(device: torch.device) -> str:
    """What the throughputs were measured on: they only carry over to the same kind of device."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return device.type


def run_tune(cfg: Config, num_samples: int, train_steps: int) -> dict[str, Any]:
    """Measure, recommend, write OUTPUT/tune.json, print the findings; the measurements."""
    from dflash_stream.store import sizes
    from dflash_stream.target_model import (
        load_target,
        model_shape,
        resolve_device,
        resolve_layer_ids,
        stored_layer_ids,
    )

    if num_samples < 1 or train_steps < 1:
        raise ConfigError("tune: --samples and --train-steps must be at least 1")
    device = resolve_device(cfg.target)
    model, tokenizer = load_target(cfg.target, device)
    tc = model_shape(model)
    layer_ids = resolve_layer_ids(tc.num_layers, cfg.target)
    stored = stored_layer_ids(tc.num_layers, cfg.target, cfg.verifier_states)  # what the run's extractors capture
    samples = _samples(cfg, tokenizer, model, num_samples)
    states, extract_tok_s = _extract(model, stored, samples, cfg.extract.batch_tokens, tokenizer.pad_token_id, device)
    compression = _compression(samples, states, stored, tc.hidden_size)
    train_tok_s = _train(cfg, model, tokenizer, layer_ids, samples, states, train_steps, device)

    tokens = sum(s.num_tokens for s in samples)
    raw_tok = sizes.raw_bytes_per_token(len(stored) * tc.hidden_size)
    stored_tok = raw_tok / compression[cfg.store.codec]["ratio"]
    disk = disk_space(cfg, 0)
    # A segment must hold the longest sample; the configured segment_bytes is what is being tuned.
    longest = sizes.raw_bytes(cfg.data.max_length, 1, len(stored) * tc.hidden_size)
    advice = recommend(disk["free_bytes"], stored_tok, raw_tok, train_tok_s, extract_tok_s, longest)
    result = {
        "time": time.time(), "target": cfg.target.model, "device": _device_name(device),
        "layer_ids": layer_ids, "verifier_states": cfg.verifier_states, "hidden_size": tc.hidden_size,
        "samples": len(samples), "tokens": tokens,
        "mean_tokens": tokens / len(samples),
        "compression": {c: m["ratio"] for c, m in compression.items()},
        "write_bytes_per_s": {c: m["write_bytes_per_s"] for c, m in compression.items()},
        "encode_bytes_per_core_s": {c: m["encode_bytes_per_core_s"] for c, m in compression.items()},
        "extract_tok_s": extract_tok_s, "train_tok_s": train_tok_s, "train_steps": train_steps,
        "free_bytes": disk["free_bytes"], "disk_checked": disk["checked"], "recommendation": advice,
    }
    path = Path(cfg.output_dir) / "tune.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(render_tune(result, cfg.store.codec))
    print(f"\nwrote {path} (plan reads it)")
    return result


def render_tune(r: dict[str, Any], codec: str) -> str:
    rec = r["recommendation"]
    out = [f"measured on {r['samples']} samples ({r['tokens']:,} tokens, mean {r['mean_tokens']:,.0f}) "
           f"of {r['target']} on {r['device']}, layers {r['layer_ids']}",
           "", "one segment of the captured states on disk, per codec (vs raw bf16 + ids + mask)"]
    for c, ratio in r["compression"].items():
        mark = "  <- store.codec" if c == codec else ""
        out.append(f"  {c:<9}{ratio:6.2f}x   writes {r['write_bytes_per_s'][c] / 1e6:8,.0f} MB/s of raw states{mark}")
    out += ["", f"extraction {r['extract_tok_s']:,.0f} tok/s, training {r['train_tok_s']:,.0f} tok/s per process "
                f"-> {rec['bottleneck']} is the bottleneck",
            "", f"buffer options ({fmt_bytes(r['free_bytes'])} free at {r['disk_checked']}; "
                f"segments of {fmt_bytes(rec['segment_bytes'])} raw = ~{SEGMENT_SECONDS:.0f} s of training)",
            f"  {'holds':>10}{'budget':>14}{'segments':>10}{'of free':>9}"]
    for o in rec["options"]:
        flag = "" if o["fits"] else f"  (over {HEADROOM:.0%} of free disk)"
        mark = "  <- recommended" if o["budget_bytes"] == rec["budget_bytes"] else ""
        out.append(f"  {fmt_duration(o['minutes_of_training'] * 60):>10}{fmt_bytes(o['budget_bytes']):>14}"
                   f"{o['segments']:>10}{o['fraction_of_free_disk']:>9.1%}{flag}{mark}")
    out.append("  a smaller buffer saves disk but lets a slow patch on one side (checkpoint, eval, long batch) "
               "stall the other sooner")
    if rec["budget_bytes"] is None:
        out.append(f"warning: not even the smallest option fits in {HEADROOM:.0%} of the free disk")
    else:
        out.append(f"recommended: --store.budget={_flag(rec['budget_bytes'])} "
                   f"--store.segment_bytes={_flag(rec['segment_bytes'])}")
    return "\n".join(out)


def _flag(n: int) -> str:
    return f"{n // MIB}MiB" if n % MIB == 0 else str(n)
