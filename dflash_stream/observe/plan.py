"""`dflash-stream plan`: what a run will do, how much data it moves, whether it fits, how long it takes.

Everything comes from the config (plus the target's config.json / GGUF header when the model is local, the
accelerate launch file, and OUTPUT/tune.json when `tune` has measured this model); every estimate carries the
source it came from. The arithmetic lives in `sizing/` (memory per role, the disk footprint, the roles' rates and
the split of the launch, checkpoints and crashes under each release rule); this module adds what only the plan
shows (data volumes, the buffer's wraps, time per phase, epochs) and renders the whole page.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import yaml

from dflash_stream.config import REPLAY_WINDOW_BYTES, Config, ConfigError
from dflash_stream.sizing.checkpoints import CRASH_COST_WARN_SECONDS, checkpoint_costs
from dflash_stream.sizing.disk import existing_ancestor, footprint_for, refusal
from dflash_stream.sizing.inputs import plan_mean_tokens, plan_samples, read_tune
from dflash_stream.sizing.memory import memory_plan
from dflash_stream.sizing.work import device_kind, forward_passes, role_work, split_plan
from dflash_stream.target_model.gguf_cache import cache_root, planned
from dflash_stream.target_model.loading import GPU_EXTRA_INSTALL, TORCH_GDN_SLOWDOWN, resolve_dtype
from dflash_stream.target_model.location import gguf_source
from dflash_stream.target_model.shape import LINEAR, TargetShape, target_shape
from dflash_stream.target_model.vllm_serve import spool_dir
from dflash_stream.units import fmt_bytes, fmt_count, fmt_duration

# The codec's design ratio (store/codecs.py, measured on SmolLM2-135M states) until `tune` measures this target.
DESIGN_RATIO_NOTE = "measured on SmolLM2-135M states, docs/benchmarks.md (run `tune` to measure this target)"
CHECKPOINT_STALL_WARN = 0.05  # warn when checkpoints stop training for more than this share of its time
THIN_MARGIN = 0.2  # warn when the disk left after the budget is under this fraction of the budget
REUSE_WINDOW_STEPS_MEASURED = 4.5
"""The smallest buffer window, in optimizer steps of samples, at which `bench quality` measured a drafter
trained with epoch_source reuse as good as offline (docs/benchmarks.md, Quality: 34 samples at 10 % of its dump, 7.5
samples per 1,024-token step); at 2 % (0.9 steps) its held-out loss was 4 % worse. With reuse a sample's epochs
fall that many steps apart, so steps (not the share of the dump) say how close its repeats come. Steps are
counted as here: batch_tokens x grad_accum x trainers over the mean sample length."""

PHASES = [
    ("data", "samples {sample_id, input_ids, loss_mask}: chat template, assistant loss mask, filtering, "
             "sharding over extractors (OUTPUT/data/)"),
    ("extract", "the target's forward up to the deepest captured layer: K layer states per token"),
    ("store", "compressed segments in the ring buffer at store.path, never more than store.budget on disk"),
    ("train", "DFlash drafter steps on claimed segments, which leave the buffer once trained (train.release); "
              "checkpoints in OUTPUT/checkpoints/"),
    ("export", "the drafter in z-lab format for vLLM/SGLang (OUTPUT/drafter/)"),
]


def read_launch(path: str | None, processes: int | None) -> dict[str, Any]:
    """Processes of the launch: an accelerate config file (num_processes counts all machines), or --processes."""
    if path is None:
        n = processes or 1
        source = "--processes" if processes else "default: one process (pass --launch FILE or --processes N)"
        return {"num_processes": n, "num_machines": 1, "processes_per_machine": n, "source": source}
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--launch: {path} not found")
    try:
        tree = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"--launch: {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--launch: {path} must hold an accelerate config (a mapping)")
    n, machines = tree.get("num_processes", 1), tree.get("num_machines", 1)
    if not (isinstance(n, int) and isinstance(machines, int) and n >= machines >= 1 and n % machines == 0):
        raise ConfigError(f"--launch: {path}: num_processes ({n}) must be a multiple of num_machines ({machines}) "
                          "and both at least 1")
    return {"num_processes": n, "num_machines": machines, "processes_per_machine": n // machines,
            "source": str(path)}


def disk_space(cfg: Config, budget: int) -> dict[str, Any]:
    """Free space where the store will live; an existing store's own files count as reusable."""
    store = Path(cfg.store.path).absolute()
    probe = existing_ancestor(store)
    existing = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.is_dir() else 0
    free = shutil.disk_usage(probe).free + existing
    return {"checked": str(probe), "free_bytes": free, "store_existing_bytes": existing,
            "headroom_bytes": free - budget}


def build_plan(cfg: Config, samples: int | None = None, mean_tokens: float | None = None,
               processes: int | None = None, launch_file: str | None = None,
               gpu_memory: int | None = None) -> dict[str, Any]:
    """The whole plan as plain data (what `plan --json` prints)."""
    from dflash_stream.observe.store_cores import store_cores
    from dflash_stream.sizing.host_memory import busiest_machine, host_memory
    from dflash_stream.store import codecs, sizes
    from dflash_stream.target_model import resolve_layer_ids, stored_layer_ids

    launch = read_launch(launch_file, processes)
    shape = target_shape(cfg.target)
    layer_ids = resolve_layer_ids(shape.num_layers, cfg.target)
    stored = stored_layer_ids(shape.num_layers, cfg.target, cfg.verifier_states)  # + the verifier's last layer
    warnings: list[str] = []
    tune, tune_ignored = read_tune(cfg, shape, layer_ids)
    if tune_ignored:
        warnings.append(tune_ignored)

    n_samples, samples_source = plan_samples(cfg, samples)
    mean, mean_source = plan_mean_tokens(cfg, mean_tokens, tune)
    tokens = n_samples * mean if n_samples else None

    codec = cfg.store.codec
    measured = (tune or {}).get("compression", {}).get(codec)
    ratio, ratio_source = (measured, f"measured by tune on {tune['tokens']:,} tokens") if measured else (
        codecs.get(codec).design_ratio, DESIGN_RATIO_NOTE if codec != "none" else "raw uint16")
    width = len(stored) * shape.hidden_size
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
        # With epoch_source reuse a sample's epochs all happen while its segment sits in the buffer.
        "window_fraction": budget / volume["full_dump_stored_bytes"] if tokens else None,
        "window_samples": budget / volume["stored_bytes_per_sample"] if mean else None,
    }
    if cfg.extract.from_store:
        # Later passes reshuffle what they replay: each extractor holds that much of decoded states at a time.
        buffer["replay"] = {"from_store": cfg.extract.from_store,
                            "host_bytes_per_extractor": REPLAY_WINDOW_BYTES if passes > 1 else 0}
    if budget < min_budget:
        warnings.append(f"store.budget {fmt_bytes(budget)} is under the smallest workable budget "
                        f"({fmt_bytes(min_budget)}, one worst-case segment): opening the store will be refused")
    elif budget < 4 * segment_stored:
        warnings.append(f"store.budget holds only {buffer['segments_in_budget']} segments: the trainer will "
                        "often wait for the extractor; lower store.segment_bytes or raise the budget")

    disk = disk_space(cfg, budget)
    disk.update(footprint_for(cfg, shape, len(layer_ids), n_samples, mean, tune, ratio))
    if (conversion := gguf_conversion_plan(cfg, shape)) is not None:
        disk["gguf_conversion"] = conversion
    if not disk["fits"]:
        warnings.append(f"{refusal(cfg, disk)}; `run` refuses to start")
    if disk["headroom_bytes"] < 0:
        warnings.append(f"store.budget {fmt_bytes(budget)} exceeds the free space at {disk['checked']} "
                        f"({fmt_bytes(disk['free_bytes'])})")
    elif disk["headroom_bytes"] < THIN_MARGIN * budget:
        warnings.append(f"thin disk margin: {fmt_bytes(disk['headroom_bytes'])} left after the budget at "
                        f"{disk['checked']} (checkpoints and logs need room too)")
    if written and volume["full_dump_raw_bytes"] > disk["free_bytes"]:
        disk["offline_note"] = (f"an offline pipeline would need {fmt_bytes(volume['full_dump_raw_bytes'])}; "
                                f"{fmt_bytes(disk['free_bytes'])} is free")

    work = role_work(cfg, shape, layer_ids, mean, tune)
    regen = work["regenerate"]
    if regen and regen.get("weights_fit") is False:
        gen = cfg.data.generation
        warnings.append(f"the target's weights ({fmt_bytes(regen['weight_bytes'])}) do not fit the memory of one "
                        f"endpoint's {gen.gpus_per_endpoint} GPU(s), so the regeneration estimate means little: "
                        "raise data.generation.gpus_per_endpoint (tensor parallel), or measure the servers and set "
                        "data.generation.tokens_per_s")
    roles = split_plan(cfg, launch["num_processes"], work, n_samples)
    # Padding makes real batches hold fewer samples than this: the window in steps is if anything larger.
    samples_per_step = cfg.train.batch_tokens * cfg.train.grad_accum * roles["trainers"] / mean
    buffer["window_steps"] = buffer["window_samples"] / samples_per_step if buffer["window_samples"] else None
    steps = buffer["window_steps"]
    if cfg.train.epoch_source == "reuse" and cfg.train.epochs > 1 and steps is not None \
            and steps < REUSE_WINDOW_STEPS_MEASURED:
        warnings.append(
            f"the buffer holds ~{fmt_count(buffer['window_samples'])} samples, ~{steps:.1f} optimizer steps of them, "
            f"and with train.epoch_source=reuse each sample's {cfg.train.epochs} epochs fall within that window; "
            f"`bench quality` found reuse as good as offline with a window of {REUSE_WINDOW_STEPS_MEASURED} steps "
            "and 4 % worse in held-out loss at 0.9 (docs/benchmarks.md, Quality): raise store.budget, or use "
            "epoch_source=reextract (a full reshuffle per epoch, the target run every epoch)")
    if roles.get("better"):
        warnings.append(roles["better"])
    if work["extract"]["engine"] == "vllm" and device_kind(cfg) == "gpu" and roles["mode"] == "split":
        e, t = roles["extractors"], roles["trainers"]
        warnings.append(
            f"extract.engine vllm: the {e} extractor(s) only ask the servers, so the GPUs counted are the {t} "
            f"trainers': launch them apart (`accelerate launch --num_processes {t} -m dflash_stream train` on the "
            f"GPUs, `accelerate launch --cpu --num_processes {e} -m dflash_stream extract` beside it, one store); "
            "inside one `run` launch each extractor rank would hold a GPU it does not use")
    time_plan = _time_plan(cfg, shape, layer_ids, work, roles, n_samples, tokens, launch["num_processes"], tune)
    time_plan["checkpoints"] = checkpoint_plan(cfg, time_plan, volume, disk, roles, tokens)
    warnings += checkpoint_warnings(time_plan["checkpoints"])
    memory = memory_plan(cfg, shape, layer_ids, device_kind(cfg), gpu_memory, launch["processes_per_machine"],
                         single=roles["mode"] == "single")
    warnings += [f"the {role} does not fit its device ({fmt_bytes(memory[role]['total_bytes'])} of "
                 f"{fmt_bytes(memory['usable_bytes'])} usable): {memory[role]['knob']}"
                 for role in ("extractor", "trainer") if not memory[role]["fits"]]
    host = host_memory(cfg, width, ratio, time_plan["checkpoints"]["bytes"], n_samples)
    host["machine"] = machine = busiest_machine(host, roles, launch)
    if machine["bytes"] > machine["this_machine_bytes"]:
        warnings.append(f"host memory: the busiest machine's processes may hold {fmt_bytes(machine['bytes'])} of "
                        f"hidden states and checkpoint snapshot beside their runtimes, more than this machine's "
                        f"{fmt_bytes(machine['this_machine_bytes'])} of RAM; lower it with {host['knobs']}")
    return {
        "target": {"model": cfg.target.model, "source": shape.source, **shape.summary(), "layer_ids": layer_ids,
                   "layer_ids_source": "target.layer_ids" if cfg.target.layer_ids else "DFlash rule",
                   "verifier_layer": stored[-1] if cfg.verifier_states else None},
        "launch": launch,
        "data": {"samples": n_samples, "samples_source": samples_source, "mean_tokens": mean,
                 "mean_tokens_source": mean_source, "tokens": tokens},
        "phases": [{"name": n, "produces": p} for n, p in PHASES],
        "volume": volume, "buffer": buffer, "disk": disk, "time": time_plan, "roles": roles, "memory": memory,
        "extract": {**work["extract"], "spool": str(spool_dir(cfg)) if work["extract"]["engine"] == "vllm" else None},
        "epochs": _epoch_costs(cfg, time_plan, volume, tokens),
        "store_cores": store_cores(codec, width, time_plan, tune),
        "kernels": kernel_assumptions(shape, device_kind(cfg)),
        "host_memory": host,
        "warnings": warnings,
    }


def gguf_conversion_plan(cfg: Config, shape: TargetShape) -> dict[str, Any] | None:
    """A GGUF target's safetensors conversion in the user's cache (`gguf_cache`), in the dtype the run loads it in;
    None for other targets. It is not part of the run's footprint: it is written only where it takes at most a
    tenth of the free space."""
    source = gguf_source(cfg.target)
    if source is None or not source.is_file() or not shape.num_parameters:
        return None
    import torch  # here only: `plan` on a config without a local model never imports torch

    dtype = resolve_dtype(cfg.target, torch.device("cpu" if device_kind(cfg) == "cpu" else "cuda"))
    free = shutil.disk_usage(existing_ancestor(cache_root())).free
    return planned(source, dtype, int(shape.num_parameters) * dtype.itemsize, free)


def kernel_assumptions(shape: TargetShape, kind: str) -> list[str]:
    """The kernels plan's rates assume for this target's layer types (empty for plain attention targets)."""
    if LINEAR not in shape.layer_type_counts:
        return []
    if kind == "cpu":
        return ["Gated-DeltaNet layers: transformers' torch path (flash-linear-attention and causal-conv1d are "
                "GPU kernels)"]
    return [f"Gated-DeltaNet layers via flash-linear-attention + causal-conv1d (`{GPU_EXTRA_INSTALL}`); without "
            f"them transformers' torch path is ~{TORCH_GDN_SLOWDOWN:.1f}x slower (transformers #48718: 1.22 s vs "
            "0.70 s per step), and `run` says so when it loads the target"]


def gpu_count(cfg: Config, processes: int, trainers: int) -> dict[str, int]:
    """GPUs the run occupies: the launch's processes (one GPU each; with extract.engine vllm only the trainers,
    the extractors asking the servers from CPU processes), the extraction servers (extract.endpoints x
    extract.tensor_parallel_size) and the regeneration servers that are not also extraction servers
    (data.generation.endpoints x gpus_per_endpoint, only when data.regenerate asks them). All 0 on CPU."""
    if device_kind(cfg) == "cpu":
        return {"launch": 0, "extraction_servers": 0, "regeneration_servers": 0, "serving": 0, "total": 0}
    gen, ext = cfg.data.generation, cfg.extract
    vllm = ext.engine == "vllm"
    extracting = ext.endpoints if vllm else []
    regenerating = [u for u in gen.endpoints if u not in extracting] if cfg.data.regenerate and gen.engine == "openai" \
        else []
    out = {"launch": trainers if vllm else processes, "extraction_servers": len(extracting) * ext.tensor_parallel_size,
           "regeneration_servers": len(regenerating) * gen.gpus_per_endpoint}
    out["serving"] = out["extraction_servers"] + out["regeneration_servers"]
    out["total"] = out["launch"] + out["serving"]
    return out


def _time_plan(cfg: Config, shape: TargetShape, layer_ids: list[int], work: dict[str, Any], roles: dict[str, Any],
               samples: int | None, tokens: float | None, processes: int, tune: dict | None) -> dict[str, Any]:
    """Seconds per phase and in all. Keys beside `phases`: `regenerate` (the estimate), `regenerate_seconds`,
    `extract_side_seconds` (what the extraction side takes: regeneration + extraction with engine hf, their max
    with engine openai, whose servers answer while the extractors extract the windows already answered),
    `total_seconds`, and `gpus` {launch, serving, total} (`gpu_count`)."""
    from dflash_stream.store import codecs
    from dflash_stream.target_model import stored_layer_ids

    overlapped = roles["mode"] == "split"
    extractors, trainers = roles["extractors"], roles["trainers"]
    regen = work["regenerate"]
    vllm = work["extract"]["engine"] == "vllm"
    computing = work["extract"]["servers"] if vllm else extractors  # the processes whose forwards extract
    served = bool(regen) and regen["engine"] == "openai"
    data_note = "tokenization only: seconds to minutes, before each extractor starts"
    if served:
        data_note = (f"regeneration on {regen['endpoints']} endpoint(s) beside the launch, overlapped with "
                     f"extraction: {regen['tokens_per_s']:,.0f} tok/s per endpoint [{regen['tokens_per_s_source']}]; "
                     + "; ".join(regen["assumptions"]))
    elif regen:
        data_note = ("regeneration on the extractors before they extract: bandwidth-bound decoding, "
                     + "; ".join(regen["assumptions"]))
    phases: dict[str, Any] = {
        "data": {"source": data_note},
        "extract": {"tok_s_per_process": work["extract_tok_s"], "processes": computing,
                    "source": work["extract_source"]},
        "train": {"tok_s_per_process": work["train_tok_s"], "processes": trainers, "source": work["train_source"]},
        "store": {"encode_bytes_per_s": codecs.get(cfg.store.codec).design_encode_bytes_per_core_s,
                  "source": "`bench store` (encode, one core); runs beside the forward"},
        "export": {"source": "seconds: the drafter's weights and config.json, once at the end"},
    }
    written = (tune or {}).get("write_bytes_per_s", {}).get(cfg.store.codec)
    if written:
        phases["store"].update(encode_bytes_per_s=written,
                               source=f"measured by tune ({tune.get('device', '?')}), encode + write; beside the forward")
    out = {"processes": processes, "overlapped": overlapped, "phases": phases, "regenerate": regen,
           "regenerate_seconds": None, "extract_side_seconds": None, "total_seconds": None,
           "gpus": gpu_count(cfg, processes, trainers)}
    if not tokens:
        return out
    # hf: each extractor regenerates its shard; openai: the endpoints share all the answers, whatever the split.
    regen_s = samples * regen["seconds_per_sample"] / (1 if served else extractors) if regen else 0.0
    if regen:
        phases["data"]["seconds"] = out["regenerate_seconds"] = regen_s
    phases["extract"]["seconds"] = tokens * forward_passes(cfg.extraction_passes, regen) / (work["extract_tok_s"] * computing)
    phases["train"]["seconds"] = tokens * cfg.train.epochs / (work["train_tok_s"] * trainers)
    raw = tokens * cfg.extraction_passes * shape.hidden_size * len(stored_layer_ids(
        shape.num_layers, cfg.target, cfg.verifier_states)) * 2
    phases["store"]["encode_cpu_seconds"] = raw / phases["store"]["encode_bytes_per_s"]
    extract_s, train_s = phases["extract"]["seconds"], phases["train"]["seconds"]
    # hf: an extractor decodes, then extracts; openai: the servers answer beside the launch, and the extractors
    # extract each window as soon as its answers are in, so the slower of the two sets the extraction side's pace.
    # (With engine vllm on the regeneration servers themselves, they answer and extract in turn.)
    shared = vllm and work["extract"]["regenerates_too"]
    ext_s = out["extract_side_seconds"] = max(regen_s, extract_s) if served and not shared else regen_s + extract_s
    if overlapped:  # split roles stream: the slower side sets the pace
        out["total_seconds"] = max(ext_s, train_s)
    elif served:  # one process alternates extraction and training while the servers answer beside it
        out["total_seconds"] = max(regen_s, extract_s + train_s)
    else:  # one process alternates, so the phases add up
        out["total_seconds"] = ext_s + train_s
    return out


def checkpoint_plan(cfg: Config, time_plan: dict[str, Any], volume: dict[str, Any], disk: dict[str, Any],
                    roles: dict[str, Any], tokens: float | None) -> dict[str, Any]:
    """Checkpoints and a crash's cost under each release rule, from this plan's rates (`sizing/checkpoints.py`)."""
    phases = time_plan["phases"]
    train, extract = phases["train"], phases["extract"]
    train_tok_s = train["tok_s_per_process"] * train["processes"]
    return checkpoint_costs(
        cfg, checkpoint_bytes=disk["parts"]["checkpoints"] / (cfg.train.keep_checkpoints + 1), kind=device_kind(cfg),
        train_seconds=train.get("seconds"), train_tok_s=train_tok_s,
        step_seconds=cfg.train.batch_tokens * cfg.train.grad_accum * roles["trainers"] / train_tok_s,
        extract_side_seconds=time_plan["extract_side_seconds"],
        # One process alternating extracts at one extractor's pace.
        extract_tok_s=extract["tok_s_per_process"] * max(extract["processes"], 1), tokens=tokens,
        stored_bytes_per_token=volume["stored_bytes_per_token"])


def checkpoint_warnings(c: dict[str, Any]) -> list[str]:
    """When the configured release rule's checkpoints stop training too long, or a crash costs too much."""
    warnings = []
    if c["stall_fraction"] is not None and c["stall_fraction"] > CHECKPOINT_STALL_WARN:
        knob = ("raise store.budget (the release rule forces fewer), set train.release: on_use (checkpoints on "
                "your clock)" if c["rule"] == "after_checkpoint" else
                "raise train.checkpoint_every_s or train.checkpoint_every")
        warnings.append(
            f"checkpoints stop training for {c['stall_fraction']:.0%} of its time ({fmt_bytes(c['bytes'])} written "
            f"every {fmt_duration(c['every_seconds'])}, {c['forced_by']}): {knob}, or set "
            "train.optimizer_state_dtype: bfloat16 (smaller checkpoints)")
    chosen = c["rules"][c["rule"]]
    if chosen is not None and chosen["crash_seconds"] > CRASH_COST_WARN_SECONDS:
        again = (f" and {fmt_duration(chosen['reextract_seconds'])} of re-extraction" if chosen["reextract_seconds"]
                 else "")
        warnings.append(
            f"one crash may cost {fmt_duration(chosen['crash_seconds'])}: "
            f"{fmt_duration(chosen['training_lost_seconds'])} of training since the latest checkpoint{again}: lower "
            "train.checkpoint_every_s" + (", or set train.release: after_checkpoint when extraction costs far more "
                                          "than training" if c["rule"] == "on_use" else ""))
    return warnings


def _epoch_costs(cfg: Config, time_plan: dict, volume: dict, tokens: float | None) -> dict[str, Any]:
    """What epochs cost with each `train.epoch_source`."""
    epochs = cfg.train.epochs
    ext = time_plan["phases"]["extract"]
    once = tokens / (ext["tok_s_per_process"] * ext["processes"]) if tokens else None
    stored = volume["full_dump_stored_bytes"]
    regen = time_plan["regenerate"]
    return {
        "epochs": epochs, "chosen": cfg.train.epoch_source,
        "reuse": {"extract_seconds": once * forward_passes(1, regen) if once else None, "bytes_written": stored,
                  "note": "extract once; each segment is trained on `epochs` times before it is freed, so "
                          "epochs interleave within the buffer's window instead of full passes"},
        "reextract": {"extract_seconds": once * forward_passes(epochs, regen) if once else None,
                      "bytes_written": stored * epochs if stored else None,
                      "note": "run the target every epoch: full reshuffle per epoch, extraction cost x epochs"},
    }


def _fmt_layer_types(counts: dict[str, int]) -> str:
    return " + ".join(f"{n} {kind.removesuffix('_attention')}" for kind, n in counts.items())


def _fmt_params(t: dict[str, Any]) -> str:
    total, active = t.get("num_parameters"), t.get("active_parameters")
    if not total:
        return "parameters unknown"
    if active and active < 0.99 * total:
        return f"{total / 1e9:.1f}B parameters, {active / 1e9:.1f}B active"
    return f"{total / 1e9:.1f}B parameters"


def _fmt_share(share: float | None) -> str:
    return "?" if share is None else f"{share:.2%}"


def render_plan(plan: dict[str, Any]) -> str:
    """The plan as a terminal page."""
    from dflash_stream.observe.store_cores import render_store_cores

    t, d, v, b, disk, tp = (plan[k] for k in ("target", "data", "volume", "buffer", "disk", "time"))
    out = [
        f"target  {t['model']}: {t['num_layers']} layers ({_fmt_layer_types(t['layer_types'])}), hidden "
        f"{t['hidden_size']}, vocab {fmt_count(t['vocab_size'])}, {_fmt_params(t)}  [{t['source']}]",
        f"        layer ids {t['layer_ids']}  [{t['layer_ids_source']}]"
        + (f", and the verifier's layer {t['verifier_layer']} (its distribution for train.loss; the forward runs to "
           "the last layer)" if t.get("verifier_layer") is not None else ""),
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
        f"  window: the budget holds {_fmt_share(b['window_fraction'])} of the dump "
        f"(~{fmt_count(b['window_samples'])} samples, ~{fmt_count(b['window_steps'])} optimizer steps of them)",
        *([f"  replays the kept store {b['replay']['from_store']}: up to "
           f"{fmt_bytes(b['replay']['host_bytes_per_extractor'])} of decoded states in host RAM per extractor "
           "(to reshuffle the later passes)"] if b.get("replay") else []),
        f"  disk at {disk['checked']}: {fmt_bytes(disk['free_bytes'])} free, "
        f"{fmt_bytes(disk['headroom_bytes'])} left after the budget",
    ]
    if "offline_note" in disk:
        out.append(f"  {disk['offline_note']}")
    out += render_disk(disk)
    out += ["", *render_memory(plan["memory"])]
    out += ["", *_render_host_memory(plan["host_memory"])]
    out += ["", *_render_roles(plan["launch"], plan["roles"])]
    mode = "extractors and trainers side by side" if tp["overlapped"] else "one process alternates"
    out += ["", f"time  ({tp['processes']} process(es), {mode})"]
    out.append(f"  {_fmt_gpus(tp['gpus'], tp['regenerate'], plan['extract'])}")
    x = plan["extract"]
    if x["engine"] == "vllm":
        out.append(f"  states from {x['servers']} vLLM server(s) of {x['tensor_parallel_size']} GPU(s) through the spool "
                   f"{x['spool']} (at most {fmt_bytes(x['spool_bytes'])} in flight, shared by the extractors); "
                   "`dflash-stream serve-command` prints how to start them")
    out += [f"  kernels: {k}" for k in plan.get("kernels", [])]
    data = tp["phases"]["data"]
    r = tp["regenerate"]
    if r and r["engine"] == "openai":
        out.append(f"  {'data':<8}{fmt_duration(data.get('seconds')):>10}  regeneration on {r['endpoints']} "
                   f"endpoint(s) beside the launch, overlapped with extraction: {r['response_tokens']:,.0f} tokens "
                   f"per answer at {r['tokens_per_s']:,.0f} tok/s x {r['endpoints']}  [{r['tokens_per_s_source']}]")
        out += [f"  {'':<18}assumed: {a}" for a in r["assumptions"]]
    elif r:
        out.append(f"  {'data':<8}{fmt_duration(data.get('seconds')):>10}  regeneration on the extractors, "
                   f"{r['seconds_per_sample']:.3g} s per sample on one process ({r['step_seconds'] * 1e3:.1f} ms per "
                   f"decode step of {r['batch_size']} rows)")
        out += [f"  {'':<18}assumed: {a}" for a in r["assumptions"]]
    else:
        out.append(f"  {'data':<8}{'-':>10}  {data['source']}")
    for name in ("extract", "train"):
        ph = tp["phases"][name]
        out.append(f"  {name:<8}{fmt_duration(ph.get('seconds')):>10}  {ph['tok_s_per_process']:>12,.0f} tok/s x "
                   f"{ph['processes']}  [{ph['source']}]")
    st = tp["phases"]["store"]
    out.append(f"  {'store':<8}{fmt_duration(st.get('encode_cpu_seconds')):>10}  encoding, summed over extractors "
               f"[{st['source']}]")
    c = tp.get("checkpoints")
    if c and c["every_seconds"]:
        out.append(f"  {'ckpt':<8}{fmt_duration(c['count'] * c['stall_seconds']):>10}  {c['count']:,} x "
                   f"{fmt_bytes(c['bytes'])}, one every {fmt_duration(c['every_seconds'])} ({c['forced_by']}): "
                   f"{fmt_duration(c['write_seconds'])} each, {c['stall_fraction']:.1%} of training stopped  "
                   f"[{c['source']}]")
    out.append(f"  {'export':<8}{'-':>10}  {tp['phases']['export']['source']}")
    out.append(f"  {'total':<8}{fmt_duration(tp['total_seconds']):>10}")
    if c:
        out += ["", *render_release(c)]
    e = plan["epochs"]
    out += ["", f"epochs  {e['epochs']} with epoch_source={e['chosen']}"]
    for name in ("reuse", "reextract"):
        c = e[name]
        out.append(f"  {name:<10} extraction {fmt_duration(c['extract_seconds'])}, writes "
                   f"{fmt_bytes(c['bytes_written'])}: {c['note']}")
    out += render_store_cores(plan["store_cores"])
    out += [f"\nwarning: {w}" for w in plan["warnings"]]
    return "\n".join(out)


def _render_host_memory(host: dict[str, Any]) -> list[str]:
    out = [f"host memory per process  (hidden states held in RAM, beside the process's own runtime; lower it "
           f"with {host['knobs']})"]
    for role in ("extractor", "trainer"):
        r = host[role]
        parts = ", ".join(f"{name.replace('_', ' ')} {fmt_bytes(n)}" for name, n in r["parts"].items())
        # Only trainer 0 writes the model and optimizer files, so only it keeps their snapshot.
        label = "trainer 0" if "checkpoint_snapshot" in r["parts"] else role
        out.append(f"  {label:<10} up to {fmt_bytes(r['total_bytes']):>10}  ({parts})")
    m = host.get("machine")
    if "checkpoint_snapshot" in host["trainer"]["parts"] and (m is None or m["launch_trainers"] > 1):
        others = host["trainer"]["total_bytes"] - host["trainer"]["parts"]["checkpoint_snapshot"]
        out.append(f"  {'trainer 1+':<10} up to {fmt_bytes(others):>10}  (the same without the snapshot)")
    if m:
        who = f"{m['extractors']} extractor(s) + {m['trainers']} trainer(s)" + (", trainer 0 among them"
                                                                               if m["trainer_0"] else "")
        out.append(f"  {'machine':<10} up to {fmt_bytes(m['bytes']):>10}  (the busiest: {who}; this machine has "
                   f"{fmt_bytes(m['this_machine_bytes'])} of RAM)")
    return out


def render_release(c: dict[str, Any]) -> list[str]:
    """Both release rules side by side: their checkpoints and what one crash costs (-> the configured one)."""
    out = [f"release  train.release: {c['rule']}" + (f"  ({c['why']})" if c["why"] else "")]
    if c["rules"][c["rule"]] is None:
        return [*out, "  (checkpoint counts need the data's size and the rates)"]
    out.append(f"  {'':<20}{'checkpoints':>12}{'written':>12}{'stall':>8}{'every':>10}   one crash costs at most: "
               "training lost + re-extraction")
    for rule, r in c["rules"].items():
        mark = "->" if rule == c["rule"] else ""
        again = fmt_duration(r["reextract_seconds"]) if r["reextract_seconds"] else "none"
        out.append(f"  {mark:<3}{rule:<17}{r['count']:>12,}{fmt_bytes(r['bytes_written']):>12}"
                   f"{r['stall_fraction']:>8.2%}{fmt_duration(r['every_seconds']):>10}   "
                   f"{fmt_duration(r['training_lost_seconds'])} + {again}"
                   + (f" ({fmt_count(r['reextract_tokens'])} tokens)" if r["reextract_seconds"] else "")
                   + f"  [{r['forced_by']}]")
    return out


def render_memory(mem: dict[str, Any]) -> list[str]:
    """The memory section of plan's terminal page."""
    out = [f"memory per process  (device {fmt_bytes(mem['device_bytes'])} [{mem['device_source']}]; estimates may "
           f"fill {mem['usable_fraction']:.0%} = {fmt_bytes(mem['usable_bytes'])})"]
    if mem["single_process"]:
        out.append("  one process holds both roles: each role's peak sits beside the other's resident part")
    for role in ("extractor", "trainer"):
        r = mem[role]
        verdict = "fits" if r["fits"] else f"DOES NOT FIT: {r['knob']}"
        phases = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["phases"].items())
        batch = ", ".join(f"{k} {v:,}" for k, v in r["worst_batch"].items())
        out.append(f"  {role:<10}{fmt_bytes(r['total_bytes']):>12}  {verdict}  (phases: {phases})")
        out.append(f"  {'':<10}{'':>12}  worst batch: {batch}")
        out += [f"  {'':<10}{fmt_bytes(v):>12}  {k}" for k, v in r["parts"].items() if v]
    out += [f"  assumed: {a}" for a in mem["assumptions"]]
    return out


def render_disk(disk: dict[str, Any]) -> list[str]:
    """The whole footprint, part by part, and each filesystem's need against its free space."""
    params = disk["drafter_params"]
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    out = ["", f"disk  (the whole run: {fmt_bytes(disk['total_bytes'])}; drafter {size} parameters "
           f"[{disk['drafter_params_source']}])"]
    out += [f"  {name:<12}{fmt_bytes(size):>12}" for name, size in disk["parts"].items()]
    for mount, fs in disk["by_filesystem"].items():
        verdict = "fits" if fs["fits"] else "DOES NOT FIT"
        own = f" + {fmt_bytes(fs['existing_bytes'])} of this run's files" if fs["existing_bytes"] else ""
        out.append(f"  {mount}: needs {fmt_bytes(fs['need_bytes'])} ({', '.join(fs['parts'])}), "
                   f"{fmt_bytes(fs['free_bytes'])} free{own}: {verdict}")
    if conversion := disk.get("gguf_conversion"):
        state = {"present": "there already",
                 "written": "written by the run's first load (a tenth of the free space at most)",
                 "skipped": f"not written: more than a tenth of the {fmt_bytes(conversion.get('free_bytes', 0))} "
                            "free there, so loads read the GGUF file"}[conversion["state"]]
        out.append(f"  outside the run: the GGUF target's conversion, {fmt_bytes(conversion['bytes'])} at "
                   f"{conversion['path']}: {state}")
    return out


def _fmt_gpus(gpus: dict[str, int], regen: dict[str, Any] | None, extract: dict[str, Any]) -> str:
    """'GPUs: 4 in the launch + 4 serving (4 regeneration endpoints x 1) = 8'."""
    if not gpus["total"]:
        return "GPUs: none (target.device cpu)"
    parts = []
    if gpus["extraction_servers"]:
        parts.append(f"{extract['servers']} vLLM extraction server(s) x TP {extract['tensor_parallel_size']}"
                     + (", answering the regeneration requests too" if extract["regenerates_too"] else ""))
    if gpus["regeneration_servers"]:
        parts.append(f"{gpus['regeneration_servers'] // regen['gpus_per_endpoint']} endpoints x "
                     f"{regen['gpus_per_endpoint']}")
    served = f" ({'; '.join(parts)})" if parts else ""
    launch = " (trainers; the extractors ask the servers from CPU processes)" if extract["engine"] == "vllm" else ""
    return f"GPUs: {gpus['launch']} in the launch{launch} + {gpus['serving']} serving{served} = {gpus['total']}"


def _render_roles(launch: dict[str, Any], roles: dict[str, Any]) -> list[str]:
    out = [f"roles  ({launch['num_processes']} process(es) on {launch['num_machines']} machine(s) "
           f"[{launch['source']}]; {roles['chosen_by']})"]
    if roles["mode"] == "single":
        return out + ["  one process extracts until the buffer is full, trains on it, and repeats"]
    out.append(f"  {'':<4}{'extractors':>10}{'trainers':>10}{'wall':>12}")
    for alt, relative in zip(roles["alternatives"], roles["alternatives_relative"], strict=True):
        mark = "->" if alt["trainers"] == roles["trainers"] else ""
        wall = fmt_duration(alt["wall_seconds"]) if alt["wall_seconds"] is not None else f"{relative:.2f}x best"
        best = "  (shortest)" if alt["trainers"] == roles["best_trainers"] else ""
        out.append(f"  {mark:<4}{alt['extractors']:>10}{alt['trainers']:>10}{wall:>12}{best}")
    out.append(f"  rates: {roles['source']}")
    return out


def _fmt_wraps(wraps: float | None) -> str:
    if wraps is None:
        return "the buffer wraps ? times"
    return f"the buffer wraps {wraps:,.1f} times" if wraps > 1 else "all the data fits: the buffer never wraps"
