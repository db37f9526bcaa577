"""What a run's sizes are computed from besides the config: the data's sample count and mean length, and `tune`'s
measurements of this target (OUTPUT/tune.json). Each figure comes with the source it was taken from, which
`plan` names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_stream.config import Config
from dflash_stream.target_model.shape import TargetShape


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
    if (tune.get("layer_ids") != layer_ids or tune.get("hidden_size") != shape.hidden_size
            or tune.get("verifier_states", False) != cfg.verifier_states):
        return None, f"{path} was measured on another target/layer set (or extract.verifier_states); ignored"
    return tune, None


DATA_SUMMARY_NOTE = "counted by `dflash-stream data`"


def read_data_summary(cfg: Config) -> dict[str, Any] | None:
    """OUTPUT/data/summary.json that `dflash-stream data` wrote for this config's data (same data spec and
    max_length), else None: samples kept after filtering and their mean length."""
    from dflash_stream.data.spec import data_spec_digest

    path = Path(cfg.output_dir) / "data" / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    same = summary.get("data_spec") == data_spec_digest(cfg) and summary.get("max_length") == cfg.data.max_length
    return summary if same else None


def plan_samples(cfg: Config, samples: int | None) -> tuple[int | None, str]:
    """(samples, where the figure comes from): --samples, data.expected_samples, `dflash-stream data`'s count, or
    the local sources' rows under their limits and weights (None when a hub source has no limit)."""
    from dflash_stream.data.sources import count_row_copies

    if samples:
        return samples, "given (--samples)"
    expected = cfg.data.expected_samples
    if expected:
        return expected, "config (data.expected_samples)"
    counted = read_data_summary(cfg)
    if counted:
        return counted["samples"], f"{DATA_SUMMARY_NOTE}: kept after filtering, of {counted['rows']:,} rows"
    sizes, how = [], set()
    for src in cfg.data.sources:
        rows = source_rows(src.path)
        if rows is None and src.limit is None:
            return None, f"unknown: {src.path} is not a local file; pass --samples"
        sizes.append(min(rows, src.limit or rows) if rows is not None else src.limit)
        how.add("rows counted" if rows is not None else "source limit")
    # The data part's own rule for limits and weights that repeat rows.
    return count_row_copies(cfg.data, sizes), f"{' + '.join(sorted(how))}, before filtering"


def plan_mean_tokens(cfg: Config, mean_tokens: float | None, tune: dict | None) -> tuple[float, str]:
    """(tokens per sample, where the figure comes from): --mean-tokens, data.mean_tokens, tune's or `dflash-stream
    data`'s measurement, else half of data.max_length."""
    if mean_tokens:
        return mean_tokens, "given (--mean-tokens)"
    configured = cfg.data.mean_tokens
    if configured:
        return configured, "config (data.mean_tokens)"
    if tune and tune.get("mean_tokens"):
        return tune["mean_tokens"], f"measured by tune on {tune['samples']} samples"
    counted = read_data_summary(cfg)
    if counted and counted.get("mean_tokens"):
        return counted["mean_tokens"], (f"{DATA_SUMMARY_NOTE} over {counted['samples']:,} samples "
                                        f"({counted['mean_tokens_basis']})")
    return cfg.data.max_length / 2, "assumed: data.max_length / 2 (pass --mean-tokens or run tune)"
