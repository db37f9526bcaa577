"""`dflash-stream bench extract`: capture hooks + early stop against a plain `output_hidden_states` forward, and
how long the extractor's forward loop waits on a store that has room; with `--engines hf,vllm`, the extractor
against the same samples' states from a local vLLM server (extract.engine vllm).

Both forwards run on the same length-sorted batches of the demo data, alternating, best of `--repeats`, on the
real demo target (or `--model`). The store figure comes from a full `Extractor` run into a real store.

`engines` times each engine end to end on the same samples into a fresh store: `hf` is the extractor's own
forward (the `extract_tok_s` above), `vllm` a vLLM server from `.venv-vllm` (`make vllm-env`) started with
`serve-command`'s flags on the target (a GGUF one converted to safetensors once: `gguf_cache`) and the
served extractor asking it; its start-up is timed apart. `max_rel_vs_hf` is the worst layer's
max |vLLM - ours| / max |ours| over every token of the samples, vLLM's states as the server wrote them and ours as
the store keeps them (bf16).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from dflash_stream.config import DEMO_GGUF, DEMO_MODEL, ConfigError, config_from_dict, endpoint_base_url
from dflash_stream.data import prepare_shard, token_budget_batches
from dflash_stream.log import setup_logging
from dflash_stream.observe.metrics import MetricsWriter
from dflash_stream.pipeline.common import open_store
from dflash_stream.pipeline.roles import RoleInfo
from dflash_stream.regenerate.servers import safetensors_copy
from dflash_stream.target_model.capture import LayerCapture
from dflash_stream.target_model.layers import resolve_layer_ids
from dflash_stream.target_model.loading import load_target, resolve_device
from dflash_stream.target_model.shape import model_shape

TARGETS = {"speedup": 1.25, "store_wait_fraction": 0.05, "max_rel_vs_hf": 5e-3}
ENGINES = ("hf", "vllm")


def register_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("extract", help="hooks + early stop vs output_hidden_states; store wait of the extractor")
    bench.add_argument("--model", default=DEMO_MODEL, help="target (default: the offline demo model)")
    bench.add_argument("--gguf-file", default=DEMO_GGUF, help="GGUF file inside --model ('' for none)")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--rows", type=int, default=20, help="rows of each of two demo files (about 140 tokens each)")
    bench.add_argument("--batch-tokens", type=int, default=2048)
    bench.add_argument("--repeats", type=int, default=2)
    bench.add_argument("--engines", default="hf",
                        help=f"comma-separated, of {', '.join(ENGINES)}: time each into a store and compare vLLM's "
                             "states with ours (default hf)")
    bench.add_argument("--workdir", default="runs/bench-extract",
                       help="the converted target, the vLLM server's log and spool (default runs/bench-extract)")
    bench.add_argument("--startup-timeout", type=float, default=900.0, help="seconds the vLLM server may take")
    bench.add_argument("--endpoint", default=None, metavar="URL",
                       help="with --engines ...,vllm: measure this vLLM server instead of starting one (started with "
                            "`serve-command`'s flags for this target and --capture-layers; its tok/s is what "
                            "extract.tokens_per_s takes)")
    bench.add_argument("--spool", default=None, help="with --endpoint: the spool that server writes into")
    bench.add_argument("--capture-layers", type=int, default=5, help="target.num_capture_layers (default 5)")
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
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        raise ConfigError(f"--engines: {args.engines!r}; allowed: a comma-separated list of {', '.join(ENGINES)}")
    if args.endpoint and not args.spool:
        raise ConfigError("--endpoint: give the server's spool too (--spool DIR)")
    setup_logging("bench", 0, show_bar=False)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-extract-"))
    demo = Path(str(files("dflash_stream") / "demo_data"))
    cfg = config_from_dict({
        "output_dir": str(work),
        "target": {"model": args.model, "gguf_file": args.gguf_file or None, "device": args.device,
                   "num_capture_layers": args.capture_layers},
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
    hf_rate = round(extractor.tokens_written / extractor.extract_seconds, 1)
    store_wait = (round(extractor.backpressure_seconds, 3),
                  round(extractor.backpressure_seconds / extractor.extract_seconds, 4))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    served = None
    if "vllm" in engines:
        ours = {s.sample_id: capture(torch.from_numpy(s.input_ids.astype(np.int64))[None].to(device),
                                     torch.ones((1, s.num_tokens), dtype=torch.long, device=device))[0].cpu()
                for s in samples}
        capture.close()
        workdir = Path(args.workdir)
        if args.endpoint:
            del model, capture, extractor
            gc.collect()
            served = measure_vllm(_served(cfg, endpoint_base_url(args.endpoint), Path(args.spool).absolute(), workdir,
                                          dtype), layer_ids, shape.hidden_size, samples, ours)
            served["startup_seconds"] = None  # a server the bench did not start
        else:
            model_dir = safetensors_copy(cfg.target, tokenizer, model)
            del model, capture, extractor
            gc.collect()  # the server gets the memory and the cores
            served = bench_vllm(cfg, model_dir, layer_ids, shape.hidden_size, samples, ours, workdir,
                                args.startup_timeout, dtype)

    result = {
        "model": f"{args.model}{'/' + args.gguf_file if args.gguf_file else ''}",
        "device": str(device),
        "dtype": dtype,
        "layer_ids": layer_ids,
        "num_layers": shape.num_layers,
        "samples": len(samples),
        "tokens": tokens,
        "batch_tokens": args.batch_tokens,
        "hooks_tok_s": round(tokens / min(hooks), 1),
        "full_forward_tok_s": round(tokens / min(full), 1),
        "speedup": round(min(full) / min(hooks), 3),
        "speedup_median": round(statistics.median(full) / statistics.median(hooks), 3),
        "extract_tok_s": hf_rate,
        "store_wait_seconds": store_wait[0],
        "store_wait_fraction": store_wait[1],
        "engines": {"hf": {"tokens_per_s": hf_rate}, **({"vllm": served} if served is not None else {})},
        "targets": TARGETS,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if key in ("targets", "engines"):
                continue
            target = TARGETS.get(key)
            beside = "" if target is None else f"   (target {'>=' if key == 'speedup' else '<='} {target})"
            print(f"{key:<22} {value}{beside}")
        for name, entry in result["engines"].items():
            print(f"engine {name:<15} " + ", ".join(f"{k} {v}" for k, v in entry.items())
                  + (f"   (target max_rel_vs_hf <= {TARGETS['max_rel_vs_hf']})" if "max_rel_vs_hf" in entry else ""))
    return 1 if served is not None and "error" in served else 0


def bench_vllm(cfg, model_dir: Path, layer_ids: list[int], hidden_size: int, samples, ours: dict[int, torch.Tensor],
               workdir: Path, startup_timeout: float, dtype: str) -> dict:
    """Start a vLLM extraction server on `model_dir` with `serve-command`'s flags, measure it (`measure_vllm`),
    stop it; its start-up is timed apart."""
    from dflash_stream.bench.regenerate import VLLM_ENV_COMMAND, vllm_env
    from dflash_stream.regenerate.servers import LocalServer, ServerError, vllm_python
    from dflash_stream.target_model.vllm_serve import extraction_args, server_env

    python = vllm_python()
    if not python.exists():
        return {"skipped": f"no vLLM environment ({python} not found)", "command": VLLM_ENV_COMMAND}
    spool = (workdir / "spool").absolute()
    shutil.rmtree(spool, ignore_errors=True)
    log_path = workdir / "logs" / "vllm-extract.log"
    log_path.unlink(missing_ok=True)
    # A SIGTERM (a timeout, the user) ends the bench through the `with`, which stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with LocalServer("vllm", model_dir, log_path, python=python, kv_cache_gib=1) as server:
        served_cfg = _served(cfg, server.url, spool, workdir, dtype)
        server.extra_args = (*extraction_args(served_cfg, layer_ids), "--enforce-eager")
        env = {**server_env(), **vllm_env("all", len(os.sched_getaffinity(0)))[0]}
        try:
            server.start(env)
            startup = server.wait_ready(startup_timeout)
        except ServerError as err:
            return {"error": str(err).splitlines()[0], "log": str(log_path)}
        entry = measure_vllm(served_cfg, layer_ids, hidden_size, samples, ours)
    return {**entry, "startup_seconds": round(startup, 1), "log": str(log_path)}


def _served(cfg, url: str, spool: Path, workdir: Path, dtype: str):
    """The bench's config with extract.engine vllm at `url`, writing into a fresh store under `workdir`, the
    target in `dtype` (what hf ran: our `auto` is float32 on a CPU, vLLM's the checkpoint's, often bf16)."""
    shutil.rmtree(workdir / "served", ignore_errors=True)
    return cfg.model_copy(update={
        "output_dir": str(workdir / "served"), "target": cfg.target.model_copy(update={"dtype": dtype}),
        "extract": cfg.extract.model_copy(update={"engine": "vllm", "endpoints": [url], "spool": str(spool)}),
        "store": cfg.store.model_copy(update={"path": str(workdir / "served" / "store")})})


def measure_vllm(served_cfg, layer_ids: list[int], hidden_size: int, samples, ours: dict[int, torch.Tensor]) -> dict:
    """Time the served extractor into a fresh store on `samples`, then ask for every sample's states once more and
    compare them, as the server wrote them, with `ours` (per layer over all tokens)."""
    from dflash_stream.pipeline.served_extractor import ServedExtractor
    from dflash_stream.target_model.served_states import Failed, StateClient
    from dflash_stream.target_model.vllm_serve import spool_dir

    store = open_store(served_cfg, layer_ids, hidden_size)
    metrics = MetricsWriter(served_cfg.output_dir, "extractor", 0)
    extractor = ServedExtractor(served_cfg, RoleInfo("extractor", 0, 1, 0, 1), store, metrics, torch.device("cpu"))
    extractor.run()
    metrics.close()
    rate = extractor.tokens_written / extractor.extract_seconds
    client = StateClient(served_cfg.extract, spool_dir(served_cfg), layer_ids, hidden_size, "bench-compare",
                         int(served_cfg.extract.spool_bytes), served_cfg.data.max_length)
    client.start()
    worst_diff, largest = torch.zeros(len(layer_ids)), torch.zeros(len(layer_ids))
    try:
        for sample in samples:
            client.submit(sample.sample_id, sample.input_ids.tolist(), None)
            served = client.next()
            if isinstance(served, Failed):
                return {"error": f"sample {served.key}: {served.error}"}
            theirs = served.states.float().view(sample.num_tokens, len(layer_ids), -1)
            mine = ours[sample.sample_id].float().view(theirs.shape)
            worst_diff = torch.maximum(worst_diff, (theirs - mine).abs().amax(dim=(0, 2)))
            largest = torch.maximum(largest, mine.abs().amax(dim=(0, 2)))
            dtype = str(served.states.dtype).removeprefix("torch.")
            served.release()
    finally:
        client.close()
    per_layer = (worst_diff / largest).tolist()
    return {"tokens_per_s": round(rate, 1), "max_rel_vs_hf": round(max(per_layer), 6),
            "max_rel_per_layer": [round(v, 6) for v in per_layer], "server_dtype": dtype,
            "samples": len(samples), "tokens": extractor.tokens_written}
