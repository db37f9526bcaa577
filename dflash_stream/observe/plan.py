"""`dflash-stream plan`: what a run will do, how much data it moves, whether it fits, how long it takes.

Everything comes from the config (plus the target's config.json / GGUF header when the model is local, and
OUTPUT/tune.json when `tune` has measured this model); every estimate carries the source it came from.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_stream.config import Config, ConfigError
from dflash_stream.observe.units import fmt_bytes, fmt_count, fmt_duration

# The codec's design ratio (store/codecs.py, measured on SmolLM2-135M states) until `tune` measures this target.
DESIGN_RATIO_NOTE = "measured on SmolLM2-135M states, README Benchmarks (run `tune` to measure this target)"
# Effective (not peak) throughput of one process when nothing was measured: H100-class bf16 at ~40 % MFU,
# or two CPU cores (SmolLM2-135M forwards ~700 tokens/s there, `bench extract`).
ASSUMED_FLOPS = {"gpu": 4.0e14, "cpu": 1.9e11}
ASSUMED_VOCAB = 151_936
THIN_MARGIN = 0.2  # warn when the disk left after the budget is under this fraction of the budget

PHASES = [
    ("data", "samples {sample_id, input_ids, loss_mask}: chat template, assistant loss mask, filtering, "
             "sharding over extractors (OUTPUT/data/)"),
    ("extract", "the target's forward up to the deepest captured layer: K layer states per token"),
    ("store", "compressed segments in the ring buffer at store.path, never more than store.budget on disk"),
    ("train", "DFlash drafter steps on claimed segments; checkpoints (OUTPUT/checkpoints/) free the segments"),
    ("export", "the drafter in z-lab format for vLLM/SGLang (OUTPUT/drafter/)"),
]


@dataclass
class TargetShape:
    num_layers: int
    hidden_size: int
    vocab_size: int | None
    intermediate_size: int | None
    source: str


def target_shape(cfg: Config) -> TargetShape:
    """Depth and width from target.num_layers/hidden_size, else from a local model's config (no download)."""
    t = cfg.target
    if t.num_layers and t.hidden_size:
        return TargetShape(t.num_layers, t.hidden_size, None, None, "config (target.num_layers, target.hidden_size)")
    from dflash_stream.target_model import load_target_config, model_location

    location, _ = model_location(t)
    if not Path(location).exists():
        raise ConfigError(
            f"target.model '{t.model}' is not a local folder: set target.num_layers and target.hidden_size "
            "so that plan needs no download"
        )
    tc = load_target_config(t)
    tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc  # multimodal targets nest it
    what = f"GGUF header of {t.gguf_file}" if t.gguf_file else f"{Path(location) / 'config.json'}"
    return TargetShape(
        tc.num_hidden_layers, tc.hidden_size, getattr(tc, "vocab_size", None),
        getattr(tc, "intermediate_size", None), what,
    )


def _count_rows(path: Path) -> int | None:
    """Rows of a local json/jsonl/parquet file, read cheaply; None when the layout is not a plain row list."""
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text())
            return len(rows) if isinstance(rows, list) else None
        except json.JSONDecodeError:
            pass  # JSON Lines under a .json name, which the datasets loader also accepts
    if path.suffix in (".json", ".jsonl"):
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return None


def source_rows(path: str) -> int | None:
    """Rows of a local source (file, or folder searched like the data loader does); None for hub datasets."""
    p = Path(path).expanduser()
    if p.is_dir():
        counts = [_count_rows(f) for f in sorted(p.rglob("*")) if f.suffix in (".json", ".jsonl", ".parquet")]
        return sum(counts) if counts and None not in counts else None
    return _count_rows(p) if p.is_file() else None


def read_tune(cfg: Config, shape: TargetShape, layer_ids: list[int]) -> tuple[dict[str, Any] | None, str | None]:
    """OUTPUT/tune.json when it was measured on this target and layer set; else (None, why it was ignored)."""
    path = Path(cfg.output_dir) / "tune.json"
    if not path.is_file():
        return None, None
    tune = json.loads(path.read_text())
    if tune.get("layer_ids") != layer_ids or tune.get("hidden_size") != shape.hidden_size:
        return None, f"{path} was measured on another target/layer set; ignored"
    return tune, None


def _layer_params(hidden: int, intermediate: int | None) -> int:
    """Weights of one Llama/Qwen-style decoder layer: attention ~4·D², gated MLP 3·D·I (I defaults to 8/3·D)."""
    inter = intermediate or (8 * hidden) // 3
    return 4 * hidden * hidden + 3 * hidden * inter


def estimated_rates(cfg: Config, shape: TargetShape, layer_ids: list[int], mean_tokens: float) -> dict[str, Any]:
    """Tokens/s of one extractor and one trainer from FLOP counts at an assumed effective device throughput."""
    kind = "cpu" if cfg.target.device == "cpu" else "gpu"
    flops = ASSUMED_FLOPS[kind]
    # Early stop: the forward runs only up to the deepest captured layer.
    extract_per_token = 2 * _layer_params(shape.hidden_size, shape.intermediate_size) * (max(layer_ids) + 1)
    d = cfg.drafter.hidden_size or shape.hidden_size
    vocab = shape.vocab_size or ASSUMED_VOCAB
    # Per block token: drafter layers forward+backward (6·P) and the frozen LM head (forward + input grad, 4·V·D).
    per_block_token = 6 * _layer_params(d, cfg.drafter.intermediate_size) * cfg.drafter.num_layers + 4 * vocab * d
    blocks = min(cfg.train.num_anchors, mean_tokens)
    per_sample = blocks * cfg.drafter.block_size * per_block_token + 6 * len(layer_ids) * shape.hidden_size * d * mean_tokens
    note = (f"estimated: FLOP count at an assumed {flops / 1e12:g} TFLOP/s effective per {kind.upper()} process"
            + ("" if shape.vocab_size else f", vocab assumed {ASSUMED_VOCAB:,}"))
    return {
        "extract_tok_s": flops / extract_per_token,
        "train_tok_s": flops * mean_tokens / per_sample,
        "note": note,
    }


def _rate(cfg_value: float | None, tuned: float | None, estimate: float, tune_note: str, est_note: str
          ) -> tuple[float, str]:
    """The first known of: a configured throughput, tune's measurement, the FLOP estimate."""
    if cfg_value:
        return cfg_value, "config"
    if tuned:
        return tuned, tune_note
    return estimate, est_note


def _samples(cfg: Config, samples: int | None) -> tuple[int | None, str]:
    from dflash_stream.data import plan_rows

    if samples:
        return samples, "given (--samples)"
    expected = cfg.data.expected_samples
    if expected:
        return expected, "config (data.expected_samples)"
    sizes, how = [], set()
    for src in cfg.data.sources:
        rows = source_rows(src.path)
        if rows is None and src.limit is None:
            return None, f"unknown: {src.path} is not a local file; pass --samples"
        sizes.append(min(rows, src.limit or rows) if rows is not None else src.limit)
        how.add("rows counted" if rows is not None else "source limit")
    # The data part's own row plan: limits, and weights that repeat rows.
    return len(plan_rows(cfg.data, sizes)), f"{' + '.join(sorted(how))}, before filtering"


def _mean_tokens(cfg: Config, mean_tokens: float | None, tune: dict | None) -> tuple[float, str]:
    if mean_tokens:
        return mean_tokens, "given (--mean-tokens)"
    configured = cfg.data.mean_tokens
    if configured:
        return configured, "config (data.mean_tokens)"
    if tune and tune.get("mean_tokens"):
        return tune["mean_tokens"], f"measured by tune on {tune['samples']} samples"
    return cfg.data.max_length / 2, "assumed: data.max_length / 2 (pass --mean-tokens or run tune)"


def disk_space(cfg: Config, budget: int) -> dict[str, Any]:
    """Free space where the store will live; an existing store's own files count as reusable."""
    store = Path(cfg.store.path).absolute()
    probe = store
    while not probe.exists():
        probe = probe.parent
    existing = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.is_dir() else 0
    free = shutil.disk_usage(probe).free + existing
    return {"checked": str(probe), "free_bytes": free, "store_existing_bytes": existing,
            "headroom_bytes": free - budget}


def build_plan(cfg: Config, samples: int | None = None, mean_tokens: float | None = None,
               processes: int = 1) -> dict[str, Any]:
    """The whole plan as plain data (what `plan --json` prints)."""
    from dflash_stream.observe.store_cores import store_cores
    from dflash_stream.store import codecs, sizes
    from dflash_stream.target_model import resolve_layer_ids

    shape = target_shape(cfg)
    layer_ids = resolve_layer_ids(shape.num_layers, cfg.target)
    warnings: list[str] = []
    tune, tune_ignored = read_tune(cfg, shape, layer_ids)
    if tune_ignored:
        warnings.append(tune_ignored)

    n_samples, samples_source = _samples(cfg, samples)
    mean, mean_source = _mean_tokens(cfg, mean_tokens, tune)
    tokens = n_samples * mean if n_samples else None

    codec = cfg.store.codec
    measured = (tune or {}).get("compression", {}).get(codec)
    ratio, ratio_source = (measured, f"measured by tune on {tune['tokens']:,} tokens") if measured else (
        codecs.get(codec).design_ratio, DESIGN_RATIO_NOTE if codec != "none" else "raw uint16")
    width = len(layer_ids) * shape.hidden_size
    per_token = sizes.raw_bytes_per_token(width)
    raw_tok = per_token - sizes.IDS_MASK_BYTES_PER_TOKEN
    stored_tok = per_token / ratio
    passes, reuse = cfg.extraction_passes, cfg.store.reuse
    volume = {
        "codec": codec, "ratio": ratio, "ratio_source": ratio_source,
        "raw_bytes_per_token": raw_tok, "stored_bytes_per_token": stored_tok,
        "ids_mask_bytes_per_token": sizes.IDS_MASK_BYTES_PER_TOKEN,
        "raw_bytes_per_sample": raw_tok * mean, "stored_bytes_per_sample": stored_tok * mean,
        "full_dump_raw_bytes": per_token * tokens if tokens else None,
        "full_dump_stored_bytes": stored_tok * tokens if tokens else None,
    }

    budget = int(cfg.store.budget)
    segment_raw = int(cfg.store.segment_bytes)
    segment_stored = segment_raw / ratio
    # The one rule `Store.open` applies too: below it, opening the store is refused.
    largest = sizes.max_segment_raw_bytes(int(cfg.store.segment_bytes), cfg.data.max_length, width)
    min_budget = sizes.smallest_budget(cfg.store.path, largest, width, codec)
    written = volume["full_dump_stored_bytes"] * passes if tokens else None
    buffer = {
        "budget_bytes": budget, "segment_raw_bytes": segment_raw, "segment_stored_bytes": segment_stored,
        "segments_in_budget": int(budget // segment_stored),
        "segments_per_pass": math.ceil(per_token * tokens / segment_raw) if tokens else None,
        "passes": passes, "reuse": reuse, "bytes_written": written,
        "wraps": written / budget if written else None,
        "min_budget_bytes": min_budget,
    }
    if budget < min_budget:
        warnings.append(f"store.budget {fmt_bytes(budget)} is under the smallest workable budget "
                        f"({fmt_bytes(min_budget)}, one worst-case segment): opening the store will be refused")
    elif budget < 4 * segment_stored:
        warnings.append(f"store.budget holds only {buffer['segments_in_budget']} segments: the trainer will "
                        "often wait for the extractor; lower store.segment_bytes or raise the budget")

    disk = disk_space(cfg, budget)
    if disk["headroom_bytes"] < 0:
        warnings.append(f"store.budget {fmt_bytes(budget)} exceeds the free space at {disk['checked']} "
                        f"({fmt_bytes(disk['free_bytes'])})")
    elif disk["headroom_bytes"] < THIN_MARGIN * budget:
        warnings.append(f"thin disk margin: {fmt_bytes(disk['headroom_bytes'])} left after the budget at "
                        f"{disk['checked']} (checkpoints and logs need room too)")
    if written and volume["full_dump_raw_bytes"] > disk["free_bytes"]:
        disk["offline_note"] = (f"an offline pipeline would need {fmt_bytes(volume['full_dump_raw_bytes'])}; "
                                f"{fmt_bytes(disk['free_bytes'])} is free")

    time_plan = _time_plan(cfg, shape, layer_ids, mean, tokens, processes, tune)
    return {
        "target": {"model": cfg.target.model, "source": shape.source, "num_layers": shape.num_layers,
                   "hidden_size": shape.hidden_size, "layer_ids": layer_ids,
                   "layer_ids_source": "target.layer_ids" if cfg.target.layer_ids else "DFlash rule"},
        "data": {"samples": n_samples, "samples_source": samples_source, "mean_tokens": mean,
                 "mean_tokens_source": mean_source, "tokens": tokens},
        "phases": [{"name": n, "produces": p} for n, p in PHASES],
        "volume": volume, "buffer": buffer, "disk": disk, "time": time_plan,
        "epochs": _epoch_costs(cfg, time_plan, volume, tokens),
        "store_cores": store_cores(codec, width, time_plan, tune),
        "warnings": warnings,
    }


def _time_plan(cfg: Config, shape: TargetShape, layer_ids: list[int], mean: float, tokens: float | None,
               processes: int, tune: dict | None) -> dict[str, Any]:
    from dflash_stream.store import codecs

    extractors, trainers = cfg.roles.split(processes)
    overlapped = extractors > 0
    extractors, trainers = max(extractors, 1), max(trainers, 1)
    est = estimated_rates(cfg, shape, layer_ids, mean)
    tune_note = f"measured by tune ({tune.get('device', '?')})" if tune else ""
    ext_rate, ext_src = _rate(cfg.extract.tokens_per_s, (tune or {}).get("extract_tok_s"),
                              est["extract_tok_s"], tune_note, est["note"])
    train_rate, train_src = _rate(cfg.train.tokens_per_s, (tune or {}).get("train_tok_s"),
                                  est["train_tok_s"], tune_note, est["note"])
    data_note = ("not estimated: regeneration decodes up to data.generation.max_new_tokens per sample with the "
                 "target, typically longer than extraction itself" if cfg.data.regenerate
                 else "tokenization only: seconds to minutes, before each extractor starts")
    phases: dict[str, Any] = {
        "data": {"source": data_note},
        "extract": {"tok_s_per_process": ext_rate, "processes": extractors, "source": ext_src},
        "train": {"tok_s_per_process": train_rate, "processes": trainers, "source": train_src},
        "store": {"encode_bytes_per_s": codecs.get(cfg.store.codec).design_encode_bytes_per_core_s,
                  "source": "`bench store` (encode, one core); runs beside the forward"},
        "export": {"source": "seconds: the drafter's weights and config.json, once at the end"},
    }
    written = (tune or {}).get("write_bytes_per_s", {}).get(cfg.store.codec)
    if written:
        phases["store"].update(encode_bytes_per_s=written, source=f"{tune_note}, encode + write; beside the forward")
    if not tokens:
        return {"processes": processes, "overlapped": overlapped, "phases": phases, "total_seconds": None}
    phases["extract"]["seconds"] = tokens * cfg.extraction_passes / (ext_rate * extractors)
    phases["train"]["seconds"] = tokens * cfg.train.epochs / (train_rate * trainers)
    raw = tokens * cfg.extraction_passes * shape.hidden_size * len(layer_ids) * 2
    phases["store"]["encode_cpu_seconds"] = raw / phases["store"]["encode_bytes_per_s"]
    ext_s, train_s = phases["extract"]["seconds"], phases["train"]["seconds"]
    # Split roles stream: the slower side sets the pace. One process alternates, so the phases add up.
    total = max(ext_s, train_s) if overlapped else ext_s + train_s
    return {"processes": processes, "overlapped": overlapped, "phases": phases, "total_seconds": total}


def _epoch_costs(cfg: Config, time_plan: dict, volume: dict, tokens: float | None) -> dict[str, Any]:
    """What epochs cost with each `train.epoch_source`."""
    epochs = cfg.train.epochs
    ext = time_plan["phases"]["extract"]
    once = tokens / (ext["tok_s_per_process"] * ext["processes"]) if tokens else None
    stored = volume["full_dump_stored_bytes"]
    return {
        "epochs": epochs, "chosen": cfg.train.epoch_source,
        "reuse": {"extract_seconds": once, "bytes_written": stored,
                  "note": "extract once; each segment is trained on `epochs` times before it is freed, so "
                          "epochs interleave within the buffer's window instead of full passes"},
        "reextract": {"extract_seconds": once * epochs if once else None,
                      "bytes_written": stored * epochs if stored else None,
                      "note": "run the target every epoch: full reshuffle per epoch, extraction cost x epochs"},
    }


def render_plan(plan: dict[str, Any]) -> str:
    """The plan as a terminal page."""
    from dflash_stream.observe.store_cores import render_store_cores

    t, d, v, b, disk, tp = (plan[k] for k in ("target", "data", "volume", "buffer", "disk", "time"))
    out = [
        f"target  {t['model']}: {t['num_layers']} layers, hidden {t['hidden_size']}  [{t['source']}]",
        f"        layer ids {t['layer_ids']}  [{t['layer_ids_source']}]",
        f"data    {fmt_count(d['samples'])} samples  [{d['samples_source']}]",
        f"        {d['mean_tokens']:,.0f} tokens per sample  [{d['mean_tokens_source']}]"
        f"  -> {fmt_count(d['tokens'])} tokens",
        "", "pipeline",
    ]
    out += [f"  {i}. {p['name']:<8} {p['produces']}" for i, p in enumerate(plan["phases"], 1)]
    out += [
        "", f"data volume  (codec {v['codec']}: {v['ratio']:.2f}x  [{v['ratio_source']}])",
        f"  {'':<22}{'raw bf16':>14}{'stored':>14}",
        f"  {'per token':<22}{v['raw_bytes_per_token']:>12,} B{v['stored_bytes_per_token']:>12,.0f} B",
        f"  {'per average sample':<22}{fmt_bytes(v['raw_bytes_per_sample']):>14}"
        f"{fmt_bytes(v['stored_bytes_per_sample']):>14}",
        f"  {'full dump (offline)':<22}{fmt_bytes(v['full_dump_raw_bytes']):>14}"
        f"{fmt_bytes(v['full_dump_stored_bytes']):>14}",
        f"  (raw per token is the states alone; the totals add {v['ids_mask_bytes_per_token']} B per token of ids and "
        "loss mask stored beside them)",
        "", "ring buffer",
        f"  budget {fmt_bytes(b['budget_bytes'])}: {b['segments_in_budget']} segments of "
        f"{fmt_bytes(b['segment_raw_bytes'])} raw / {fmt_bytes(b['segment_stored_bytes'])} stored",
        f"  {fmt_count(b['segments_per_pass'])} segments per extraction pass x {b['passes']} pass(es); "
        f"{_fmt_wraps(b['wraps'])}",
        f"  disk at {disk['checked']}: {fmt_bytes(disk['free_bytes'])} free, "
        f"{fmt_bytes(disk['headroom_bytes'])} left after the budget",
    ]
    if "offline_note" in disk:
        out.append(f"  {disk['offline_note']}")
    mode = "extractors and trainers side by side" if tp["overlapped"] else "one process alternates"
    out += ["", f"time  ({tp['processes']} process(es), {mode})"]
    out.append(f"  {'data':<8}{'-':>10}  {tp['phases']['data']['source']}")
    for name in ("extract", "train"):
        ph = tp["phases"][name]
        out.append(f"  {name:<8}{fmt_duration(ph.get('seconds')):>10}  {ph['tok_s_per_process']:>12,.0f} tok/s x "
                   f"{ph['processes']}  [{ph['source']}]")
    st = tp["phases"]["store"]
    out.append(f"  {'store':<8}{fmt_duration(st.get('encode_cpu_seconds')):>10}  encoding, summed over extractors "
               f"[{st['source']}]")
    out.append(f"  {'export':<8}{'-':>10}  {tp['phases']['export']['source']}")
    out.append(f"  {'total':<8}{fmt_duration(tp['total_seconds']):>10}")
    e = plan["epochs"]
    out += ["", f"epochs  {e['epochs']} with epoch_source={e['chosen']}"]
    for name in ("reuse", "reextract"):
        c = e[name]
        out.append(f"  {name:<10} extraction {fmt_duration(c['extract_seconds'])}, writes "
                   f"{fmt_bytes(c['bytes_written'])}: {c['note']}")
    out += render_store_cores(plan["store_cores"])
    out += [f"\nwarning: {w}" for w in plan["warnings"]]
    return "\n".join(out)


def _fmt_wraps(wraps: float | None) -> str:
    if wraps is None:
        return "the buffer wraps ? times"
    return f"the buffer wraps {wraps:,.1f} times" if wraps > 1 else "all the data fits: the buffer never wraps"
