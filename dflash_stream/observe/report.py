"""`dflash-stream report`: PNG plots of a run from its metrics (OUTPUT/report/*.png)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dflash_stream.observe.metrics import read_metrics  # noqa: E402
from dflash_stream.rundir import RunDir  # noqa: E402

GIB = 2**30
MIB = 2**20
PLOT_EVENTS = {"buffer": "store", "rates": "extract/train", "loss": "train", "accuracy": "train",
               "checkpoints": "checkpoint"}
"""Each plot and the metrics events it is drawn from."""
Events = list[dict[str, Any]]


def _time_axis(events: Events, t0: float) -> tuple[float, str]:
    """A divisor and label that keep the time axis in readable units for the run's length."""
    span = max(e["time"] for e in events) - t0
    if span < 180:
        return 1.0, "seconds since start"
    if span < 3 * 3600:
        return 60.0, "minutes since start"
    return 3600.0, "hours since start"


def _by_rank(events: Events, name: str) -> dict[tuple[str, int], Events]:
    out: dict[tuple[str, int], Events] = defaultdict(list)
    for e in events:
        if e["event"] == name:
            out[(e["role"], e["rank"])].append(e)
    return dict(sorted(out.items()))


def _finite(values) -> np.ndarray:
    arr = np.asarray([np.nan if v is None else v for v in values], dtype=float)
    return arr[np.isfinite(arr)]


def _scale_to_data(ax, values, floor: float | None = 0.0, cap: float | None = None, head_room: float = 1.15) -> None:
    """Y limits from the data drawn (not matplotlib's padding, nor a fixed 0..1): from `floor` (None: the
    data's own minimum) to a little above the largest value (never above `cap`)."""
    data = _finite(values)
    if not len(data):
        return
    high = float(data.max())
    low = float(data.min()) if floor is None else floor
    span = high - low
    top = high + span * (head_room - 1) if span > 0 else (high * head_room if high > 0 else 1.0)
    bottom = low - span * 0.05 if floor is None and span > 0 else low
    ax.set_ylim(bottom, min(top, cap) if cap is not None else top)


def _legend(ax, **kwargs) -> None:
    """A legend only for the series actually drawn (those with a label and finite data)."""
    handles = [h for h in ax.get_lines() if not h.get_label().startswith("_") and len(_finite(h.get_ydata()))]
    if handles:
        ax.legend(handles=handles, **kwargs)


def plot_buffer(events: Events, t0: float) -> Figure | None:
    """Bytes on disk (published + reserved) against the budget."""
    store = [e for e in events if e["event"] == "store"]
    if not store:
        return None
    div, unit = _time_axis(events, t0)
    scale, size_unit = (GIB, "GiB") if store[-1]["budget_bytes"] >= GIB else (MIB, "MiB")
    t = [(e["time"] - t0) / div for e in store]
    used = [e["used_bytes"] / scale for e in store]
    reserved = [(e["used_bytes"] + e.get("reserved_bytes", 0)) / scale for e in store]
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    # Occupancy holds between samples (a publish or a release), so it is drawn as steps, not slopes.
    ax.plot(t, used, color="tab:blue", lw=1.8, drawstyle="steps-post", label="published segments")
    ax.fill_between(t, used, reserved, step="post", color="tab:orange", alpha=0.35, label="reserved by writers")
    ax.fill_between(t, 0, used, step="post", color="tab:blue", alpha=0.15)
    ax.plot(t, [e["budget_bytes"] / scale for e in store], color="tab:red", ls="--", lw=1.5, label="budget")
    ax.set(title="Ring buffer occupancy", xlabel=unit, ylabel=f"{size_unit} on disk")
    _scale_to_data(ax, reserved + [e["budget_bytes"] / scale for e in store], head_room=1.1)
    _legend(ax, loc="lower right")
    ax.grid(alpha=0.3)
    return fig


def _bin_edges(groups: list[Events], t0: float, t1: float) -> np.ndarray:
    """Shared time bins: ~60 over the run, but at least three report periods of the sparsest rank wide, so a
    rank that reports in bursts (one batch, several segments) reads as a rate, not as spikes."""
    gaps = [(evs[-1]["time"] - evs[0]["time"]) / (len(evs) - 1) for evs in groups if len(evs) > 1]
    width = max((t1 - t0) / 60, 3 * max(gaps, default=0.0), 1e-3)
    # Whole bins from the first to the last event: no bin reaches past the data and dilutes its rate.
    return np.linspace(t0, t1, max(1, int((t1 - t0) // width)) + 1)


def binned_rates(events: Events, started: float | None, edges: np.ndarray) -> np.ndarray:
    """Tokens/s per bin from the cumulative `tokens` counter, taken as growing evenly between two reports
    (counting whole reports per bin would alias with the report period); NaN (a gap in the curve) for bins
    wholly outside the rank's life. A restarted rank's counter may step back: that bin counts as 0."""
    times = [e["time"] for e in events]
    tokens = [e["tokens"] for e in events]
    # The first report's tokens took about one report period, and not the model loading before it.
    period = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    born = times[0] - period if started is None else max(started, times[0] - period)
    if born < times[0]:
        times, tokens = [born, *times], [0, *tokens]
    cumulative = np.interp(edges, times, tokens)
    rates = np.clip(np.diff(cumulative) / np.diff(edges), 0, None)
    rates[(edges[1:] <= times[0]) | (edges[:-1] >= times[-1])] = np.nan
    return rates


def plot_rates(events: Events, t0: float) -> Figure | None:
    """Producer and consumer tokens/s per rank, and the time each side spent blocked."""
    extract, train = _by_rank(events, "extract"), _by_rank(events, "train")
    if not extract and not train:
        return None
    div, unit = _time_axis(events, t0)
    edges = _bin_edges([*extract.values(), *train.values()], t0, max(e["time"] for e in events))
    centers = (edges[:-1] + edges[1:]) / 2
    starts = {(e["role"], e["rank"]): e["time"] for e in events if e["event"] == "start"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, layout="constrained")
    series = [(extract, "backpressure_s", "tab:green", "blocked on full buffer"),
              (train, "data_wait_s", "tab:purple", "waited for data")]
    drawn: dict[Any, list[float]] = {top: [], bottom: []}
    for groups, blocked_key, color, blocked_label in series:
        for i, ((role, rank), evs) in enumerate(groups.items()):
            t = [(e["time"] - t0) / div for e in evs]
            style = dict(color=color, alpha=1.0 if i == 0 else 0.6, ls="-" if i == 0 else ":")
            rates = binned_rates(evs, starts.get((role, rank)), edges)
            if (_finite(rates) > 0).any():  # a rank with a single report has no rate to draw
                top.plot((centers - t0) / div, rates, label=f"{role} {rank} tok/s", drawstyle="steps-mid", **style)
                drawn[top] += list(rates)
            blocked = [(e.get(blocked_key) or 0) / div for e in evs]
            bottom.plot(t, blocked, label=f"{role} {rank}: {blocked_label}", **style)
            drawn[bottom] += blocked
    top.set(title="Producer (extract) and consumer (train) throughput", ylabel="tokens / s")
    bottom.set(title="Time blocked (cumulative)", xlabel=unit, ylabel=unit.split()[0])
    for ax in (top, bottom):
        # Headroom above the curves keeps the one-row legend off the data.
        _scale_to_data(ax, drawn[ax], head_room=1.3)
        _legend(ax, loc="upper left", fontsize="small", ncol=3)
        ax.grid(alpha=0.3)
    return fig


def _lead_trainer(events: Events) -> Events:
    """The lowest trainer rank's `train` events: loss and accuracies are reduced across ranks."""
    groups = _by_rank(events, "train")
    return min(groups.items(), key=lambda kv: kv[0][1])[1] if groups else []


def plot_loss(events: Events) -> Figure | None:
    """Training loss and the acceptance-length estimate tau against the step."""
    train = _lead_trainer(events)
    if not train:
        return None
    steps = [e["step"] for e in train]
    loss = [e["loss"] for e in train]
    tau = [e.get("tau") for e in train]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, layout="constrained")
    top.plot(steps, loss, color="tab:blue", lw=1.5)
    top.set(title="Training loss", ylabel="weighted CE")
    # The first points (an untrained drafter) sit far above the rest: scale to the curve after them, and
    # say where they are.
    skip = max(1, len(loss) // 20) if len(loss) >= 5 else 0
    _scale_to_data(top, loss[skip:], floor=None, head_room=1.1)
    above = [(s, v) for s, v in zip(steps, loss, strict=True) if v > top.get_ylim()[1]]
    if above:
        top.annotate(f"off the axis: step {above[0][0]} loss {above[0][1]:.2f}" + (
            f" (+{len(above) - 1} more)" if len(above) > 1 else ""), xy=(0.99, 0.97), xycoords="axes fraction",
            ha="right", va="top", fontsize="small", color="tab:blue")
    bottom.plot(steps, tau, color="tab:green", lw=1.5)
    bottom.set(title="Acceptance length estimate tau", xlabel="step", ylabel="tokens per verification")
    _scale_to_data(bottom, tau, floor=None, head_room=1.1)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return fig


def plot_accuracy(events: Events) -> Figure | None:
    """Per-slot draft accuracy: slot 1 (next token) on top, later slots below it."""
    train = [e for e in _lead_trainer(events) if e.get("acc")]
    if not train:
        return None
    steps = [e["step"] for e in train]
    slots = len(train[-1]["acc"])
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    for k in range(slots):
        ax.plot(steps, [e["acc"][k] if k < len(e["acc"]) else None for e in train],
                color=cmap(k / max(slots - 1, 1)), lw=1.4, label=f"slot {k + 1}")
    ax.set(title="Per-slot accuracy (slot k predicts the token k after the anchor)", xlabel="step",
           ylabel="accuracy")
    _scale_to_data(ax, [a for e in train for a in e["acc"]], cap=1.0, head_room=1.35)  # room for the legend
    _legend(ax, ncol=min(slots, 5), fontsize="small", loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def plot_checkpoints(events: Events, t0: float) -> Figure | None:
    """What each checkpoint cost the lead trainer: seconds training stood still, and of those seconds writing
    files. A small budget forces frequent checkpoints (a segment leaves only once one records it), so this is
    where a budget too small for the drafter's state shows."""
    groups = {key: [e for e in evs if "stall_s" in e] for key, evs in _by_rank(events, "checkpoint").items()
              if key[0] in ("trainer", "single")}
    timed = min(((key, evs) for key, evs in groups.items() if evs), key=lambda kv: kv[0][1], default=None)
    if timed is None:
        return None
    div, unit = _time_axis(events, t0)
    evs = timed[1]
    t = [(e["time"] - t0) / div for e in evs]
    stall, write = [e["stall_s"] for e in evs], [e.get("write_s") or 0.0 for e in evs]
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    ax.plot(t, stall, "o-", color="tab:red", ms=3, lw=1, label="training stood still (s)")
    ax.plot(t, write, "o-", color="tab:blue", ms=3, lw=1, label="writing files (s)")
    size = f", {evs[-1]['bytes'] / MIB:,.1f} MiB each" if evs[-1].get("bytes") is not None else ""
    ax.set(title=f"Checkpoints: {len(evs)}{size}; training stood still {sum(stall):,.1f} s in all",
           xlabel=unit, ylabel="seconds per checkpoint")
    _scale_to_data(ax, stall + write, head_room=1.3)
    _legend(ax, loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def build_figures(events: Events) -> dict[str, Figure]:
    """Every plot the metrics have data for, by file stem."""
    t0 = min(e["time"] for e in events)
    figures = {"buffer": plot_buffer(events, t0), "rates": plot_rates(events, t0),
               "loss": plot_loss(events), "accuracy": plot_accuracy(events),
               "checkpoints": plot_checkpoints(events, t0)}
    return {name: fig for name, fig in figures.items() if fig is not None}


def write_report(output_dir: str | Path, folder: str | Path | None = None) -> list[Path]:
    """Write <plot>.png for each plot with data into `folder` (default OUTPUT/report); the paths written."""
    run = RunDir(output_dir)
    events = read_metrics(run.root)
    if not events:
        raise FileNotFoundError(f"no metrics in {run.metrics}: nothing to plot")
    folder = Path(folder) if folder is not None else run.report
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in build_figures(events).items():
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
