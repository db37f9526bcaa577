"""The `dflash-stream` command. Each part registers its own subcommands; heavy imports happen inside them."""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash_stream.errors import DFlashError

# Modules that define `register(subparsers)` (top-level commands) and/or `register_bench(subparsers)`.
COMMAND_MODULES = [
    "dflash_stream.store.commands",
    "dflash_stream.pipeline.extractor",
    "dflash_stream.pipeline.trainer",
    "dflash_stream.drafter.commands",
    "dflash_stream.pipeline.run",
    "dflash_stream.observe.commands",
]
BENCH_MODULES = [
    "dflash_stream.bench.store",
    "dflash_stream.bench.extract",
    "dflash_stream.bench.pipeline",
    "dflash_stream.bench.memory",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-stream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    bench = sub.add_parser("bench", help="benchmarks that print figures beside their baselines")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Only commands that take a config accept `--section.key=value` overrides.
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overrides"):
        args.overrides = extra
    try:
        return args.func(args) or 0
    except DFlashError as err:
        print(f"dflash-stream: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
