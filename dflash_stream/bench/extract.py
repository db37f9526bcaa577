"""`dflash-stream bench extract`: capture hooks + early stop against a plain `output_hidden_states` forward, and
how long the extractor's forward loop waits on a store that has room.

Both forwards run on the same length-sorted batches of the demo data, alternating, best of `--repeats`, on the
real demo target (or `--model`). The store figure comes from a full `Extractor` run into a real store.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from dflash_stream.config import DEMO_GGUF, DEMO_MODEL, config_from_dict
from dflash_stream.data import prepare_shard, token_budget_batches
from dflash_stream.log import setup_logging
from dflash_stream.observe.metrics import MetricsWriter
from dflash_stream.pipeline.common import open_store
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.layers import resolve_layer_ids
from dflash_stream.target_model.loading import load_target, resolve_device
from dflash_stream.target_model.shape import model_shape

TARGETS = {"speedup": 1.25, "store_wait_fraction": 0.05}


def register_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("extract", help="hooks + early stop vs output_hidden_states; store wait of the extractor")
    bench.add_argument("--model", default=DEMO_MODEL, help="target (default: the offline demo model)")
    bench.add_argument("--gguf-file", default=DEMO_GGUF, help="GGUF file inside --model ('' for none)")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--rows", type=int, default=20, help="rows of each of two demo files (about 140 tokens each)")
    bench.add_argument("--batch-tokens", type=int, default=2048)
    bench.add_argument("--repeats", type=int, default=2)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=bench_extract)


def _batches(samples, budget: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lengths = [s.num_tokens for s in samples]
    out = []
    for batch in token_budget_batches(lengths, budget):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.from_numpy(samples[i].input_ids.astype(np.int64))
            mask[row, : lengths[i]] = 1
        out.append((ids, mask))
    return out


def _timed(fn, batches, device: torch.device) -> float:
    started = time.perf_counter()
    for ids, mask in batches:
        fn(ids.to(device), mask.to(device)).to("cpu")
    return time.perf_counter() - started


def bench_extract(args: argparse.Namespace) -> int:
    setup_logging("bench", 0, show_bar=False)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-extract-"))
    demo = Path(str(files("dflash_stream") / "demo_data"))
    cfg = config_from_dict({
        "output_dir": str(work),
        "target": {"model": args.model, "gguf_file": args.gguf_file or None, "device": args.device},
        "data": {"sources": [{"path": str(demo / "sharegpt_chats.jsonl"), "limit": args.rows},
                             {"path": str(demo / "openai_messages.jsonl"), "limit": args.rows}]},
        "extract": {"batch_tokens": args.batch_tokens},
        "store": {"path": str(work / "store"), "budget": "4GB", "segment_bytes": "4MiB"},
    })
    device = resolve_device(cfg.target)
    model, tokenizer = load_target(cfg.target, device)
    shape = model_shape(model)
    layer_ids = resolve_layer_ids(shape.num_layers, cfg.target)
    samples, _ = prepare_shard(cfg, tokenizer, 0, 1)
    batches = _batches(samples, args.batch_tokens)
    tokens = sum(s.num_tokens for s in samples)

    capture = LayerCapture(model, layer_ids)

    @torch.inference_mode()
    def full_forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        return torch.cat([hidden[i + 1] for i in layer_ids], dim=-1).to(torch.bfloat16)

    _timed(capture, batches[:1], device)  # warm-up: allocator, kernels
    _timed(full_forward, batches[:1], device)
    hooks, full = [], []
    for _ in range(args.repeats):
        hooks.append(_timed(capture, batches, device))
        full.append(_timed(full_forward, batches, device))

    # The extractor end to end, into a real store with room: how long does its forward loop wait on the store?
    from dflash_stream.pipeline.extractor import Extractor

    store = open_store(cfg, layer_ids, shape.hidden_size)
    metrics = MetricsWriter(work, "extractor", 0)
    extractor = Extractor(cfg, RoleInfo("extractor", 0, 1, 0, 1), store, metrics, device, target=(model, tokenizer))
    extractor.run()
    metrics.close()

    result = {
        "model": f"{args.model}{'/' + args.gguf_file if args.gguf_file else ''}",
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "layer_ids": layer_ids,
        "num_layers": shape.num_layers,
        "samples": len(samples),
        "tokens": tokens,
        "batch_tokens": args.batch_tokens,
        "hooks_tok_s": round(tokens / min(hooks), 1),
        "full_forward_tok_s": round(tokens / min(full), 1),
        "speedup": round(min(full) / min(hooks), 3),
        "speedup_median": round(statistics.median(full) / statistics.median(hooks), 3),
        "extract_tok_s": round(extractor.tokens_written / extractor.extract_seconds, 1),
        "store_wait_seconds": round(extractor.backpressure_seconds, 3),
        "store_wait_fraction": round(extractor.backpressure_seconds / extractor.extract_seconds, 4),
        "targets": TARGETS,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if key == "targets":
                continue
            target = TARGETS.get(key)
            beside = "" if target is None else f"   (target {'>=' if key == 'speedup' else '<='} {target})"
            print(f"{key:<22} {value}{beside}")
    return 0
