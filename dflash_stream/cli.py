"""The `dflash-stream` command.

Each part registers its own subcommands. Only the module of the command being run is imported, so cheap
commands (`status`, `store status`, `audit`, `plan`) start without importing torch.

Exit codes: 0 success; 1 a check that ran and failed (audit, eval output differs, store verify); 2 a problem
the user can fix, printed as one line (`DFlashError`: config, paths, store mismatch; or an OSError on a path);
130 interrupted (Ctrl-C); 141 the reader of stdout left early (`| head`, quietly); 143 stopped by SIGTERM after
a checkpoint (rerun to resume). Only this module prints errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dflash_stream import __version__
from dflash_stream.diskfull import is_full
from dflash_stream.errors import DFlashError, os_error_line

# command -> the module whose `register(subparsers)` defines it (a module may define several commands)
COMMANDS = {
    "run": "dflash_stream.pipeline.run",
    "data": "dflash_stream.observe.data_overview",
    "extract": "dflash_stream.pipeline.extract_command",
    "train": "dflash_stream.pipeline.trainer",
    "audit": "dflash_stream.pipeline.audit",
    "export": "dflash_stream.drafter.commands",
    "eval": "dflash_stream.drafter.commands",
    "plan": "dflash_stream.observe.commands",
    "tune": "dflash_stream.observe.commands",
    "status": "dflash_stream.observe.commands",
    "report": "dflash_stream.observe.commands",
    "store": "dflash_stream.store.commands",
    "regenerate": "dflash_stream.regenerate.phase",
    "serve-command": "dflash_stream.target_model.vllm_serve",
}
# bench name -> the module whose `register_bench(subparsers)` defines it
BENCHES = {
    "store": "dflash_stream.bench.store",
    "extract": "dflash_stream.bench.extract",
    "pipeline": "dflash_stream.bench.pipeline",
    "compile": "dflash_stream.bench.compile",
    "memory": "dflash_stream.bench.memory",
    "gpu": "dflash_stream.bench.gpu",
    "quality": "dflash_stream.bench.quality",
    "checkpoint": "dflash_stream.bench.checkpoint",
    "regenerate": "dflash_stream.bench.regenerate",
    "eval-engines": "dflash_stream.bench.engines",
}


def _requested(argv: list[str], names: dict[str, str]) -> list[str]:
    """The module for the first positional word of argv, or every module (for --help or a typo)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return [names[word]] if word in names else list(dict.fromkeys(names.values()))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dflash-stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dflash-stream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = _requested(argv, COMMANDS | {"bench": ""})
    for name in modules:
        if name:
            importlib.import_module(name).register(sub)
    bench = sub.add_parser("bench", help="benchmarks that print figures beside their baselines")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    if "" in modules:
        rest = argv[argv.index("bench") + 1:] if "bench" in argv else []
        for name in _requested(rest, BENCHES):
            importlib.import_module(name).register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # Only commands that take a config accept `--section.key=value` overrides.
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overrides"):
        args.overrides = extra
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # inside the try: a reader that left early is handled below, not at exit
        return code
    except DFlashError as err:
        print(f"dflash-stream: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`status --json | head`): what is left to print goes nowhere, quietly,
        # including the interpreter's final flush of stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:  # a path the user named cannot be read or written: one line, not a traceback
        print(f"dflash-stream: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a full disk as a library reports it (safetensors: "os error 28"); every write resumes
        if not is_full(err):
            raise
        print(f"dflash-stream: error: disk full ({err}); free space and run the same command again", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
