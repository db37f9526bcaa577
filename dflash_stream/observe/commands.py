"""`plan`, `tune`, `status` and `report`: look at a run before, during and after it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_stream.config import load_config
from dflash_stream.errors import DFlashError
from dflash_stream.log import get_logger

log = get_logger("report")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="phases, data volumes, buffer sizing, disk and time estimates from a config")
    p.add_argument("--config", required=True)
    p.add_argument("--json", action="store_true", help="the same content as JSON")
    p.add_argument("--samples", type=int, help="sample count, when the data sources cannot be counted locally")
    p.add_argument("--mean-tokens", type=float, help="average tokens per sample (default: tune's figure)")
    launch = p.add_mutually_exclusive_group()
    launch.add_argument("--launch", metavar="FILE", help="the accelerate config of the launch (num_processes, "
                                                          "num_machines)")
    launch.add_argument("--processes", type=int, help="processes of the launch (extractors + trainers); default 1")
    p.add_argument("--gpu-memory", metavar="SIZE", help="memory of each GPU, e.g. 96GB (default: roles.device_memory, "
                                                        "else 80 GiB)")
    p.set_defaults(func=_plan, overrides=[])

    t = sub.add_parser("tune", help="measure compression and throughputs on this target; recommend a budget")
    t.add_argument("--config", required=True)
    t.add_argument("--samples", type=int, default=16, help="samples to extract and train on")
    t.add_argument("--train-steps", type=int, default=4)
    t.set_defaults(func=_tune, overrides=[])

    s = sub.add_parser("status", help="live view of a run from its output folder (all ranks)")
    s.add_argument("output")
    s.add_argument("--watch", action="store_true", help="refresh until the run ends (Ctrl-C to leave)")
    s.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --watch")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)

    r = sub.add_parser("report", help="PNG plots of buffer occupancy, rates, loss and per-slot accuracy")
    r.add_argument("output")
    r.add_argument("--out", help="folder for the PNGs (default: OUTPUT/report)")
    r.set_defaults(func=_report)


def _plan(args: argparse.Namespace) -> int:
    from dflash_stream.observe.plan import build_plan, render_plan
    from dflash_stream.sizing.memory import parse_size

    gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory else None
    plan = build_plan(load_config(args.config, args.overrides), args.samples, args.mean_tokens, args.processes,
                      args.launch, gpu_memory)
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    return 0


def _tune(args: argparse.Namespace) -> int:
    from dflash_stream.observe.tune import run_tune

    run_tune(load_config(args.config, args.overrides), args.samples, args.train_steps)
    return 0


def _status(args: argparse.Namespace) -> int:
    from dflash_stream.observe.status import collect_status, render_status, watch

    try:
        if args.watch:
            return watch(args.output, args.interval)
        status = collect_status(args.output)
    except FileNotFoundError as err:
        raise DFlashError(str(err)) from err
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def _report(args: argparse.Namespace) -> int:
    from dflash_stream.observe.report import PLOT_EVENTS, write_report
    from dflash_stream.preflight import probe_writable

    probe_writable(args.out or Path(args.output) / "report", "report --out")
    try:
        paths = write_report(args.output, args.out)
    except FileNotFoundError as err:
        raise DFlashError(str(err)) from err
    for path in paths:
        print(path)
    from dflash_stream.observe.summary import read_summary
    from dflash_stream.rundir import RunDir

    summary = read_summary(RunDir(args.output)) or {}
    if summary.get("missing_parts"):
        log.warning("summary.json lacks the figures of %s: no summary part from it (it died or still runs)",
                    ", ".join(summary["missing_parts"]))
    drawn = {p.stem for p in paths}
    for name, event in PLOT_EVENTS.items():
        if name not in drawn:
            log.warning("%s.png not drawn: the metrics have no `%s` events", name, event)
    return 0
